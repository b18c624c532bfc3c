"""Training step time: train.py's own step beside a plain PyTorch GPT-2.

    python -m benchmarks train --config small --iters 200        # the real recipe (Muon, RoPE)
    python -m benchmarks train --config small --impl both --iters 200 --override pos_emb=learned optimizer=adamw activation=gelu
    python -m benchmarks train --config shakespeare_gpu --impl both --override dropout=0 optimizer=adamw  # GPU

Data loading is not timed: up to 64 micro-batches are drawn up front. With --impl both the two take
turns of --block steps, so drift in the machine's load hits both alike.
"""

import argparse
import contextlib
import math
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import emit, stepper, timed
from benchmarks.runs import machine
from configs import load_config
from configs.cli import integer
from configs.errors import UserError
from model.hf import GPT2_ARCH
from training.run import Run, build_model, build_optimizer, open_data
from training.runtime import setup, trainable

# What PlainGPT implements, and how it trains: --impl plain/both needs the config to match.
PLAIN_ARCH = {**GPT2_ARCH, "tie_weights": True, "dropout": 0.0, "optimizer": "adamw"}


class PlainGPT(nn.Module):
    """The baseline, nanoGPT's GPT-2 in plain PyTorch, with fused-qkv SDPA attention and a tied head. Its
    submodules are named as model.GPT's are, so one state_dict loads into the other."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int):
        super().__init__()
        C, self.n_head = n_embd, n_head
        blocks = [nn.ModuleDict({"ln_1": nn.LayerNorm(C), "ln_2": nn.LayerNorm(C),
                                 "attn": nn.ModuleDict({"c_attn": nn.Linear(C, 3 * C), "c_proj": nn.Linear(C, C)}),
                                 "mlp": nn.ModuleDict({"c_fc": nn.Linear(C, 4 * C), "c_proj": nn.Linear(4 * C, C)})})
                  for _ in range(n_layer)]
        self.transformer = nn.ModuleDict({"wte": nn.Embedding(vocab_size, C), "wpe": nn.Embedding(block_size, C),
                                          "h": nn.ModuleList(blocks), "ln_f": nn.LayerNorm(C)})
        self.lm_head = nn.Linear(C, vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (B, T), C, t = idx.shape, self.lm_head.in_features, self.transformer
        x = t.wte(idx) + t.wpe(torch.arange(T, device=idx.device))
        for block in t.h:
            q, k, v = block.attn.c_attn(block.ln_1(x)).split(C, dim=2)
            q, k, v = (z.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(B, T, C)
            x = x + block.attn.c_proj(y)
            x = x + block.mlp.c_proj(F.gelu(block.mlp.c_fc(block.ln_2(x)), approximate="tanh"))
        logits = self.lm_head(t.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def add_train_parser(add_parser: Callable[..., argparse.ArgumentParser]) -> None:
    p = add_parser("train", help="training step time: our stack vs a plain PyTorch GPT-2")
    p.add_argument("--config", default="small", help="a configs/<name>.py or a .toml")
    p.add_argument("--iters", type=integer(1), default=100, help="timed steps per impl (the median is reported)")
    p.add_argument("--warmup", type=integer(0), default=10, help="untimed steps per impl first")
    p.add_argument("--impl", choices=("ours", "plain", "both"), default="ours")
    p.add_argument("--block", type=integer(1), default=10, help="steps per turn with --impl both (ours, plain, ...)")
    p.add_argument("--override", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="TrainConfig fields, e.g. pos_emb=learned; bare flags work too (--device cuda, --compile)")
    p.set_defaults(func=bench_train, passthrough=True)


def bench_train(args: argparse.Namespace) -> None:
    cfg = load_config(args.config, [*args.extra, *(f"--{kv}" for kv in args.override)])  # KEY=VALUE -> --KEY=VALUE
    impls = ["ours", "plain"] if args.impl == "both" else [args.impl]
    if "plain" in impls and (diff := {k: v for k, v in PLAIN_ARCH.items() if getattr(cfg, k) != v}):
        raise UserError(f"--impl {args.impl}: the plain baseline is GPT-2 trained with AdamW; config {cfg.name} "
                        f"differs in {', '.join(diff)}; add --override {' '.join(f'{k}={v}' for k, v in diff.items())}")
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp, contextlib.redirect_stdout(sys.stderr):
        rt = setup(cfg := replace(cfg, out_dir=tmp, wandb=False))  # stdout is for JSON lines only
        with open_data(cfg, rt) as data:  # train.py's data, model (compiled if asked) and optimizer, in its order
            model, cfg = build_model(cfg, rt, data.manifest, None)
            run = Run(cfg, rt, model, build_optimizer(model, cfg, rt, None), data, None, time.time())
    pool = [run.loader.next_step() for _ in range(max(1, min(64 // run.grad_accum, args.warmup + args.iters)))]
    states = {"ours": (run.model, run.optimizer, run.train_model)}
    if "plain" in impls:
        plain = PlainGPT(model.config.vocab_size, cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd).to(rt.device)
        plain.load_state_dict(model.state_dict())  # the same starting weights
        groups = [{"params": [p for p in plain.parameters() if (p.dim() >= 2) == decay],
                   "weight_decay": cfg.weight_decay if decay else 0.0} for decay in (True, False)]
        opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))  # nanoGPT's groups
        states["plain"] = (plain, opt, trainable(plain, rt, pool[0][0]))  # compiled if ours is
    runs = {name: {"step": stepper(*states[name], pool, rt, cfg.grad_clip), "times": []} for name in impls}
    for measure, total in ((False, args.warmup), (True, args.iters)):
        for done in range(0, total, args.block):
            for name in impls:
                resident = sum(_state_bytes(*s[:2]) for k, s in states.items() if k != name)
                _turn(runs[name], min(args.block, total - done), measure, rt, resident)
    _report(runs, states, run, args.iters, len(pool))


def _state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes that stay allocated between steps: parameters and optimizer state."""
    states = [s for opt in getattr(optimizer, "optimizers", [optimizer]) for s in opt.state.values()]  # a Chain's too
    tensors = [*model.parameters(), *(t for s in states for t in s.values() if torch.is_tensor(t))]
    return sum(t.numel() * t.element_size() for t in tensors)


def _turn(r: dict[str, Any], n: int, measure: bool, rt: Any, resident: int) -> None:
    """Run and time n steps of one impl, one by one, and record its peak memory. On a GPU that is the peak
    less `resident`, the other impl's weights and optimizer state; on a CPU it is the process's peak RSS."""
    if rt.device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(n):
        loss, seconds = timed(r["step"], rt.device)
        r["times"] += [seconds] if measure else []
        r.setdefault("first_loss", loss.item())  # both impls start from the same weights and batch
    if rt.device_type == "cuda":
        mem = (torch.cuda.max_memory_allocated() - resident) / 2**20
    else:  # ru_maxrss is in KiB on Linux, in bytes on macOS
        mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)
    r["mem"] = max(r.get("mem", 0.0), mem)


def _report(runs: dict[str, dict[str, Any]], states: dict[str, Any], run: Run, iters: int, pooled: int) -> None:
    cfg, rt = run.cfg, run.rt
    mem_key = "peak_gpu_mem_mb" if rt.device_type == "cuda" else "peak_rss_mb"
    for name, r in runs.items():
        seconds = statistics.median(r["times"])
        r["tok_s"] = run.tokens_per_step / seconds
        emit({"bench": "train", "config": cfg.name, "impl": name, "device": machine(rt.device),
              "threads": torch.get_num_threads(), "dtype": str(rt.dtype).removeprefix("torch."),
              "compile": rt.choices.compile, "optimizer": cfg.optimizer if name == "ours" else "torch.optim.AdamW",
              "pos_emb": cfg.pos_emb, "params": sum(p.numel() for p in states[name][0].parameters()),
              "tokens_per_step": run.tokens_per_step, "iters": iters, "ms_per_iter": round(1000 * seconds, 3),
              "ms_min": round(1000 * min(r["times"]), 3), "tokens_per_s": round(r["tok_s"], 1),
              "mfu": round(run.model.flops_per_token(cfg.block_size) * r["tok_s"] / rt.peak_flops, 4)
              if rt.peak_flops else None,  # null without a known GPU peak
              mem_key: round(r["mem"], 1), "first_loss": round(r["first_loss"], 4),
              "data": f"{pooled} pre-drawn {cfg.dataset} train steps of {run.grad_accum} micro-batches, cycled"})
    if len(runs) == 2:
        emit({"bench": "train", "ours_over_plain": round(runs["ours"]["tok_s"] / runs["plain"]["tok_s"], 3),
              "of": "tokens_per_s (> 1: ours is faster)",
              "same_first_loss": math.isclose(runs["ours"]["first_loss"], runs["plain"]["first_loss"], rel_tol=1e-3)})
