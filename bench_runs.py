"""Benchmarks that run `python train.py` as a whole process; bench.py's CLI registers them.

    python bench.py time-to-loss --config small --max-time 45 --target 1.88 --repeats 1
    python bench.py reference --config small --seeds 5 --eval-interval 150 --threads 1

`time-to-loss` runs `python train.py --config C --max-time T --eval-interval 1000000000
--sample-tokens 0 --out-dir <tmp>` (or --max-iters N; other flags go to train.py) and reports
the whole process's wall time, start-up included, and the last val loss in metrics.jsonl.

`reference` runs `python train.py --config C --sample-tokens 0 --seed S --out-dir <tmp>` (other
flags go to train.py) for S = the config's seed, seed + 1, ..., one after another, and writes
the loss band over the seeds, with this command, the machine, dtype and date, to
configs/reference/<config>.json (reference.py reads it; every run of that config is drawn
against it). Steps-based schedules make each seed's curve the same on any load, so a busy
machine only makes it slower.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from errors import UserError


def _emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def _train_py(config: str, flags: list[str]) -> tuple[float, str, list[dict[str, Any]], dict[str, Any]]:
    """One `python train.py --config C --sample-tokens 0 <flags>` in a temporary out dir:
    (whole-process wall seconds, stdout, its metrics.jsonl records, its config.json)."""
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        cmd = [sys.executable, "train.py", "--config", config, "--sample-tokens", "0", *flags, "--out-dir", tmp]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parent, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            # train.py's own one-line error says what to fix; a crash's last line says what broke
            last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1].removeprefix("error: ")
            raise UserError(f"train.py --config {config} exited {proc.returncode}: {last}")
        records = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
        return wall, proc.stdout, records, json.loads((Path(tmp) / "config.json").read_text())


# ---------------------------------------------------------------------------- time-to-loss


def add_time_to_loss_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("time-to-loss", allow_abbrev=False, help="whole `python train.py` runs: wall time and final val loss")
    p.add_argument("--config", default="small")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--max-time", type=float, default=45.0, help="train.py --max-time (s)")
    budget.add_argument("--max-iters", type=int, default=0, help="train.py --max-iters instead of --max-time")
    p.add_argument("--target", type=float, default=1.88, help="val loss to reach")
    p.add_argument("--repeats", type=int, default=1)
    p.set_defaults(func=bench_time_to_loss, passthrough=True)


def bench_time_to_loss(args: argparse.Namespace) -> None:
    import torch

    from reference import machine

    budget = ["--max-iters", str(args.max_iters)] if args.max_iters else ["--max-time", str(args.max_time)]
    device = machine("cuda" if torch.cuda.is_available() else "cpu")
    for _ in range(args.repeats):
        wall, stdout, records, _ = _train_py(args.config, [*budget, "--eval-interval", "1000000000", *args.extra])
        evals = [r for r in records if "val_loss" in r]
        stopped = re.search(r"stopped at step \d+ \((\w+)\)", stdout)
        _emit({
            "bench": "time-to-loss", "config": args.config, "device": device,
            "max_time": None if args.max_iters else args.max_time, "max_iters": args.max_iters or None,
            "extra": args.extra, "wall_s": round(wall, 2), "val_loss": round(evals[-1]["val_loss"], 4),
            "target": args.target, "reached": evals[-1]["val_loss"] <= args.target,
            "steps": evals[-1]["step"], "stopped": stopped and stopped.group(1),
        })


# ---------------------------------------------------------------------------- reference


def add_reference_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("reference", allow_abbrev=False,
                       help="loss band over seeds, written to configs/reference/<config>.json")
    p.add_argument("--config", default="small", help="a named config")
    p.add_argument("--seeds", type=int, default=3, help="runs, one after another, with the config's seed, seed+1, ...")
    p.set_defaults(func=bench_reference, passthrough=True)


def bench_reference(args: argparse.Namespace) -> None:
    import shlex

    from configs import load_config
    from reference import REFERENCE_DIR, build, write

    if args.seeds < 2:
        raise UserError("--seeds must be at least 2: a band needs a spread")
    seeds = list(range(first := load_config(args.config, args.extra).seed, first + args.seeds))
    runs, config, device = [], {}, ("", "")
    for seed in seeds:
        wall, stdout, records, config = _train_py(args.config, [*args.extra, "--seed", str(seed)])
        # train.py's first line is runtime.describe(): "cpu with bf16 instructions, bfloat16, fused AdamW, ..."
        device = re.match(r"(\S+)[^,\n]*, (\w+)", stdout).groups()
        runs.append(records)
        _emit({"bench": "reference", "config": args.config, "seed": seed, "wall_s": round(wall, 2),
               "val_loss": round([r for r in records if "val_loss" in r][-1]["val_loss"], 4)})
    ref = build(args.config, config, runs, seeds, shlex.join(["python", "bench.py", *args.argv]), *device)
    final = ref["final_val_loss"]
    path = write(ref, REFERENCE_DIR / f"{args.config}.json")
    _emit({"bench": "reference", "wrote": str(path), "final_val_loss": final,
           "mean": round(statistics.fmean(final), 4), "spread": round(max(final) - min(final), 4)})
