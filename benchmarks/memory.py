"""Peak training memory: the planner's estimate beside the CPU's measured peak.

    python -m benchmarks memory --config small
    python -m benchmarks memory --config small --n-layer 8 --block-size 256   # other flags: TrainConfig fields

CPU training keeps the tensors a GPU keeps, so the CPU's profiler checks the estimate without a GPU.
"""

import argparse
import contextlib
import itertools
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import emit, stepper
from configs import TrainConfig, load_config
from configs.errors import UserError
from data.manifest import read_dataset_manifest
from data.prepare import dataset_dir
from model import GPT
from training.optim import configure_optimizer
from training.plan import Estimate, meta_model
from training.runtime import setup


def measured_peak_bytes(fn: Callable[[], Any]) -> int:
    """Peak CPU tensor bytes allocated while fn() runs. Only those count, so fn should build the model itself."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    cpu = torch.autograd.DeviceType.CPU
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() == cpu]
    sizes = (e.nbytes() for e in sorted(events, key=lambda e: e.start_ns()))  # a free's size is negative
    return max(itertools.accumulate(sizes, initial=0))


def training_steps(cfg: TrainConfig, vocab_size: int, dtype: torch.dtype, accum: int = 2) -> None:
    """Build cfg's model and optimizer on the CPU and run two steps of `accum` micro-batches, as train.py does."""
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model_config(vocab_size))
    opt = configure_optimizer(model, cfg, fused=True, dtype=dtype)
    rt = setup(device="cpu", dtype=str(dtype).removeprefix("torch."), seed=None)
    x = torch.randint(0, vocab_size, (cfg.batch_size, cfg.block_size + 1))
    step = stepper(model, opt, torch.compile(model) if cfg.compile else model, [[(x[:, :-1], x[:, 1:])] * accum],
                   rt, cfg.grad_clip)
    for _ in range(2):
        step()


def check(cfg: TrainConfig, vocab_size: int, dtype: torch.dtype, accum: int = 2) -> dict[str, Any]:
    """The estimate for cfg beside the measured peak, also compared without weights, gradients and optimizer states."""
    mem = Estimate.of(meta_model(cfg.model_config(vocab_size)), cfg, dtype != torch.float32).memory(cfg.batch_size)
    measured = measured_peak_bytes(lambda: training_steps(cfg, vocab_size, dtype, accum))
    states = sum(mem[k] for k in ("weights and buffers", "gradients", "optimizer states"))  # exact arithmetic
    return {"estimate_mb": round(mem["total"] / 2**20, 3), "measured_mb": round(measured / 2**20, 3),
            "ratio": round(mem["total"] / measured, 4),
            "beyond_states_ratio": round((mem["total"] - states) / (measured - states), 4)}


def add_memory_parser(add_parser: Callable[..., argparse.ArgumentParser]) -> None:
    p = add_parser("memory", help="plan.py's peak-memory estimate vs the CPU's measured peak")
    p.add_argument("--config", default="small", help="a configs/<name>.py or a .toml; other flags are its fields")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="autocast dtype")
    p.set_defaults(func=bench_memory, passthrough=True)


def bench_memory(args: argparse.Namespace) -> None:
    cfg = load_config(args.config, args.extra)
    if cfg.batch_size == 0:
        raise UserError("memory measures a given --batch-size, not auto")
    with contextlib.redirect_stdout(sys.stderr):  # stdout is for the JSON line only
        try:  # cfg's vocab_size, else its dataset's (a preset is prepared first, as training would)
            vocab = cfg.vocab_size or read_dataset_manifest(dataset_dir(cfg.dataset, cfg.data_root))["vocab_size"]
        except UserError as e:
            raise UserError(f"{e}; or measure without the data by giving --vocab-size") from None
    shape = ("n_layer", "n_embd", "n_head", "block_size", "batch_size", "attention", "pos_emb", "optimizer", "compile")
    emit({"bench": "memory", "config": cfg.name, **{k: getattr(cfg, k) for k in shape}, "vocab_size": vocab,
          "dtype": args.dtype, "accum": 2, **check(cfg, vocab, getattr(torch, args.dtype))})
