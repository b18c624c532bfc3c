"""One GPU, one script, one table: the CUDA tests, GPT-2 124M's step (beside nanoGPT's bench.py when
its repository is given) and `python train.py --config shakespeare_gpu`, whole."""

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import emit
from configs import UserError

ROOT = Path(__file__).resolve().parent.parent


def timed(command: list, cwd=ROOT) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    proc = subprocess.run([str(c) for c in command], cwd=cwd, capture_output=True, text=True)
    return time.perf_counter() - t0, proc


def main(args) -> None:
    if not torch.cuda.is_available():
        raise UserError("python -m benchmarks gpu needs a CUDA GPU, and torch sees none here")
    rows = [("GPU, torch", f"{torch.cuda.get_device_name()}, torch {torch.__version__}")]

    # the tests marked cuda
    seconds, proc = timed([sys.executable, "-m", "pytest", "-q", "-n", "0", "-m", "cuda"])
    rows.append(("`pytest -m cuda`", f"{proc.stdout.strip().splitlines()[-1]} ({seconds:.0f} s)"))

    # GPT-2 124M at micro-batch 16 x 1024, compiled, from train.py's own log: its shape on char
    # tokens (the same speed, and no BPE files needed)
    import train
    from configs import parse_args

    with tempfile.TemporaryDirectory() as out:
        flags = "--config gpt2 --dataset shakespeare_char --batch-size 16 --no-bias".split()
        flags += ["--tokens-per-step", "16384", "--max-iters", args.iters, "--log-interval", "5"]
        flags += ["--eval-interval", args.iters, "--eval-iters", "1", "--sample-tokens", "0"]
        torch.cuda.reset_peak_memory_stats()
        train.train(parse_args([str(f) for f in flags] + ["--out-dir", out]))
        last = [json.loads(line) for line in open(Path(out) / "metrics.jsonl") if "mfu" in line][-1]
    ms, peak = 16384 / last["tokens_per_s"] * 1000, torch.cuda.max_memory_allocated() / 2**30
    rows.append(
        (
            "GPT-2 124M (no biases, as bench.py), micro-batch 16 x 1024, bf16, compiled",
            f"{ms:.2f} ms a step, MFU {last['mfu']:.1%}, peak {peak:.1f} GiB",
        )
    )
    if args.nanogpt:
        bench = ["--compile=True", "--batch_size=16", "--real_data=False", "--profile=False"]
        _, proc = timed([sys.executable, "bench.py", *bench], cwd=args.nanogpt)
        found = re.findall(r"time per iteration: ([\d.]+)ms, MFU: ([\d.]+)%", proc.stdout)
        result = f"{found[-1][0]} ms a step, MFU {found[-1][1]}%" if found else proc.stderr[-200:]
        rows.append(("nanoGPT's bench.py, the same", result))

    # the preset for one GPU, as a user runs it
    with tempfile.TemporaryDirectory() as out:
        seconds, proc = timed(
            [sys.executable, "train.py", "--config", "shakespeare_gpu", "--out-dir", out]
        )
        logged = [json.loads(line) for line in open(Path(out) / "metrics.jsonl")]
    val = [r["val_loss"] for r in logged if "val_loss" in r][-1]
    rows.append(("`python train.py --config shakespeare_gpu`", f"{seconds:.1f} s, val {val:.4f}"))

    print("| what | result |\n|---|---|")
    for what, result in rows:
        print(f"| {what} | {result} |")
    emit({"bench": "gpu", **dict(rows)})
