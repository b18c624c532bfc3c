"""Decoding speed, `python bench.py sample`: greedy GPT.generate, the modes taking turns.

eager is the KV cache (sample.py's default), compiled is generate(compile=True) (compiled once
before timing), recompute runs without a cache, and hf (--model gpt2) is transformers'
generate() with its KV cache on the same weights: GPT-2 124M with random weights saved by
save_pretrained and loaded with model.hf.load_hf_gpt2. --model small is a random model shaped
like configs/small.py at --block-size (past it the cache re-prefills the last block_size // 2
tokens). Random weights decode at the speed of trained ones. Each line carries its reference
(transformers, else our eager mode) and the median per-round speedup over it; gpt2's eager and
compiled lines add the bytes a step reads, the GB/s that makes, and a STREAM-like copy bandwidth
(bytes read + written) at the same thread count.

    python bench.py sample                       # small model: eager KV cache, compiled, recompute
    python bench.py sample --model gpt2 --dtypes float32,bfloat16    # GPT-2 124M vs transformers
    python bench.py sample --model gpt2 --modes eager,compiled,hf --dtypes float32,int8   # int8 weights
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from benchmarks import emit, sync
from model.gpt import cache_slots
from errors import UserError


def add_sample_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sample", help="decode tokens/s, ours beside a reference (transformers for --model gpt2)")
    p.add_argument("--model", choices=("small", "gpt2"), default="small",
                   help="small: configs/small.py's shape, random weights; gpt2: GPT-2 124M, random weights "
                        "saved by transformers and loaded with model.hf.load_hf_gpt2")
    p.add_argument("--hf-dir", help="--model gpt2: this save_pretrained directory instead of random weights")
    p.add_argument("--block-size", type=int, default=256, help="--model small: the context (slides past it)")
    p.add_argument("--new-tokens", type=int, default=0, help="default 500 (small), 256 (gpt2)")
    p.add_argument("--prompt-len", type=int, default=0, help="tokens in the random prompt; default 1 (small), 8 (gpt2)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--ragged", action="store_true",
                   help="odd rows get half-length prompts, left-padded (the padding-mask path)")
    p.add_argument("--modes", default="", help="comma-separated from eager, compiled, recompute, hf; "
                   "default eager,compiled,recompute (small), eager,hf (gpt2)")
    p.add_argument("--dtypes", default="auto", help="comma-separated weight dtypes for ours, e.g. float32,bfloat16; "
                   "int8: float32 with weight-only int8 Linear layers (sample.py --quantize int8)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds; modes alternate within each")
    p.add_argument("--threads", type=int, default=0, help="CPU threads; 0 = sample.py's choice (1 when n_embd <= 256)")
    p.add_argument("--device", default="auto")
    p.set_defaults(func=bench_sample)


def stream_copy_gb_s(device: str, nbytes: int = 2**29, repeats: int = 5) -> float:
    """Memory bandwidth as STREAM's copy reports it: (bytes read + bytes written) / s, best of
    repeats, on arrays far larger than the last-level cache (512 MiB each by default)."""
    a = torch.ones(nbytes // 4, device=device)
    b = torch.empty_like(a)
    best = math.inf
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        b.copy_(a)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best / 1e9


def decode_bytes_per_step(model: nn.Module, dtype: torch.dtype, cache_slots: int, batch_size: int,
                          int8: bool = False) -> int:
    """Bytes one cached decode step reads with weights in dtype: every weight except the two
    embedding tables (one row each; a tied lm_head still reads wte whole), and every layer's
    keys and values in all cache slots (attention reads each slot; the mask decides).
    int8: the Linear weights are one byte each (their per-row scales, 2 bytes, counted too)."""
    c, tables = model.config, {"transformer.wte.weight", "transformer.wpe.weight"}
    numel = sum(p.numel() for n, p in model.named_parameters() if n not in tables)
    numel += model.lm_head.weight.numel() if c.tie_weights else 0
    kv = 2 * c.n_layer * batch_size * cache_slots * c.n_embd * dtype.itemsize
    if not int8:
        return numel * dtype.itemsize + kv
    linear = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    in_linear = sum(w.numel() + 2 * w.size(0) for w in linear)
    return (numel - sum(w.numel() for w in linear)) * dtype.itemsize + in_linear + kv


def _sample_model(args: argparse.Namespace, tmp: str) -> tuple[nn.Module, Any]:
    """(our model in float32, the transformers model or None) for --model."""
    from model import GPT

    if args.model == "small":
        from configs import load_config

        config = replace(load_config("small").model_config(65), block_size=args.block_size)
        return GPT(config).eval(), None
    try:
        import transformers
    except ImportError:
        raise UserError("--model gpt2 needs transformers: pip install transformers") from None
    from model.hf import load_hf_gpt2

    path = args.hf_dir
    if path is None:  # GPT-2 124M's shape; random weights decode at the speed of trained ones
        path = tmp
        transformers.GPT2LMHeadModel(transformers.GPT2Config()).save_pretrained(path)
    hf = transformers.GPT2LMHeadModel.from_pretrained(path).eval()
    return load_hf_gpt2(path).eval(), hf


def bench_sample(args: argparse.Namespace) -> None:
    from runtime import setup

    from sample import cpu_threads

    new_tokens = args.new_tokens or (500 if args.model == "small" else 256)
    prompt_len = args.prompt_len or (1 if args.model == "small" else 8)
    modes = [m for m in (args.modes or ("eager,compiled,recompute" if args.model == "small" else "eager,hf")).split(",")]
    if bad := [m for m in modes if m not in ("eager", "compiled", "recompute", "hf")]:
        raise UserError(f"--modes: unknown mode {bad[0]!r}; use eager, compiled, recompute, hf")
    if "hf" in modes and args.model != "gpt2":
        raise UserError("--modes hf needs --model gpt2 (transformers implements GPT-2 only)")
    if min(args.block_size, new_tokens, prompt_len, args.batch_size, args.repeats) < 1:
        raise UserError("--block-size, --new-tokens, --prompt-len, --batch-size, --repeats must be at least 1")
    with tempfile.TemporaryDirectory(prefix="bench-gpt2-") as tmp, contextlib.redirect_stdout(sys.stderr):
        model, hf = _sample_model(args, tmp)
    rt = setup(device=args.device, seed=0, training=False)
    if rt.device_type == "cpu" and (threads := cpu_threads(args.threads, model.config.n_embd)):
        torch.set_num_threads(threads)  # what sample.py would use
    V = model.config.vocab_size
    prompt = torch.randint(0, V, (args.batch_size, prompt_len), generator=torch.Generator().manual_seed(0)).to(rt.device)
    mask = None
    if args.ragged:
        if args.batch_size < 2 or prompt_len < 2:
            raise UserError("--ragged needs --batch-size >= 2 and --prompt-len >= 2")
        mask = torch.ones_like(prompt, dtype=torch.bool)
        mask[1::2, : prompt_len // 2] = False

    runs = _decode_runs(model, hf, modes, args.dtypes, rt, prompt, mask, new_tokens)
    times = _time_alternating({k: f for k, (f, _) in runs.items()}, args.repeats, rt.device)
    # the reference: transformers where it runs, else our eager cached decoding (sample.py's default)
    ref = "hf float32" if "hf" in modes else "eager float32" if "eager float32" in runs else None
    copy_gb_s = stream_copy_gb_s(rt.device) if args.model == "gpt2" else None
    for name, (_, dtype) in runs.items():
        best = min(times[name])
        record = {"bench": "sample", "model": args.model, "impl": "transformers" if name.startswith("hf") else "ours",
                  "mode": name.split()[0], "dtype": name.split()[1], "device": rt.device,
                  "threads": torch.get_num_threads(), "batch_size": args.batch_size, "prompt_len": prompt_len,
                  "new_tokens": new_tokens, "tokens_per_s": round(args.batch_size * new_tokens / best, 1),
                  "ms_per_step": round(1000 * best / new_tokens, 3),
                  "first_call_s": round(times[name + " first"][0], 2)}  # with compilation, for compiled
        if ref and name != ref:
            record |= {"reference": ref, "reference_tokens_per_s": round(args.batch_size * new_tokens / min(times[ref]), 1),
                       "speedup_vs_reference": round(statistics.median(r / t for r, t in zip(times[ref], times[name])), 2)}
        if copy_gb_s and name.split()[0] in ("eager", "compiled"):
            slots = cache_slots(model.config.block_size, prompt_len + new_tokens - 1, name.startswith("compiled"))
            nbytes = decode_bytes_per_step(model, dtype, slots, args.batch_size, int8=name.endswith("int8"))
            record |= {"bytes_per_step": nbytes, "gb_per_s": round(nbytes * new_tokens / best / 1e9, 2),
                       "stream_copy_gb_per_s": round(copy_gb_s, 1)}
        emit(record)


def _decode_runs(model: nn.Module, hf: Any, modes: list[str], dtypes: str, rt: Any, prompt: torch.Tensor,
                 mask: torch.Tensor | None, new_tokens: int) -> dict[str, tuple[Any, torch.dtype]]:
    """"mode dtype" -> (a callable that decodes new_tokens greedily, the weights' dtype); dtype int8
    is float32 with weight-only int8 Linear layers (sample.py --quantize int8)."""
    from model.quantize import quantize_int8
    from runtime import _pick_dtype

    runs: dict[str, tuple[Any, torch.dtype]] = {}
    for name in (d.strip() for d in dtypes.split(",")):
        if name not in ("auto", "float32", "bfloat16", "float16", "int8"):
            raise UserError(f"--dtypes: unknown {name!r}; use auto, float32, bfloat16, float16 or int8")
        dtype = _pick_dtype("float32" if name == "int8" else name, rt.device_type, training=False)
        ours = (model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)).to(rt.device)
        ours = quantize_int8(copy.deepcopy(ours)) if name == "int8" else ours
        label = "int8" if name == "int8" else str(dtype).removeprefix("torch.")
        for mode in (m for m in modes if m != "hf"):
            kw = dict(use_cache=mode != "recompute", compile=mode == "compiled", padding_mask=mask)
            runs[f"{mode} {label}"] = (
                lambda m=ours, kw=kw: sum(1 for _ in m.generate(prompt, new_tokens, temperature=0, **kw)), dtype)
    if "hf" in modes:
        hf.to(rt.device)
        attention_mask = mask.long() if mask is not None else torch.ones_like(prompt)

        def run_hf() -> int:  # greedy with its KV cache (DynamicCache), never stopping early
            with torch.no_grad():
                out = hf.generate(prompt, attention_mask=attention_mask, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0)
            return out.size(1) - prompt.size(1)

        runs["hf float32"] = (run_hf, torch.float32)
    return runs


def _time_alternating(runs: dict[str, Any], repeats: int, device: str) -> dict[str, list[float]]:
    """Seconds per call of each run over `repeats` rounds (speedups are medians of per-round
    ratios), after a first call each, timed apart as "<name> first": allocator, kernels,
    compilation."""
    times: dict[str, list[float]] = {k: [] for k in runs}
    for name, f in runs.items():  # the first call's time is kept apart: it includes compilation
        t0 = time.perf_counter()
        f()
        times[name + " first"] = [time.perf_counter() - t0]
    for _ in range(repeats):
        for name, f in runs.items():  # the runs take turns: load drift hits them alike
            sync(device)
            t0 = time.perf_counter()
            f()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return times
