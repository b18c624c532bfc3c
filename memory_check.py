"""The measured side of plan.py: peak CPU memory of real training steps, beside the estimate.

    python bench.py memory --config small --n-layer 8 --block-size 256      # one JSON line
    from memory_check import check; check(cfg, vocab_size=65, dtype=torch.bfloat16)

The CPU allocator reports every allocation and free to torch's profiler (profile_memory); the
running sum of those events is the bytes of tensors alive, and its maximum the peak. CPU
training keeps the tensors a GPU keeps, so this checks plan.activation_bytes and plan.Estimate
without a GPU (the kernels' own workspaces differ a little; see the README's table).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from configs import TrainConfig, load_config
from errors import UserError
from model import GPT
from plan import Estimate, meta_model, plan_vocab_size


def measured_peak_bytes(fn: Callable[[], Any]) -> int:
    """Peak CPU tensor bytes allocated while fn() runs, from the allocation and free events the
    CPU allocator reports to torch's profiler (profile_memory). Only what fn allocates counts,
    so fn should build the model and optimizer itself."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    cpu = torch.autograd.DeviceType.CPU
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() == cpu]
    total = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        total += e.nbytes()  # negative for a free
        peak = max(peak, total)
    return peak


def training_steps(cfg: TrainConfig, vocab_size: int, dtype: torch.dtype, steps: int = 2, accum: int = 2) -> None:
    """Build cfg's model and optimizer on the CPU and run `steps` optimizer steps of `accum`
    micro-batches through train.py's own step functions: the peak the estimate describes."""
    from types import SimpleNamespace

    from optim import configure_optimizer
    from runtime import setup
    from train import forward_backward, optimizer_step

    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model_config(vocab_size))
    opt = configure_optimizer(model, cfg, fused=True, dtype=dtype)
    rt = setup(device="cpu", dtype=str(dtype).removeprefix("torch."), seed=None)
    x = torch.randint(0, vocab_size, (cfg.batch_size, cfg.block_size + 1))
    batches = SimpleNamespace(next_step=lambda: [(x[:, :-1], x[:, 1:])] * accum)  # what forward_backward reads
    step_model = torch.compile(model) if cfg.compile else model
    for _ in range(steps):
        forward_backward(step_model, batches, rt)
        optimizer_step(model, opt, rt, cfg.grad_clip)


def check(cfg: TrainConfig, vocab_size: int, dtype: torch.dtype, accum: int = 2) -> dict[str, Any]:
    """The estimate for cfg next to the measured CPU peak of two optimizer steps; beyond_states_ratio
    compares what is left after weights, gradients and optimizer states: activations and temporaries."""
    mem = Estimate.of(meta_model(cfg, vocab_size), cfg, dtype != torch.float32).memory(cfg.batch_size)
    measured = measured_peak_bytes(lambda: training_steps(cfg, vocab_size, dtype, accum=accum))
    states = sum(mem[k] for k in ("weights and buffers", "gradients", "optimizer states"))  # exact arithmetic
    return {"estimate_mb": round(mem["total"] / 2**20, 3), "measured_mb": round(measured / 2**20, 3),
            "ratio": round(mem["total"] / measured, 4),
            "beyond_states_ratio": round((mem["total"] - states) / (measured - states), 4)}


def add_memory_parser(sub: Any) -> None:
    """`python bench.py memory`: registered by bench.py, lives here beside what it checks."""
    p = sub.add_parser("memory", allow_abbrev=False, help="plan.py's peak-memory estimate vs the CPU's measured peak")
    p.add_argument("--config", default="small", help="a configs/<name>.py or a .toml; other flags are its fields")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="autocast dtype")
    p.add_argument("--accum", type=int, default=2, help="micro-steps per optimizer step (the estimate assumes 2+)")
    p.set_defaults(func=bench_memory, passthrough=True)


def bench_memory(args: Any) -> None:
    import contextlib
    import json
    import sys

    cfg = load_config(args.config, args.extra)
    if cfg.batch_size == 0:
        raise UserError("bench.py memory measures a given --batch-size, not auto")
    with contextlib.redirect_stdout(sys.stderr):  # stdout is for the JSON line only
        vocab = plan_vocab_size(cfg)
    shape = ("n_layer", "n_embd", "n_head", "block_size", "batch_size", "attention", "pos_emb", "optimizer", "compile")
    record = {"bench": "memory", "config": cfg.name, **{k: getattr(cfg, k) for k in shape}, "vocab_size": vocab,
              "dtype": args.dtype, "accum": args.accum, **check(cfg, vocab, getattr(torch, args.dtype), args.accum)}
    print(json.dumps(record), flush=True)
