"""Decoding speed: greedy generate() in each mode beside a reference, the modes taking turns.

    python -m benchmarks sample                   # small model: eager KV cache, compiled, recompute
    python -m benchmarks sample --model gpt2 --modes eager,compiled,hf --dtypes float32,bfloat16

Random weights decode at the speed of trained ones. The reference is transformers' generate(), else our
eager mode. For gpt2 each line adds the GB/s a step reads, beside a STREAM-like copy bandwidth.
"""

import argparse
import contextlib
import copy
import functools
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from benchmarks import emit, timed
from configs import load_config
from configs.cli import integer
from configs.errors import UserError
from model import GPT
from model.hf import load_hf_gpt2
from model.kv_cache import cache_slots, generate
from sample import cpu_threads
from training.runtime import choose, probe, setup


def add_sample_parser(add_parser: Callable[..., argparse.ArgumentParser]) -> None:
    p = add_parser("sample", help="decode tokens/s, ours beside a reference (transformers for --model gpt2)")
    p.add_argument("--model", choices=("small", "gpt2"), default="small", help="small.py's shape or GPT-2 124M's")
    p.add_argument("--block-size", type=integer(1), default=256, help="--model small: the context (slides past it)")
    p.add_argument("--new-tokens", type=integer(0), help="default 500 (small), 256 (gpt2)")
    p.add_argument("--modes", help="comma-separated from eager, compiled, recompute, hf; "
                   "default eager,compiled,recompute (small), eager,hf (gpt2)")
    p.add_argument("--dtypes", default="auto", help="comma-separated weight dtypes for ours, e.g. float32,bfloat16")
    p.add_argument("--repeats", type=integer(1), default=3, help="timed rounds; modes alternate within each")
    p.add_argument("--threads", type=int, default=0, help="CPU threads; 0 = sample.py's choice (1 when n_embd <= 256)")
    p.add_argument("--device", default="auto")
    p.set_defaults(func=bench_sample)


def stream_copy_gb_s(device: str, nbytes: int = 2**29, repeats: int = 5) -> float:
    """STREAM's copy bandwidth, (bytes read + written) / s, the best of `repeats` on an array far larger than cache."""
    a = torch.ones(nbytes // 4, device=device)
    b = torch.empty_like(a)
    return 2 * nbytes / min(timed(lambda: b.copy_(a), device)[1] for _ in range(repeats)) / 1e9


def decode_bytes_per_step(model: nn.Module, dtype: torch.dtype, cache_slots: int) -> int:
    """Bytes a cached decode step of one row reads: each layer's keys and values in every cache slot, and every
    weight but one row of each embedding table (a tied lm_head reads wte whole)."""
    c = model.config
    weights = model.num_params(non_embedding=True) - (0 if c.tie_weights else model.transformer.wte.weight.numel())
    return (weights + 2 * c.n_layer * cache_slots * c.n_embd) * dtype.itemsize


def _sample_model(args: argparse.Namespace) -> tuple[nn.Module, Any]:
    """Our model in float32 for --model, and transformers' model (None for small)."""
    if args.model == "small":
        return GPT(replace(load_config("small").model_config(65), block_size=args.block_size)).eval(), None
    try:
        import transformers
    except ImportError:
        raise UserError("--model gpt2 needs transformers: pip install transformers") from None
    with tempfile.TemporaryDirectory(prefix="bench-gpt2-") as tmp, contextlib.redirect_stdout(sys.stderr):
        transformers.GPT2LMHeadModel(transformers.GPT2Config()).save_pretrained(tmp)  # random weights, GPT-2's shape
        return load_hf_gpt2(tmp).eval(), transformers.GPT2LMHeadModel.from_pretrained(tmp).eval()


def bench_sample(args: argparse.Namespace) -> None:
    new_tokens = args.new_tokens or (500 if args.model == "small" else 256)
    prompt_len = 1 if args.model == "small" else 8  # random tokens
    modes = (args.modes or ("eager,compiled,recompute" if args.model == "small" else "eager,hf")).split(",")
    if bad := [m for m in modes if m not in ("eager", "compiled", "recompute", "hf")]:
        raise UserError(f"--modes: unknown mode {bad[0]!r}; use eager, compiled, recompute, hf")
    if "hf" in modes and args.model != "gpt2":
        raise UserError("--modes hf needs --model gpt2 (transformers implements GPT-2 only)")
    model, hf = _sample_model(args)
    rt = setup(device=args.device, seed=0, training=False)
    if rt.device_type == "cpu" and (threads := cpu_threads(args.threads, model.config.n_embd)):
        torch.set_num_threads(threads)  # what sample.py would use
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len),
                           generator=torch.Generator().manual_seed(0)).to(rt.device)
    runs = _decode_runs(model, hf, modes, args.dtypes, rt, prompt, new_tokens)
    first = {name: timed(f, rt.device)[1] for name, (f, _) in runs.items()}  # compilation included
    times = {name: [] for name in runs}
    for _ in range(args.repeats):  # the runs take turns, so that drift in the machine's load hits them alike
        for name, (f, _) in runs.items():
            times[name].append(timed(f, rt.device)[1])
    # the reference: transformers where it runs, else our eager cached decoding (sample.py's default)
    ref = "hf float32" if "hf" in modes else "eager float32" if "eager float32" in runs else None
    copy_gb_s = stream_copy_gb_s(rt.device) if args.model == "gpt2" else None
    for name, (_, dtype) in runs.items():
        (mode, label), best = name.split(), min(times[name])
        record = {"bench": "sample", "model": args.model, "impl": "transformers" if mode == "hf" else "ours",
                  "mode": mode, "dtype": label, "device": rt.device, "threads": torch.get_num_threads(),
                  "batch_size": 1, "prompt_len": prompt_len, "new_tokens": new_tokens,
                  "tokens_per_s": round(new_tokens / best, 1), "ms_per_step": round(1000 * best / new_tokens, 3),
                  "first_call_s": round(first[name], 2)}
        if ref and name != ref:
            speedup = statistics.median(r / t for r, t in zip(times[ref], times[name]))
            record |= {"reference": ref, "reference_tokens_per_s": round(new_tokens / min(times[ref]), 1),
                       "speedup_vs_reference": round(speedup, 2)}
        if copy_gb_s and mode in ("eager", "compiled"):
            slots = cache_slots(model.config.block_size, prompt_len + new_tokens - 1, mode == "compiled")
            nbytes = decode_bytes_per_step(model, dtype, slots)
            record |= {"bytes_per_step": nbytes, "gb_per_s": round(nbytes * new_tokens / best / 1e9, 2),
                       "stream_copy_gb_per_s": round(copy_gb_s, 1)}
        emit(record)


def _decode_runs(model: nn.Module, hf: Any, modes: list[str], dtypes: str, rt: Any, prompt: torch.Tensor,
                 new_tokens: int) -> dict[str, tuple[Callable[[], Any], torch.dtype]]:
    """"mode dtype" -> (a call that decodes new_tokens greedily, the weights' dtype)."""
    runs = {}
    for name in (d.strip() for d in dtypes.split(",")):
        dtype = choose(probe(), rt.device_type, name, training=False).dtype
        ours = (model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)).to(rt.device)
        label = str(dtype).removeprefix("torch.")
        for mode in (m for m in modes if m != "hf"):
            kw = dict(use_cache=mode != "recompute", compile=mode == "compiled")
            runs[f"{mode} {label}"] = (
                lambda m=ours, kw=kw: sum(1 for _ in generate(m, prompt, new_tokens, temperature=0, **kw)), dtype)
    if "hf" in modes:  # greedy with its KV cache (DynamicCache), never stopping early; generate() needs no grad
        run_hf = functools.partial(hf.to(rt.device).generate, prompt, attention_mask=torch.ones_like(prompt),
                                   do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                   use_cache=True, pad_token_id=0)
        runs["hf float32"] = (run_hf, torch.float32)
    return runs
