"""Training speed: train.py's own loop, in this process or as whole `python train.py` runs."""

import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import emit
from configs import device_and_dtype


def busy_processes(n: int) -> list[subprocess.Popen]:
    """n processes that keep a core each busy, started before the measurement."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def train(args, extra: list[str]) -> None:
    """Tokens/s and ms a step of a run of --iters steps, from its metrics.jsonl: the median of the
    logged windows after the first fifth (warm-up); the evals at the start and end are not timed."""
    import train as trainer
    from configs import parse_args

    others = busy_processes(args.busy)
    try:
        time.sleep(1.0 * bool(others))  # let them start before the run picks its threads
        with tempfile.TemporaryDirectory() as tmp:
            flags = [
                "--config",
                args.config,
                "--max-iters",
                str(args.iters),
                "--eval-interval",
                str(args.iters),
                "--eval-iters",
                "1",
                "--sample-tokens",
                "0",
                "--out-dir",
                tmp,
            ]
            cfg = parse_args([*flags, *extra])
            trainer.train(cfg)
            records = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").open()]
    finally:
        for p in others:
            p.kill()
    rates = [
        r["tokens_per_s"] for r in records if "tokens_per_s" in r and r["step"] > args.iters // 5
    ]
    tokens = statistics.median(rates)
    step_tokens = cfg.tokens_per_step or cfg.batch_size * cfg.block_size
    emit(
        {
            "bench": "train",
            "config": args.config,
            "busy": args.busy,
            "dtype": str(device_and_dtype(cfg.device, cfg.dtype)[1])[6:],
            "threads": torch.get_num_threads(),
            "tokens_per_s": round(tokens),
            "ms_per_step": round(1000 * step_tokens / tokens, 2),
        }
    )


def time_to_loss(args, extra: list[str]) -> None:
    """Whole `python train.py --config NAME` runs, as a user starts them: wall seconds, start-up
    included, and the final val loss."""
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            script = Path(__file__).resolve().parent.parent / "train.py"
            command = [sys.executable, script, "--config", args.config, "--out-dir", tmp, *extra]
            t0 = time.perf_counter()
            first = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            seconds = time.perf_counter() - t0
            first = first.splitlines()[0]  # "cpu, 2 threads, bfloat16, compile off"
            last = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").open()][-1]
        emit(
            {
                "bench": "time-to-loss",
                "config": args.config,
                "flags": " ".join(extra),
                "run": first,
                "dtype": next(
                    p for p in first.split(", ") if p in ("float32", "bfloat16", "float16")
                ),
                "threads": int(re.search(r"(\d+) threads?", first + " 0 threads")[1]),
                "wall_s": round(seconds, 1),
                "step": last["step"],
                "val_loss": last.get("val_loss"),
            }
        )


def share(args, extra: list[str]) -> None:
    """A train.py run in this process, stamped where its steps start and end: the share of the time
    from its first printed line to its last that went to training steps (the rest: start-up, the
    final eval, the save, the plot and the sample)."""
    import train as trainer
    from configs import parse_args
    from data.loader import Batches

    stamps, setup, evaluate = {}, trainer.setup, trainer.evaluate

    def stamped_setup(cfg):  # the first line is printed right after it
        rt = setup(cfg)
        stamps["first_line"] = time.time()
        return rt

    class Stamped(Batches):
        def __call__(self, step):
            stamps.setdefault("first_step", time.time())
            return super().__call__(step)

    def stamped_evaluate(*args):  # the first eval after the steps: the final one
        stamps.setdefault("steps_end", time.time())
        return evaluate(*args)

    trainer.setup, trainer.Batches, trainer.evaluate = stamped_setup, Stamped, stamped_evaluate
    with tempfile.TemporaryDirectory() as tmp:
        cfg = parse_args(["--config", args.config, "--out-dir", tmp, *extra])
        result = trainer.train(cfg)
    end = time.time()
    emit(
        {
            "bench": "max-time",
            "config": args.config,
            "flags": " ".join(extra),
            "dtype": str(device_and_dtype(cfg.device, cfg.dtype)[1])[6:],
            "steps": result["step"],
            "val_loss": result.get("val_loss"),
            "printed_s": round(end - stamps["first_line"], 2),
            "start_s": round(stamps["first_step"] - stamps["first_line"], 2),
            "end_s": round(end - stamps["steps_end"], 2),
            "in_steps": round(
                (stamps["steps_end"] - stamps["first_step"]) / (end - stamps["first_line"]), 3
            ),
        }
    )
