"""Benchmarks that run `python train.py` as a whole process; bench.py's CLI registers them.

    python bench.py time-to-loss --config small --max-time 45 --target 1.88 --repeats 1
    python bench.py time-to-loss --config small --vs-nanogpt --fractions 0.25 1 --target 1.55
    python bench.py reference --config small --seeds 5 --eval-interval 150 --threads 1

`time-to-loss` runs `python train.py --config C --max-time T --max-iters 1000000000 --eval-interval
1000000000 --sample-tokens 0 --out-dir <tmp>` (or --max-iters N; other flags go to train.py) and reports
the whole process's wall time, start-up included, and the last val loss in metrics.jsonl.
With --vs-nanogpt each repeat first runs nanoGPT's CPU recipe for shakespeare_char (its
README's command: 4 layers, 4 heads, 128 wide, block 64, batch 12, 2000 steps of AdamW 1e-3
with cosine decay, learned positions, float32, evaluating 20 batches every 250 steps) on our
trainer, whose steps time the same as plain PyTorch's (`bench.py train --impl both`); its final
checkpoint is then scored on the whole val split, untimed, and a last line gives ours/nanoGPT.
--fractions F ... replace ours' budget with F x nanoGPT's measured wall time, one run each.

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

from benchmarks import emit as _emit
from errors import UserError


# nanoGPT's README command for CPUs (train_shakespeare_char.py with --device=cpu --compile=False
# --eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4
# --n_embd=128 --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0), as our flags.
NANOGPT_CPU = ["--n-layer", "4", "--n-head", "4", "--n-embd", "128", "--block-size", "64", "--batch-size", "12",
               "--dropout", "0", "--bias", "false", "--pos-emb", "learned", "--norm", "layernorm",
               "--activation", "gelu_exact", "--qk-norm", "false", "--tie-weights", "true", "--attention", "sdpa",
               "--optimizer", "adamw", "--lr", "1e-3", "--min-lr", "1e-4", "--warmup-iters", "100",
               "--lr-schedule", "cosine", "--lr-decay-iters", "2000", "--max-iters", "2000", "--beta2", "0.99",
               "--weight-decay", "0.1", "--grad-clip", "1.0", "--tokens-per-step", "0", "--dtype", "float32",
               "--eval-interval", "250", "--eval-iters", "20", "--log-interval", "1"]


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parent, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        # train.py's own one-line error says what to fix; a crash's last line says what broke
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1].removeprefix("error: ")
        raise UserError(f"{' '.join(cmd[1:4])} exited {proc.returncode}: {last}")
    return proc.stdout


def _train_py(config: str, flags: list[str], score_whole_val: bool = False
              ) -> tuple[float, str, list[dict[str, Any]], dict[str, Any]]:
    """One `python train.py --config C --sample-tokens 0 <flags>` in a temporary out dir:
    (whole-process wall seconds, stdout, its metrics.jsonl records, its config.json). With
    score_whole_val the last record's val_loss is then measured on the whole val split (untimed)."""
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        t0 = time.perf_counter()
        stdout = _run([sys.executable, "train.py", "--config", config, "--sample-tokens", "0", *flags, "--out-dir", tmp])
        wall = time.perf_counter() - t0
        records = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
        if score_whole_val:
            scored = _run([sys.executable, "train.py", "--config", tmp, "--eval-only", "--out-dir", tmp])
            [r for r in records if "val_loss" in r][-1]["val_loss"] = float(re.search(r"val\s+loss (\S+)", scored).group(1))
        return wall, stdout, records, json.loads((Path(tmp) / "config.json").read_text())


# ---------------------------------------------------------------------------- time-to-loss


def add_time_to_loss_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("time-to-loss", allow_abbrev=False, help="whole `python train.py` runs: wall time and final val loss")
    p.add_argument("--config", default="small")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--max-time", type=float, default=45.0, help="train.py --max-time (s)")
    budget.add_argument("--max-iters", type=int, default=0, help="train.py --max-iters instead of --max-time")
    budget.add_argument("--fractions", type=float, nargs="+", default=[],
                        help="with --vs-nanogpt: one run of ours per F, in F x nanoGPT's whole-process wall time")
    p.add_argument("--target", type=float, default=1.88, help="val loss to reach")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="train.py --threads, for both runs")
    p.add_argument("--vs-nanogpt", action="store_true", help="run nanoGPT's CPU recipe before each of ours")
    p.set_defaults(func=bench_time_to_loss, passthrough=True)


def _timed_run(config: str, flags: list[str], score_whole_val: bool = False) -> dict[str, Any]:
    wall, stdout, records, _ = _train_py(config, flags, score_whole_val)
    last = [r for r in records if "val_loss" in r][-1]
    stopped = re.search(r"stopped at step \d+ \((\w+)\) after (\S+)s", stdout)
    return {"wall_s": round(wall, 2), "val_loss": round(last["val_loss"], 4), "steps": last["step"],
            "stopped": stopped.group(1), "train_s": float(stopped.group(2))}


def bench_time_to_loss(args: argparse.Namespace) -> None:
    import torch

    from reference import machine

    if args.fractions and not args.vs_nanogpt:
        raise UserError("--fractions are of nanoGPT's wall time: add --vs-nanogpt")
    if min(args.fractions, default=1) <= 0:
        raise UserError("--fractions must be positive (1 = nanoGPT's wall time)")
    device = machine("cuda" if torch.cuda.is_available() else "cpu")
    threads = ["--threads", str(args.threads)]
    common = {"bench": "time-to-loss", "device": device, "target": args.target}
    ratios: dict[float | None, list[tuple[float, float, float]]] = {}
    for _ in range(args.repeats):
        ref = None
        if args.vs_nanogpt:
            ref = _timed_run("small", NANOGPT_CPU + threads, score_whole_val=True)
            _emit({**common, "run": "nanogpt", "flags": NANOGPT_CPU + threads, **ref, "reached": ref["val_loss"] <= args.target})
        times = {None: args.max_time}
        if args.fractions:
            # ours gets F x nanoGPT's whole-process wall, less the start-up and exit both processes
            # share (nanoGPT's wall outside train()), so ours' whole process takes about F x as long
            times = {f: round(f * ref["wall_s"] - (ref["wall_s"] - ref["train_s"]), 1) for f in args.fractions}
        # a time budget is the only limit: the config's max_iters would otherwise end the run early
        budgets = ({None: ["--max-iters", str(args.max_iters)]} if args.max_iters else
                   {f: ["--max-time", str(t), "--max-iters", "1000000000"] for f, t in times.items()})
        for f, budget in budgets.items():
            ours = _timed_run(args.config, [*budget, "--eval-interval", "1000000000", *threads, *args.extra])
            _emit({**common, "run": "ours", "config": args.config, "flags": [*budget, *threads, *args.extra],
                   **ours, "reached": ours["val_loss"] <= args.target})
            if ref:
                ratios.setdefault(f, []).append((ours["wall_s"] / ref["wall_s"], ours["val_loss"], ref["val_loss"]))
    for f, rows in ratios.items():
        ratio, val, ref_val = (statistics.median(x) for x in zip(*rows))
        _emit({"bench": "time-to-loss", "fraction": f, "ours_wall_over_nanogpt": round(ratio, 3), "ours_val": val,
               "nanogpt_val": ref_val, "ours_reached_nanogpt": val <= ref_val, "ours_reached_target": val <= args.target,
               "medians_of": len(rows)})


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
