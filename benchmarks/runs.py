"""Whole `python train.py` runs: wall time to a loss.

    python -m benchmarks time-to-loss --config small --max-time 45 --target 1.88
    python -m benchmarks time-to-loss --config small --max-iters 1500        # the fixed-step figure
    python -m benchmarks time-to-loss --config small --vs-nanogpt --fractions 0.25 1 --target 1.55

Other flags go to train.py. Wall time is the whole process's, start-up included: what a user waits.
"""

import argparse
import contextlib
import multiprocessing
import os
import platform
import re
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

import train
from benchmarks import emit
from configs import load_config
from configs.errors import UserError

# nanoGPT's README command for CPUs (train_shakespeare_char.py --device=cpu ...) in our flags.
NANOGPT_CPU = ("--n-layer 4 --n-head 4 --n-embd 128 --block-size 64 --batch-size 12 --dropout 0 --bias false "
               "--pos-emb learned --norm layernorm --activation gelu_exact --qk-norm false --tie-weights true "
               "--attention sdpa --optimizer adamw --lr 1e-3 --min-lr 1e-4 --warmup-iters 100 --lr-schedule cosine "
               "--lr-decay-iters 2000 --max-iters 2000 --beta2 0.99 --weight-decay 0.1 --grad-clip 1.0 "
               "--tokens-per-step 0 --dtype float32 --eval-interval 250 --eval-iters 20 --log-interval 1").split()


def _train(argv: list[str]) -> dict[str, Any]:
    """What `python train.py ARGV` returns, run in a process of its own so that start-up counts as for a user."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_train_quietly, argv).result()


def _train_quietly(argv: list[str]) -> dict[str, Any]:
    """train.py's train() on `--config NAME FLAGS`, its output dropped because stdout is for the JSON lines."""
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
        return train.train(load_config(argv[1], argv[2:]))


def add_time_to_loss_parser(add_parser: Callable[..., argparse.ArgumentParser]) -> None:
    p = add_parser("time-to-loss", help="whole `python train.py` runs: wall time, final val loss")
    p.add_argument("--config", default="small")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--max-time", type=float, default=45.0, help="train.py --max-time (s)")
    budget.add_argument("--max-iters", type=int, default=0, help="train.py --max-iters instead of --max-time")
    budget.add_argument("--fractions", type=float, nargs="+", default=[],
                        help="with --vs-nanogpt: one run of ours per F, in F x nanoGPT's whole-process wall time")
    p.add_argument("--target", type=float, default=1.88, help="val loss to reach")
    p.add_argument("--threads", type=int, default=0, help="train.py --threads, for both runs")
    p.add_argument("--vs-nanogpt", action="store_true",
                   help="nanoGPT's CPU recipe on our trainer (scored on the whole val split) before each of ours")
    p.set_defaults(func=bench_time_to_loss, passthrough=True)


def _timed_run(config: str, flags: list[str], target: float, score_whole_val: bool = False) -> dict[str, Any]:
    """One `python train.py --config C --sample-tokens 0 FLAGS`, timed; score_whole_val scores its val loss on the
    whole val split afterwards, untimed."""
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        t0 = time.perf_counter()
        result = _train(["--config", config, "--sample-tokens", "0", *flags, "--out-dir", tmp])
        wall = round(time.perf_counter() - t0, 2)
        if score_whole_val:
            result["val_loss"] = _train(["--config", tmp, "--eval-only", "--out-dir", tmp])["val_loss"]
    val = round(result["val_loss"], 4)
    return {"wall_s": wall, "val_loss": val, "steps": result["step"], "stopped": result["stopped"],
            "train_s": round(result["elapsed"], 2), "reached": val <= target}


def bench_time_to_loss(args: argparse.Namespace) -> None:
    if args.fractions and (not args.vs_nanogpt or min(args.fractions) <= 0):
        raise UserError("--fractions: positive multiples of nanoGPT's wall time (1 = as long), with --vs-nanogpt")
    threads = ["--threads", str(args.threads)]
    common = {"bench": "time-to-loss", "device": machine("cuda" if torch.cuda.is_available() else "cpu"),
              "target": args.target}
    ref, times, results = None, {None: args.max_time}, {}
    if args.vs_nanogpt:
        ref = _timed_run("small", NANOGPT_CPU + threads, args.target, score_whole_val=True)
        emit({**common, "run": "nanogpt", "flags": NANOGPT_CPU + threads, **ref})
    if args.fractions:  # ours' whole process, start-up and exit included, should take F x nanoGPT's
        times = {f: round(f * ref["wall_s"] - (ref["wall_s"] - ref["train_s"]), 1) for f in args.fractions}
        if min(times.values()) <= 0:  # train.py's --max-time 0 is no limit at all
            raise UserError(f"--fractions {min(args.fractions)} x nanoGPT's wall is less than its start-up")
    # A time budget must be the only limit, or the config's max_iters could end the run early.
    budgets = ({None: ["--max-iters", str(args.max_iters)]} if args.max_iters else
               {f: ["--max-time", str(t), "--max-iters", "1000000000"] for f, t in times.items()})
    for f, budget in budgets.items():
        results[f] = ours = _timed_run(args.config, [*budget, "--eval-interval", "1000000000", *threads, *args.extra],
                                       args.target)  # no evals before the end: their time would count
        emit({**common, "run": "ours", "config": args.config, "flags": [*budget, *threads, *args.extra], **ours})
    for f, ours in (results if ref else {}).items():  # ours beside nanoGPT's, after all the runs
        ratio, val, ref_val = round(ours["wall_s"] / ref["wall_s"], 3), ours["val_loss"], ref["val_loss"]
        emit({"bench": "time-to-loss", "fraction": f, "ours_wall_over_nanogpt": ratio, "ours_val": val,
              "nanogpt_val": ref_val, "ours_reached_nanogpt": val <= ref_val, "ours_reached_target": ours["reached"],
              "medians_of": 1})


def machine(device: str) -> str:
    """On CUDA the GPU's name, else the CPU's model name (as lscpu prints it) and its core count."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    names = re.findall(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.MULTILINE) if cpuinfo.exists() else []
    return f"{names[0] if names else platform.processor() or platform.machine()}, {os.cpu_count()} cores"

