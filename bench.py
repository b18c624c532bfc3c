"""Benchmarks. Each subcommand prints one JSON line per measurement (easy to grep, diff, plot).

    python bench.py sample                       # small model: eager KV cache, compiled, recompute
    python bench.py sample --model gpt2 --dtypes float32,bfloat16    # GPT-2 124M vs transformers
    python bench.py train --config small --iters 200                    # the real recipe (Muon, RoPE)
    python bench.py train --config small --impl both --iters 200 --override pos_emb=learned optimizer=adamw
    python bench.py train --config shakespeare_gpu --impl both --override dropout=0   # GPU; compiles
    python bench.py time-to-loss --config small --max-time 45 --target 1.88 --repeats 1
    python bench.py time-to-loss --config small --max-iters 1500        # the fixed-step figure
    python bench.py memory --config small --n-layer 8 --block-size 256   # plan.py's estimate vs measured
    python bench.py reference --config small --seeds 5 --eval-interval 150 --threads 1   # configs/reference/

`sample` (benchmarks/decode.py) times greedy decoding: ours eager and compiled, beside
transformers' generate() for --model gpt2; see that module's docstring.

`train` times optimizer steps (forward, backward, clip, step; the config's shape, batch and
grad accumulation) on up to 64 micro-batches (whole steps, at least one) of the config's dataset
drawn up front (loading is not timed).
ours: train.py's forward_backward + optimizer_step on model.GPT, runtime.setup's device and
autocast, optim.configure_optimizer (fused AdamW; Muon). plain: PlainGPT below, nanoGPT-style
GPT-2 from the same initial weights, default torch.optim.AdamW. both: --block steps of each in
turn (load drift hits both alike), then {"ours_over_plain": tokens/s ratio}. plain is GPT-2
only, so compare at the baseline shape: --override pos_emb=learned optimizer=adamw (KEY=VALUE
for any TrainConfig field; bare --batch-size 32 works too). ms_per_iter: the median step. Peak
memory: torch's on GPU (less the other impl's weights and optimizer state), the process's peak
RSS on CPU (one high-water mark for both impls). mfu: null without a known GPU peak.

`time-to-loss` and `reference` run train.py as a whole process (bench_runs.py says how).

Adding a benchmark: write `add_<name>_parser(subparsers)` and `bench_<name>(args)`, and
register the parser in `build_parser`.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import resource
import statistics
import sys
import time
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import memory_check
import plan
from bench_runs import add_reference_parser, add_time_to_loss_parser
from benchmarks import emit as _emit, sync as _sync
from benchmarks.decode import add_sample_parser
from errors import UserError, entry_point


def _peak_memory_mb(device: str) -> tuple[str, float]:
    """GPU: peak allocated by torch since the last reset. CPU: the process's peak RSS so far
    (a high-water mark for the whole process, so it never goes down between measurements)."""
    if device.startswith("cuda"):
        return "peak_gpu_mem_mb", torch.cuda.max_memory_allocated() / 2**20
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return "peak_rss_mb", rss_kb / (2**20 if sys.platform == "darwin" else 2**10)


# ---------------------------------------------------------------------------- train


class _PlainBlock(nn.Module):
    """nanoGPT's block: pre-LayerNorm, fused qkv, SDPA causal attention, tanh-GELU MLP, biases.
    Submodule names match model.GPT's, so one state_dict loads into the other."""

    def __init__(self, C: int, nh: int):
        super().__init__()
        self.nh, self.ln_1, self.ln_2 = nh, nn.LayerNorm(C), nn.LayerNorm(C)
        self.attn = nn.ModuleDict({"c_attn": nn.Linear(C, 3 * C), "c_proj": nn.Linear(C, C)})
        self.mlp = nn.ModuleDict({"c_fc": nn.Linear(C, 4 * C), "c_proj": nn.Linear(4 * C, C)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.attn.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.nh, C // self.nh).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    """A plain nanoGPT-style GPT-2 (learned positions, LayerNorm, tied head): the baseline."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int):
        super().__init__()
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(vocab_size, n_embd), "wpe": nn.Embedding(block_size, n_embd),
            "h": nn.ModuleList(_PlainBlock(n_embd, n_head) for _ in range(n_layer)), "ln_f": nn.LayerNorm(n_embd)})
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weights: bench_train loads model.GPT's init

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.transformer
        x = t.wte(idx) + t.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in t.h:
            x = block(x)
        logits = self.lm_head(t.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


# The plain model implements one architecture; --impl plain/both needs the config to match it.
GPT2_ARCH = {"pos_emb": "learned", "norm": "layernorm", "activation": "gelu", "bias": True, "qk_norm": False,
             "tie_weights": True, "dropout": 0.0, "optimizer": "adamw"}


def _device_name(device_type: str) -> str:
    return torch.cuda.get_device_name() if device_type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"


def _state_bytes(model: nn.Module, optimizer: Any) -> int:
    """Bytes that stay allocated between steps: parameters and optimizer state."""
    tensors = [*model.parameters(), *(t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))]
    return sum(t.numel() * t.element_size() for t in tensors)


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", allow_abbrev=False, help="training step time: our stack vs a plain PyTorch GPT-2")
    p.add_argument("--config", default="small", help="a configs/<name>.py or a .toml")
    p.add_argument("--iters", type=int, default=100, help="timed steps per impl (the median is reported)")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps per impl first")
    p.add_argument("--impl", choices=("ours", "plain", "both"), default="ours")
    p.add_argument("--block", type=int, default=10, help="steps per turn with --impl both (ours, plain, ours, ...)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--compile", action="store_true", help="torch.compile every timed model")
    p.add_argument("--override", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="TrainConfig fields, e.g. pos_emb=learned optimizer=adamw (bare --pos-emb learned works too)")
    p.set_defaults(func=bench_train, passthrough=True)


def bench_train(args: argparse.Namespace) -> None:
    from configs import load_config
    from data.loader import GlobalBatchLoader
    from optim import configure_optimizer
    from runtime import setup
    from train import forward_backward, optimizer_step
    from data.manifest import read_dataset_manifest
    from trainrun import build_model, dataset_dir

    if args.iters < 1 or args.warmup < 0 or args.block < 1:
        raise UserError("--iters and --block must be at least 1, --warmup at least 0")
    cfg = load_config(args.config, [*args.extra, *(f"--{kv}" for kv in args.override)])  # KEY=VALUE -> --KEY=VALUE
    cfg = replace(cfg, device=args.device, dtype=args.dtype, compile=args.compile or cfg.compile)
    impls = ["ours", "plain"] if args.impl == "both" else [args.impl]
    if "plain" in impls and (diff := {k: v for k, v in GPT2_ARCH.items() if getattr(cfg, k) != v}):
        raise UserError(f"--impl {args.impl}: the plain baseline is GPT-2 trained with AdamW; config {cfg.name} "
                        f"differs in {', '.join(diff)}; add --override {' '.join(f'{k}={v}' for k, v in diff.items())}")
    rt = setup(cfg)
    with contextlib.redirect_stdout(sys.stderr):  # stdout is for JSON lines only
        ds_dir = dataset_dir(cfg)
    ours, cfg = build_model(cfg, read_dataset_manifest(ds_dir), None)  # on CPU: also the weights plain starts from
    if cfg.batch_size == 0:  # --batch-size auto; its note goes to stderr too
        with contextlib.redirect_stdout(sys.stderr):
            cfg = plan.auto_batch_size(cfg, ours, rt)
    flops_per_token = ours.flops_per_token(cfg.block_size)
    micro = cfg.batch_size * cfg.block_size
    tokens_per_step = cfg.tokens_per_step or micro
    if tokens_per_step % micro:
        raise UserError(f"--tokens-per-step {tokens_per_step} is not a multiple of batch_size x block_size = {micro}")
    accum = tokens_per_step // micro
    loader = GlobalBatchLoader(ds_dir / "train.bin", cfg.block_size, tokens_per_step // cfg.block_size, accum,
                               device=rt.device, seed=cfg.seed, sampling=cfg.sampling)
    pool = [loader.next_step() for _ in range(max(1, min(64 // accum, args.warmup + args.iters)))]  # not timed

    runs: dict[str, dict[str, Any]] = {}
    if "ours" in impls:
        model = ours.to(rt.device)
        opt = configure_optimizer(model, cfg, fused=rt.plan.fused_adamw, dtype=rt.plan.dtype)
        fwd = torch.compile(model) if rt.plan.compile else model  # the table may turn it off
        data = SimpleNamespace(next_step=itertools.cycle(pool).__next__)  # what forward_backward reads

        def step_ours() -> torch.Tensor:
            loss = forward_backward(fwd, data, rt)  # train.py's own step functions
            optimizer_step(model, opt, rt, cfg.grad_clip)
            return loss

        runs["ours"] = {"step": step_ours, "model": model, "opt": opt, "times": []}
    if "plain" in impls:
        plain = PlainGPT(ours.config.vocab_size, cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd)
        plain.load_state_dict(ours.state_dict())  # identical starting weights
        plain.to(rt.device)
        groups = [{"params": [p for p in plain.parameters() if (p.dim() >= 2) == decay],
                   "weight_decay": cfg.weight_decay if decay else 0.0} for decay in (True, False)]
        p_opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))  # nanoGPT's groups
        p_fwd = torch.compile(plain) if rt.plan.compile else plain
        p_data, scaler = itertools.cycle(pool), torch.amp.GradScaler(rt.device_type, enabled=rt.dtype == torch.float16)

        def step_plain() -> torch.Tensor:
            total = torch.zeros((), device=rt.device)
            for x, y in next(p_data):
                with rt.autocast():
                    _, loss = p_fwd(x, y)
                scaler.scale(loss / accum).backward()
                total += loss.detach().float() / accum
            if cfg.grad_clip:
                scaler.unscale_(p_opt)
                torch.nn.utils.clip_grad_norm_(plain.parameters(), cfg.grad_clip)
            scaler.step(p_opt)
            scaler.update()
            p_opt.zero_grad(set_to_none=True)
            return total

        runs["plain"] = {"step": step_plain, "model": plain, "opt": p_opt, "times": []}

    def turn(name: str, n: int, timed: bool) -> None:
        """n steps of one impl; each step is timed on its own (CUDA synced before each clock read)."""
        r = runs[name]
        if rt.device_type == "cuda":
            others = sum(_state_bytes(o["model"], o["opt"]) for k, o in runs.items() if k != name)
            torch.cuda.reset_peak_memory_stats()
        for _ in range(n):
            _sync(rt.device)
            t0 = time.perf_counter()
            loss = r["step"]()
            _sync(rt.device)
            if timed:
                r["times"].append(time.perf_counter() - t0)
            if "first_loss" not in r:  # both impls start from the same weights and batch
                r["first_loss"] = loss.item()
        mem_key, mem = _peak_memory_mb(rt.device)
        if rt.device_type == "cuda":
            mem -= others / 2**20  # the other impl's weights and optimizer state stay resident
        r["mem_key"], r["mem"] = mem_key, max(r.get("mem", 0.0), mem)

    for timed, total in ((False, args.warmup), (True, args.iters)):
        for done in range(0, total, args.block):  # impls take turns: load drift hits them alike
            for name in impls:
                turn(name, min(args.block, total - done), timed)

    device = _device_name(rt.device_type)
    for name in impls:
        r = runs[name]
        ms = 1000 * statistics.median(r["times"])
        r["tok_s"] = tok_s = tokens_per_step / (ms / 1000)
        _emit({
            "bench": "train", "config": cfg.name, "impl": name, "device": device,
            "dtype": str(rt.dtype).removeprefix("torch."), "compile": rt.plan.compile,
            "optimizer": cfg.optimizer if name == "ours" else "torch.optim.AdamW",
            "pos_emb": cfg.pos_emb, "params": sum(p.numel() for p in r["model"].parameters()),
            "tokens_per_step": tokens_per_step, "iters": args.iters, "ms_per_iter": round(ms, 3),
            "ms_min": round(1000 * min(r["times"]), 3), "tokens_per_s": round(tok_s, 1),
            "mfu": round(flops_per_token * tok_s / rt.peak_flops, 4) if rt.peak_flops else None,
            r["mem_key"]: round(r["mem"], 1), "first_loss": round(r["first_loss"], 4),
            "data": f"{len(pool)} pre-drawn {cfg.dataset} train steps of {accum} micro-batches, cycled",
        })
    if len(impls) == 2:
        _emit({"bench": "train", "ours_over_plain": round(runs["ours"]["tok_s"] / runs["plain"]["tok_s"], 3),
               "of": "tokens_per_s (> 1: ours is faster)",
               "same_first_loss": math.isclose(runs["ours"]["first_loss"], runs["plain"]["first_loss"], rel_tol=1e-3)})


# ---------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_sample_parser(sub)  # benchmarks/decode.py
    add_train_parser(sub)
    add_time_to_loss_parser(sub)
    memory_check.add_memory_parser(sub)  # beside the measurement it runs
    add_reference_parser(sub)
    return parser


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)  # train, time-to-loss: the rest are TrainConfig flags
    if extra and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra, args.argv = extra, list(sys.argv[1:] if argv is None else argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
