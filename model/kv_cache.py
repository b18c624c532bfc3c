"""Cached decoding: the KV cache, and the sampling loop that fills it (GPT.generate's engine).

The cache is static: every buffer is allocated once and never changes shape, and which slots
a step writes and may read are tensors, not Python ints. So a decode step is the same graph at
every position, and `torch.compile` traces it once (GPT.generate(compile=True)). Host
bookkeeping (`pos`, `claim`, `slide`) stays outside that graph; `begin` and `update` run inside it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import nullcontext
from functools import cache
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # annotations only
    from configs.model import GPTConfig


# Tokens per compiled call: enough to amortise the call's overhead, few enough to compile quickly.
DECODE_CHUNK = 4


class KVCache:
    """Keys and values of every layer in max_len slots. Rows are left-padded, so all rows write
    the same slot at each step; `pos` slots are written. `mask` (B, max_len) is True where a slot
    holds a real token of that row (not padding, not stale after a slide, not unwritten yet):
    attention reads every slot and lets the mask decide."""

    def __init__(self, config: GPTConfig, batch_size: int, max_len: int, device, dtype):
        self.config = config
        # One tensor per layer, not one stacked tensor: a compiled step then writes the new
        # slot in place, where writing into a slice of a stacked input copied the whole cache.
        shape = (batch_size, config.n_head, max_len, config.head_size)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.mask = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)
        self.max_len, self.pos = max_len, 0
        # The current step (set by begin): the slots it writes, and which slots each query sees.
        self.slots = torch.empty(0, dtype=torch.long, device=device)
        self.attn_mask = self.mask[:, None, None, :]  # (B, L) -> (B, 1, 1, L)

    def claim(self, T: int) -> torch.Tensor:
        """Host side of a step: reserve the next T slots and return their indices (T,)."""
        if self.pos + T > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions, asked for {self.pos + T}")
        self.pos += T
        return torch.arange(self.pos - T, self.pos, device=self.mask.device)

    def begin(self, slots: torch.Tensor, padding_mask: torch.Tensor | None) -> torch.Tensor:
        """Tensor side of a step: make slots (T,) this step's, real where padding_mask (B, T) says so
        (None: all), and set `attn_mask` (B, 1, T, max_len), True = may attend, for every layer. Returns
        the new tokens' positions (B, T), counting real tokens only (a left-padded row starts at 0)."""
        T = slots.size(0)
        before = self.mask.sum(1, keepdim=True)  # (B, 1) real tokens already cached
        if padding_mask is None:
            pos = before + torch.arange(T, device=slots.device)  # (B, 1) + (T,) -> (B, T)
            self.mask.index_fill_(1, slots, True)
        else:
            pos = before + (padding_mask.long().cumsum(1) - 1).clamp(min=0)  # (B, T)
            self.mask.index_copy_(1, slots, padding_mask)
        self.slots = slots
        self.attn_mask = self.mask[:, None, None, :]  # (B, L) -> (B, 1, 1, L); later slots are all False
        if T > 1:  # several new tokens: each sees the tokens before it, and itself (a padding query too)
            key = torch.arange(self.max_len, device=slots.device)
            self.attn_mask = (self.attn_mask & (key <= slots[:, None])) | (key == slots[:, None])  # (B, 1, T, L)
        return pos

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, nh, T, hs) in this step's slots; return every slot (B, nh, max_len, hs)."""
        dtype = self.k[layer].dtype  # under autocast k and v may be lower precision than the cache
        self.k[layer].index_copy_(2, self.slots, k.to(dtype))  # (B, nh, T, hs) into (B, nh, max_len, hs)
        self.v[layer].index_copy_(2, self.slots, v.to(dtype))
        return self.k[layer], self.v[layer]

    def slide(self, lens: list[int], idx: torch.Tensor, prefill: Callable[..., Any], room: int = 1) -> None:
        """Make room before a cached decode step, per row, as if each row decoded alone. lens[b]
        counts row b's real tokens in the cache (always its last lens[b] slots); idx (B, T) holds
        each row's recent tokens. A row whose context filled block_size is rebuilt from its last
        block_size // 2 tokens (halving keeps re-prefills rare): `prefill(ids, kv_cache=fresh)` (the
        GPT's trunk) recomputes all but the newest, which the coming step feeds, so positions restart
        from 0 as for a fresh prompt. Then, if fewer than `room` slots are free, every row's real
        slots move to the front. Updates lens in place."""
        block_size = self.config.block_size
        rows = [b for b, n in enumerate(lens) if n >= block_size]
        P, keep = self.pos, max(0, block_size // 2 - 1)
        if rows:
            self.mask[rows, :P] = False  # the rebuilt rows' older slots are now stale
            if keep > 0:
                fresh = KVCache(self.config, len(rows), keep, idx.device, self.k[0].dtype)
                prefill(idx[rows, -keep - 1 : -1], kv_cache=fresh)
                for buf, new in zip(self.k + self.v, fresh.k + fresh.v):
                    buf[rows, :, P - keep : P] = new
                self.mask[rows, P - keep : P] = True
            for b in rows:
                lens[b] = keep
        if P + room > self.max_len:  # full: every row's real tokens are its last lens[b] slots
            need = max(lens)
            for buf in self.k + self.v:
                buf[:, :, :need] = buf[:, :, P - need : P].clone()
            self.mask[:, :need] = self.mask[:, P - need : P].clone()
            self.mask[:, need:] = False
            self.pos = need


def cache_slots(block_size: int, needed: int, compile: bool) -> int:
    """KV cache slots for `needed` positions, at most block_size (past it the cache slides). Compiled,
    rounded up to a multiple of block_size / 8: each size is its own graph, so at most 8 serve every
    length, while attention (which reads every slot) reads few more than the run needs."""
    step = max(1, block_size // 8)
    return min(block_size, -(-needed // step) * step if compile else needed)


def decode(model: torch.nn.Module, idx: torch.Tensor, max_new_tokens: int, temperature: float, top_k: int | None,
           top_p: float | None, eos_id: int | None, padding_mask: torch.Tensor | None,
           generator: torch.Generator | None, use_cache: bool, compile: bool) -> Iterator[torch.Tensor]:
    """GPT.generate's loop (arguments: see there). With the cache the first step fills it (the prefill), each
    later step feeds one token, and rows slide one by one (KVCache.slide): a batch decodes like its rows alone."""
    block_size, B, V = model.config.block_size, idx.size(0), model.config.vocab_size
    mask = padding_mask if padding_mask is not None and not bool(padding_mask.all()) else None
    done = torch.zeros(B, dtype=torch.bool, device=idx.device)
    cache, next_input, window, checked, n = None, None, slice(-block_size, None), False, 0
    sampling, chunk = (temperature, top_k, top_p), DECODE_CHUNK if compile else 1

    while n < max_new_tokens:
        if cache is None:  # a forward over the window: every step without the cache, else the prefill
            if use_cache:
                T = idx[:, window].size(1)
                cache = KVCache(model.config, B, cache_slots(block_size, T + max_new_tokens - 1, compile),
                                idx.device, model.transformer.wte.weight.dtype)
                lens = mask[:, window].sum(1).tolist() if mask is not None else [T] * B
            x = model.trunk(idx[:, window], None if mask is None else mask[:, window], kv_cache=cache)
            toks = sample_next(last_logits(model, x), *sampling, generator=generator)[None]  # (1, B)
        else:
            cache.slide(lens, idx, model.trunk, room=chunk)
            # compiled: `chunk` tokens a call while no slide falls inside them, else eager steps
            K = chunk if min(cache.max_len - cache.pos, block_size - max(lens), max_new_tokens - n) >= chunk else 1
            step = compiled_decode_steps() if K > 1 else decode_steps
            # (K, B, V) noise, drawn here step by step, as sample_next draws: every path samples alike
            noise = None if temperature == 0 else torch.stack(
                [torch.empty(B, V, device=idx.device).exponential_(generator=generator) for _ in range(K)])
            slots = cache.claim(K)
            # Once a compiled step has run, nothing its guards check changes within this
            # generate(): skip them (they cost as much as a small model's arithmetic).
            try:
                with torch.compiler.set_stance(skip_guard_eval_unsafe=True) if checked and K > 1 else nullcontext():
                    toks = step(model, next_input, slots, cache, noise, sampling)  # (K, B)
            except torch._dynamo.exc.FailOnRecompileLimitHit:  # a 9th shape in this process: eager from here
                toks, chunk = decode_steps(model, next_input, slots, cache, noise, sampling), 1
            checked, lens = checked or K > 1, [m + K for m in lens]
        for tok in toks:  # (B,) each
            if eos_id is not None:
                tok = torch.where(done, torch.full_like(tok, eos_id), tok)
                done |= tok == eos_id
            yield tok
            n, next_input = n + 1, tok[:, None]
            idx = torch.cat([idx[:, -block_size:], next_input], dim=1)  # no step reads further back
            if mask is not None:
                mask = torch.cat([mask[:, -block_size:], torch.ones_like(next_input, dtype=torch.bool)], dim=1)
            if (eos_id is not None and bool(done.all())) or n == max_new_tokens:
                return


def last_logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The next-token logits from the last position: (B, T, C) -> (B, V)."""
    return model.lm_head(model.transformer.ln_f(x[:, -1]))


def decode_steps(model: torch.nn.Module, idx: torch.Tensor, slots: torch.Tensor, cache: KVCache, noise: torch.Tensor | None,
                 sampling: tuple) -> torch.Tensor:
    """(B, 1) tokens, then one step per cache slot in slots (K,) the caller claimed, each feeding
    the token the step before drew (with sample_next(*sampling), noise[i] of (K, B, V)) -> (K, B).
    Compiled, the loop is unrolled: one call decodes K tokens for one call's overhead."""
    toks = []
    for i in range(slots.size(0)):
        x = model.trunk(idx, kv_cache=cache, slots=slots[i : i + 1])
        toks.append(sample_next(last_logits(model, x), *sampling, noise=None if noise is None else noise[i]))
        idx = toks[-1][:, None]
    return torch.stack(toks)


@cache
def compiled_decode_steps() -> Callable[..., torch.Tensor]:
    """decode_steps through torch.compile, once per process (parameters are graph inputs, so models
    of one shape share a graph): one trace per model shape, batch size and cache length, eager past
    dynamo's 8 graphs a process. Worth it for small models, whose eager steps are mostly per-op
    overhead. decompose_mm_pass: one-row matmuls become loops inductor fuses with their neighbours,
    not a library call each. size_asserts off: the shapes are fixed, and checking them on every
    call cost more than a small model's arithmetic."""
    options = {"post_grad_fusion_options": {"decompose_mm_pass": {}}, "size_asserts": False}
    return torch.compile(decode_steps, fullgraph=True, dynamic=False, options=options)


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                generator: torch.Generator | None = None, noise: torch.Tensor | None = None) -> torch.Tensor:
    """(B, V) logits -> (B,) token ids. temperature 0 is greedy; top_k keeps the k likeliest,
    top_p the smallest set whose probability reaches p (nucleus). noise: (B, V) Exp(1) draws
    to sample with (default: drawn from generator)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    # The top logit shifted to exactly 0 and t at least float32's smallest normal: a tiny t sends the
    # rest to -inf, never inf - inf or 0 / 0 = nan (1e-300 is 0 in float32), so it approaches greedy.
    logits = logits.float()
    logits = (logits - logits.amax(-1, keepdim=True)) / max(temperature, torch.finfo(torch.float32).tiny)
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens before it already reach top_p; the first always stays.
        drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        drop_sorted[..., 0] = False  # 0 >= top_p when top_p underflows float32 (1e-300)
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    # A draw from probs: the index of the smallest of independent Exp(1) / p_i (an exponential
    # race; each Exp(1) / p_i is exponential with rate p_i). Exact, like torch.multinomial,
    # and half its cost per step, which checks its input with an extra pass.
    probs = logits.softmax(dim=-1)
    if noise is None:
        noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)
