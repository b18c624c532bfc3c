"""Whole `python train.py` runs: wall time to a loss, and the reference loss band over seeds.

    python -m benchmarks time-to-loss --config small --max-time 45 --target 1.88
    python -m benchmarks time-to-loss --config small --max-iters 1500        # the fixed-step figure
    python -m benchmarks time-to-loss --config small --vs-nanogpt --fractions 0.25 1 --target 1.55
    python -m benchmarks reference --config small --seeds 5 --eval-interval 150 --threads 1

Other flags go to train.py. Wall time is the whole process's, start-up included: what a user waits.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import multiprocessing
import os
import platform
import re
import shlex
import statistics
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
from configs.cli import integer
from configs.errors import UserError
from training import reference

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


def _train_py(config: str, flags: list[str], score_whole_val: bool = False) -> dict[str, Any]:
    """One `python train.py --config C --sample-tokens 0 FLAGS`: train()'s result with wall_s added, and its
    metrics.jsonl and config.json as records and config. score_whole_val scores its val_loss on the whole val split."""
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        t0 = time.perf_counter()
        result = _train(["--config", config, "--sample-tokens", "0", *flags, "--out-dir", tmp])
        result["wall_s"] = round(time.perf_counter() - t0, 2)
        result["records"] = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
        result["config"] = json.loads((Path(tmp) / "config.json").read_text())
        if score_whole_val:
            result["val_loss"] = _train(["--config", tmp, "--eval-only", "--out-dir", tmp])["val_loss"]
        return result


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
    result = _train_py(config, flags, score_whole_val)
    val = round(result["val_loss"], 4)
    return {"wall_s": result["wall_s"], "val_loss": val, "steps": result["step"], "stopped": result["stopped"],
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


def add_reference_parser(add_parser: Callable[..., argparse.ArgumentParser]) -> None:
    p = add_parser("reference", help="loss band over seeds, to configs/reference/<config>.json")
    p.add_argument("--config", default="small", help="a named config")
    p.add_argument("--seeds", type=integer(2), default=3, help="runs one after another: the config's seed, seed+1, ...")
    p.set_defaults(func=bench_reference, passthrough=True)


def bench_reference(args: argparse.Namespace) -> None:
    seeds = list(range(first := load_config(args.config, args.extra).seed, first + args.seeds))
    runs = []
    for seed in seeds:
        result = _train_py(args.config, [*args.extra, "--seed", str(seed)])
        runs.append(result["records"])
        emit({"bench": "reference", "config": args.config, "seed": seed, "wall_s": result["wall_s"],
              "val_loss": round([r for r in result["records"] if "val_loss" in r][-1]["val_loss"], 4)})
    command = shlex.join(["python", "-m", "benchmarks", *args.argv])
    ref = build_reference(args.config, result["config"], runs, seeds, command, result["device"], result["dtype"])
    path = write_reference(ref, reference.REFERENCE_DIR / f"{args.config}.json")
    final = ref["final_val_loss"]
    emit({"bench": "reference", "wrote": str(path), "final_val_loss": final,
          "mean": round(statistics.fmean(final), 4), "spread": round(max(final) - min(final), 4)})


def build_reference(name: str, config: dict[str, Any], runs: list[list[dict[str, Any]]], seeds: list[int],
                    command: str, device: str, dtype: str) -> dict[str, Any]:
    """A reference from each run's metrics.jsonl records: at each eval step all runs logged, the losses' min and max."""
    evals = [{r["step"]: r for r in records if r.get("val_loss") is not None} for records in runs]
    steps = sorted(set.intersection(*(set(e) for e in evals)))
    band = {"step": steps} | {key: {"min": [round(min(e[s][key] for e in evals), 4) for s in steps],
                                    "max": [round(max(e[s][key] for e in evals), 4) for s in steps]}
                              for key in ("train_loss", "val_loss")}
    return {"name": name, "command": command, "machine": machine(device), "device": device, "dtype": dtype,
            "torch": torch.__version__, "date": datetime.date.today().isoformat(), "seeds": seeds,
            "final_val_loss": [round(e[max(e)]["val_loss"], 4) for e in evals],
            "config": {k: v for k, v in config.items() if k not in ("seed", "out_dir")}, "band": band}


def machine(device: str) -> str:
    """On CUDA the GPU's name, else the CPU's model name (as lscpu prints it) and its core count."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    names = re.findall(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.MULTILINE) if cpuinfo.exists() else []
    return f"{names[0] if names else platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def write_reference(ref: dict[str, Any], path: Path) -> Path:
    """Write ref as JSON with each list of numbers on one line, so diffs stay small and it reads by eye."""
    text = json.dumps(ref, indent=1)
    text = re.sub(r"\[\s+([^][{}]*?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    return path
