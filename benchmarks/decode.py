"""Decoding speed: greedy generate() in each mode, beside a reference, the modes taking turns.

    python -m benchmarks sample                   # small model: eager KV cache, compiled, recompute
    python -m benchmarks sample --model gpt2 --modes eager,compiled,hf --dtypes float32,bfloat16,int8

Random weights decode at the speed of trained ones. The reference is transformers' generate(),
else our eager mode; gpt2 adds the GB/s a step reads, beside a STREAM-like copy bandwidth.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import tempfile
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from benchmarks import emit, timed
from configs import load_config
from configs.errors import UserError
from model import GPT
from model.hf import load_hf_gpt2
from model.kv_cache import cache_slots, generate
from model.quantize import quantize_int8
from sample import cpu_threads, left_pad
from training.runtime import choose, probe, setup


def add_sample_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sample", help="decode tokens/s, ours beside a reference (transformers for --model gpt2)")
    p.add_argument("--model", choices=("small", "gpt2"), default="small", help="configs/small.py's shape, or GPT-2 124M's")
    p.add_argument("--hf-dir", help="--model gpt2: this save_pretrained directory instead of random weights")
    p.add_argument("--block-size", type=int, default=256, help="--model small: the context (slides past it)")
    p.add_argument("--new-tokens", type=int, default=0, help="default 500 (small), 256 (gpt2)")
    p.add_argument("--prompt-len", type=int, default=0, help="tokens in the random prompt; default 1 (small), 8 (gpt2)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--ragged", action="store_true", help="odd rows' prompts half as long, left-padded (masked)")
    p.add_argument("--modes", default="", help="comma-separated from eager, compiled, recompute, hf; "
                   "default eager,compiled,recompute (small), eager,hf (gpt2)")
    p.add_argument("--dtypes", default="auto", help="comma-separated weight dtypes for ours, e.g. float32,bfloat16; "
                   "int8: float32 with weight-only int8 Linear layers (sample.py --quantize int8)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds; modes alternate within each")
    p.add_argument("--threads", type=int, default=0, help="CPU threads; 0 = sample.py's choice (1 when n_embd <= 256)")
    p.add_argument("--device", default="auto")
    p.set_defaults(func=bench_sample)


def stream_copy_gb_s(device: str, nbytes: int = 2**29, repeats: int = 5) -> float:
    """Memory bandwidth as STREAM's copy reports it, (bytes read + written) / s, best of repeats,
    on arrays far larger than the last-level cache."""
    a = torch.ones(nbytes // 4, device=device)
    b = torch.empty_like(a)
    return 2 * nbytes / min(timed(lambda: b.copy_(a), device)[1] for _ in range(repeats)) / 1e9


def decode_bytes_per_step(model: nn.Module, dtype: torch.dtype, cache_slots: int, batch_size: int,
                          int8: bool = False) -> int:
    """Bytes one cached decode step reads: every weight but the embedding tables (one row each; a
    tied lm_head reads wte whole; int8 Linear weights: a byte each plus 2-byte row scales), and
    every layer's keys and values in all cache slots (attention reads each; the mask decides)."""
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
    if args.model == "small":
        return GPT(replace(load_config("small").model_config(65), block_size=args.block_size)).eval(), None
    try:
        import transformers
    except ImportError:
        raise UserError("--model gpt2 needs transformers: pip install transformers") from None
    path = args.hf_dir
    if path is None:  # GPT-2 124M's shape
        transformers.GPT2LMHeadModel(transformers.GPT2Config()).save_pretrained(path := tmp)
    return load_hf_gpt2(path).eval(), transformers.GPT2LMHeadModel.from_pretrained(path).eval()


def bench_sample(args: argparse.Namespace) -> None:
    new_tokens = args.new_tokens or (500 if args.model == "small" else 256)
    prompt_len = args.prompt_len or (1 if args.model == "small" else 8)
    modes = (args.modes or ("eager,compiled,recompute" if args.model == "small" else "eager,hf")).split(",")
    if bad := [m for m in modes if m not in ("eager", "compiled", "recompute", "hf")]:
        raise UserError(f"--modes: unknown mode {bad[0]!r}; use eager, compiled, recompute, hf")
    if "hf" in modes and args.model != "gpt2":
        raise UserError("--modes hf needs --model gpt2 (transformers implements GPT-2 only)")
    if min(args.block_size, new_tokens, prompt_len, args.batch_size, args.repeats) < 1:
        raise UserError("--block-size, --new-tokens, --prompt-len, --batch-size, --repeats must be at least 1")
    if args.ragged and (args.batch_size < 2 or prompt_len < 2):
        raise UserError("--ragged needs --batch-size >= 2 and --prompt-len >= 2")
    with tempfile.TemporaryDirectory(prefix="bench-gpt2-") as tmp, contextlib.redirect_stdout(sys.stderr):
        model, hf = _sample_model(args, tmp)
    rt = setup(device=args.device, seed=0, training=False)
    if rt.device_type == "cpu" and (threads := cpu_threads(args.threads, model.config.n_embd)):
        torch.set_num_threads(threads)  # what sample.py would use
    rows = torch.randint(0, model.config.vocab_size, (args.batch_size, prompt_len),
                         generator=torch.Generator().manual_seed(0)).tolist()
    prompt, mask = left_pad([r[prompt_len // 2:] if args.ragged and i % 2 else r for i, r in enumerate(rows)], rt.device)
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
    runs: dict[str, tuple[Any, torch.dtype]] = {}
    for name in (d.strip() for d in dtypes.split(",")):
        if name not in ("auto", "float32", "bfloat16", "float16", "int8"):
            raise UserError(f"--dtypes: unknown {name!r}; use auto, float32, bfloat16, float16 or int8")
        dtype = choose(probe(), rt.device_type, "float32" if name == "int8" else name, training=False).dtype
        ours = (model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)).to(rt.device)
        ours = quantize_int8(copy.deepcopy(ours)) if name == "int8" else ours
        label = "int8" if name == "int8" else str(dtype).removeprefix("torch.")
        for mode in (m for m in modes if m != "hf"):
            kw = dict(use_cache=mode != "recompute", compile=mode == "compiled", padding_mask=mask)
            runs[f"{mode} {label}"] = (
                lambda m=ours, kw=kw: sum(1 for _ in generate(m, prompt, new_tokens, temperature=0, **kw)), dtype)
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
    """Seconds per call of each run in `repeats` rounds, the runs taking turns (load drift hits
    them alike), after a first call each, kept apart as "<name> first" (it includes compilation)."""
    times = {f"{name} first": [timed(f, device)[1]] for name, f in runs.items()}
    for _ in range(repeats):
        for name, f in runs.items():
            times.setdefault(name, []).append(timed(f, device)[1])
    return times
