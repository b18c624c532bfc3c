"""A run's peak memory before it starts, for the fit check and --batch-size auto (docs/planning.md)."""

import bisect
import math
import os
import re
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from configs import TrainConfig
from configs.errors import UserError, first_line
from configs.model import GPTConfig
from model.gpt import GPT
from training.optim import Muon, configure_optimizer

F32 = 4  # bytes of a float32: parameters, gradients, optimizer state, the residual stream
GiB = 2**30
USABLE = 0.9  # the share of a GPU's memory to plan on: the CUDA context and the allocator's fragments take the rest
ADVICE = "use --batch-size auto, a smaller --block-size or a smaller model"


def meta_model(mc: GPTConfig) -> GPT:
    """The model on the meta device, which holds shapes only."""
    try:
        with torch.device("meta"):
            return GPT(mc)
    except RuntimeError as e:  # a weight of more bytes than an int64 counts, which no device holds
        raise UserError(f"this model is too big to plan, let alone train ({first_line(e)}); use a smaller "
                        "--n-embd, --n-layer or --vocab-size") from None


def activation_bytes(mc: GPTConfig, batch: int, seq: int, low_precision: bool, compiled: bool) -> int:
    """The peak's bytes that grow with the batch: what each layer saves for the backward, and its largest transient."""
    a = 2 if low_precision else F32
    copy = a if low_precision else 0  # autocast's low-precision copy of an fp32 tensor
    C, H, V, nh = mc.n_embd, mc.mlp_ratio * mc.n_embd, mc.vocab_size, mc.n_head
    scores = nh * seq  # attention-score entries per token in one layer: (B, nh, T, T) / (B * T)
    explicit = mc.attention == "explicit"
    norm = F32 * C + 2 * F32 + (F32 * C if mc.norm == "rmsnorm" else 0)  # input, mean/rstd, x * rstd
    # the two norms, c_attn's input, q/k/v, the attention output, c_fc's input, the MLP hidden twice
    layer = 2 * norm + a * C + 3 * a * C + a * C + a * C + 2 * a * H
    if mc.pos_emb == "rope" and not explicit:  # the explicit path copies q, k, v for its matmuls anyway
        layer += 2 * a * C
    if mc.qk_norm:
        layer += 2 * (2 * F32 + copy) * C
    layer += (F32 + (0 if compiled else copy)) * scores if explicit else F32 * nh
    if mc.dropout:
        layer += 2 * C + (scores if explicit else 0)
    head = norm + a * C + (C if mc.dropout else 0)  # ln_f, lm_head's input, the embedding dropout
    tokens = batch * seq
    loss = (a + F32) * V if compiled else (a + 3 * F32) * V
    lm_head = 2 * a * V * tokens + (copy + F32) * V * C  # the logits and their gradient, then the weight's
    last_mlp = a * V + 2 * a * H
    last_attention = a * V + (2 * F32 - copy) * scores - (F32 + a) * C - 2 * a * H if explicit else 0
    # the transient: the loss's backward, lm_head's (a fixed V x C: wins at small batches) or the last block's
    transient = max(tokens * max(loss, last_mlp, last_attention), lm_head)
    return tokens * (mc.n_layer * layer + head) + transient


@dataclass(frozen=True)
class Estimate:
    """Peak memory of one training set-up as a function of the micro-batch, from its parameter counts."""

    config: GPTConfig
    seq: int
    low_precision: bool  # bf16/fp16 autocast
    compiled: bool
    nproc: int
    params: int  # tied weights once
    matmul: int  # Linear weights and biases: autocast keeps a low-precision copy of each while the graph lives
    buffers: int  # bytes: causal masks, rotary tables
    adamw: int  # parameters AdamW updates (two moments each)
    muon: int  # parameters Muon updates (one momentum buffer each)
    muon_group: int  # the largest set of same-shape Muon weights: orthogonalized as one batch

    @classmethod
    def of(cls, model: GPT, cfg: TrainConfig, low_precision: bool, nproc: int = 1) -> "Estimate":
        """The estimate for model (a meta one will do) trained as cfg says, with cfg's optimizers."""
        opt = configure_optimizer(model, cfg, fused=False)  # no state is allocated before the first step
        muon = [p for o in opt.optimizers if isinstance(o, Muon) for g in o.param_groups for p in g["params"]]
        n_muon, shapes = sum(p.numel() for p in muon), Counter(p.shape for p in muon)
        return cls(model.config, cfg.block_size, low_precision, cfg.compile, nproc, params=model.num_params(),
                   matmul=sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)
                              for p in m.parameters()),
                   buffers=sum(b.numel() * b.element_size() for b in model.buffers()),
                   adamw=sum(p.numel() for g in opt.param_groups for p in g["params"]) - n_muon, muon=n_muon,
                   muon_group=max((shape.numel() * n for shape, n in shapes.items()), default=0))

    def memory(self, batch: int) -> dict[str, int]:
        """Peak bytes per process by part, and their "total": what lives throughout plus the largest of the rest."""
        mc, low = self.config, self.low_precision
        a, VC = (2 if low else F32), mc.vocab_size * mc.n_embd
        parts = {
            "weights and buffers": F32 * self.params + self.buffers,
            "gradients": F32 * self.params,
            "optimizer states": 2 * F32 * self.adamw + F32 * self.muon,
            "DDP gradient buckets": F32 * self.params if self.nproc > 1 else 0,
            "autocast weight copies": 2 * self.matmul if low else 0,
            "activations": activation_bytes(mc, batch, self.seq, low, self.compiled),
            # every gradient at once before any reaches .grad (the tied one twice, lm_head's in `a` too), the logits
            "compiled backward": (F32 * self.params + (F32 * VC if mc.tie_weights else 0) + (a * VC if low else 0)
                                  + a * mc.vocab_size * batch * self.seq) if self.compiled else 0,
            # a Nesterov update per weight, then the largest same-shape group stacked and orthogonalized
            "Muon step": F32 * self.muon + (16 if low else 20) * self.muon_group,
        }
        graph = parts["autocast weight copies"] + parts["activations"]
        later = parts["compiled backward"], parts["Muon step"]
        parts["total"] = sum(parts.values()) - graph - sum(later) + max(graph, *later)
        return parts

    def largest_batch(self, budget: float, divides: int = 0) -> int:
        """The largest micro-batch whose peak fits in budget bytes (0 if none), and with divides, that divides it."""
        # Memory grows with the batch, so bisection finds the last that fits among all a machine could hold.
        best = max(0, bisect.bisect_right(range(2**40), budget, key=lambda b: self.memory(b)["total"]) - 1)
        if divides:
            best = max((d for d in range(1, min(best, divides) + 1) if divides % d == 0), default=0)
        return best


def free_memory(device: str) -> int:
    """Bytes this process can still allocate on device (on MPS: Metal's recommended budget less its use)."""
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(device)[0]
    if device == "mps":
        return torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory()
    try:
        return int(re.search(r"MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text()).group(1)) * 1024
    except (OSError, AttributeError):  # not Linux: free pages, which leaves out the page cache
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def least_free(rt: Any) -> float:
    """free_memory on the run's device, the least over the processes: they must all decide alike."""
    free = torch.tensor(float(free_memory(rt.device)), device=rt.device)
    if rt.ddp:
        torch.distributed.all_reduce(free, op=torch.distributed.ReduceOp.MIN)
    return free.item()


def check_fits(cfg: TrainConfig, mc: GPTConfig, rt: Any) -> None:
    """Refuse a run whose estimated peak exceeds the free memory before its masks (block_size^2 bytes a layer) exist."""
    try:
        free = math.inf if rt.device == "mps" else least_free(rt)
    except (OSError, ValueError):  # neither MemAvailable nor sysconf's page count
        free = math.inf
    est = Estimate.of(meta_model(mc), cfg, rt.dtype != torch.float32, rt.world_size)
    need = est.memory(cfg.batch_size or 1)["total"]  # --batch-size auto: its smallest choice
    if need > free:
        raise UserError(f"this run needs about {need / GiB:.1f} GiB but the {rt.device} has "
                        f"{free / GiB:.1f} GiB available; {ADVICE}")


def out_of_memory(e: BaseException, device: str, ckpt: Path | None = None) -> UserError | None:
    """The one line for an allocation that failed anyway, or None for any other error, which keeps its traceback."""
    # the CPU allocator's error (torch 2.13) is a plain RuntimeError: only its text tells it apart
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)) or "DefaultCPUAllocator: can't allocate memory" in str(e):
        return UserError(f"out of memory on {device} ({first_line(e)}); {ADVICE}"
                         + (f"; {ckpt} is kept" if ckpt and ckpt.is_file() else ""))
    return None


def auto_batch_size(cfg: TrainConfig, model: GPT, rt: Any) -> TrainConfig:
    """--batch-size auto: the largest micro-batch that fits and divides this process's share of tokens_per_step."""
    if not cfg.tokens_per_step:
        raise UserError("--batch-size auto keeps --tokens-per-step by gradient accumulation: give it too "
                        f"(e.g. --tokens-per-step {64 * cfg.block_size * rt.world_size})")
    share, free = replace(cfg, batch_size=1).accumulation(rt.world_size), least_free(rt)
    est = Estimate.of(model, cfg, rt.dtype != torch.float32, rt.world_size)
    fit = est.largest_batch(USABLE * free, divides=share)
    why = f"{free / GiB:.1f} GiB free on {rt.device}, planning on {USABLE:.0%}"
    if not fit:
        raise UserError(f"--batch-size auto: even one sequence needs about {est.memory(1)['total'] / GiB:.2f} GiB "
                        f"({why}); lower --block-size, use a smaller model or more processes")
    bigger = next((d for d in range(fit + 1, share + 1) if share % d == 0), None)
    if rt.is_master:
        print(f"batch-size auto: {fit} sequences per micro-batch x {share // fit} accumulation x {rt.world_size} "
              f"process{'es' if rt.ddp else ''} = {cfg.tokens_per_step:,} tokens/step; estimated peak "
              f"{est.memory(fit)['total'] / GiB:.2f} GiB ({why})"
              + (f"; {bigger} would need {est.memory(bigger)['total'] / GiB:.2f} GiB" if bigger else ""))
    return replace(cfg, batch_size=fit)

