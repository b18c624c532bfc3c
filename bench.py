"""Benchmarks. Each subcommand prints one JSON line per measurement (easy to grep, diff, plot).

    python bench.py sample                       # decode speed: KV cache vs full recompute
    python bench.py sample --block-size 256 --new-tokens 500 --batch-size 1 --device cpu

`sample` times GPT.generate on a randomly initialised model shaped like configs/small.py
(4 layers, n_embd 128, 4 heads, vocab 65) at --block-size, once with the KV cache and once by
full recompute (use_cache=False). Random weights decode at the same speed as trained ones.
Past block_size both slide: the cache re-prefills the last block_size // 2 tokens, full
recompute reruns the last block_size every step.

Adding a benchmark: write `add_<name>_parser(subparsers)` and `bench_<name>(args)`, and
register the parser in `build_parser`.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from typing import Any

import torch

from errors import UserError, entry_point


def _emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _peak_memory_mb(device: str) -> tuple[str, float]:
    """GPU: peak allocated by torch since the last reset. CPU: the process's peak RSS so far
    (a high-water mark for the whole process, so it never goes down between measurements)."""
    if device.startswith("cuda"):
        return "peak_gpu_mem_mb", torch.cuda.max_memory_allocated() / 2**20
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return "peak_rss_mb", rss_kb / (2**20 if sys.platform == "darwin" else 2**10)


# ---------------------------------------------------------------------------- sample


def add_sample_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sample", help="decode tokens/s with the KV cache vs full recompute")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=500)
    p.add_argument("--prompt-len", type=int, default=1, help="tokens in the (random) prompt")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--ragged", action="store_true",
                   help="odd rows get half-length prompts, left-padded (the padding-mask path)")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=65)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per mode; the fastest is reported")
    p.add_argument("--modes", default="cache,recompute", help="comma-separated: cache, recompute")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=0, help="CPU threads; 0 = sample.py's choice (1 when n_embd <= 256)")
    p.set_defaults(func=bench_sample)


def bench_sample(args: argparse.Namespace) -> None:
    from model import GPT, GPTConfig
    from runtime import setup

    from sample import cpu_threads

    for flag in ("block_size", "new_tokens", "prompt_len", "batch_size", "repeats"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be at least 1")
    rt = setup(device=args.device, dtype=args.dtype, seed=0)
    if rt.device_type == "cpu" and (threads := cpu_threads(args.threads, args.n_embd)):
        torch.set_num_threads(threads)  # what sample.py would use
    config = GPTConfig(vocab_size=args.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                       n_head=args.n_head, n_embd=args.n_embd, dropout=0.0)
    # Inference only: store the weights in the compute dtype (no autocast casts per step).
    model = GPT(config).to(device=rt.device, dtype=rt.dtype).eval()
    prompt = torch.randint(0, args.vocab_size, (args.batch_size, args.prompt_len), device=rt.device)
    mask = None
    if args.ragged:
        if args.batch_size < 2 or args.prompt_len < 2:
            raise UserError("--ragged needs --batch-size >= 2 and --prompt-len >= 2")
        mask = torch.ones_like(prompt, dtype=torch.bool)
        mask[1::2, : args.prompt_len // 2] = False
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if bad := [m for m in modes if m not in ("cache", "recompute")]:
        raise UserError(f"--modes: unknown mode {bad[0]!r}; use cache and/or recompute")

    def run(use_cache: bool, n: int) -> int:
        gen = torch.Generator(device=rt.device).manual_seed(0)
        count = 0
        for _ in model.generate(prompt, n, temperature=1.0, generator=gen,
                                padding_mask=mask, use_cache=use_cache):
            count += 1
        _sync(rt.device)
        return count

    for mode in modes:
        run(mode == "cache", min(args.new_tokens, 20))  # warm-up: allocator, kernels, lazy init
    # Modes alternate within each repeat so both see the same machine load; the best time wins.
    best, peak, steps = dict.fromkeys(modes, float("inf")), dict.fromkeys(modes, 0.0), 0
    for _ in range(args.repeats):
        for mode in modes:
            if rt.device_type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            steps = run(mode == "cache", args.new_tokens)
            best[mode] = min(best[mode], time.perf_counter() - t0)
            mem_key, mem = _peak_memory_mb(rt.device)
            peak[mode] = max(peak[mode], mem)
    tokens = steps * args.batch_size
    shape = dict(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, vocab_size=args.vocab_size,
                 block_size=args.block_size, batch_size=args.batch_size, prompt_len=args.prompt_len,
                 ragged=args.ragged, new_tokens=args.new_tokens)
    for mode in modes:
        _emit({
            "bench": "sample", "mode": mode, "config": shape,
            "device": rt.describe(), "threads": torch.get_num_threads(),
            "tokens_per_s": round(tokens / best[mode], 1), "ms_per_token": round(1000 * best[mode] / tokens, 3),
            "ms_per_step": round(1000 * best[mode] / steps, 3), "seconds": round(best[mode], 4),
            mem_key: round(peak[mode], 1),
        })
    if len(modes) == 2:
        _emit({"bench": "sample", "speedup_cache_vs_recompute": round(best["recompute"] / best["cache"], 2)})


# ---------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_sample_parser(sub)
    return parser


@entry_point
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
