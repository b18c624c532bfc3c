"""Decoding: generate(), with its reference loop and its fast path side by side, and the KV cache.

The fast path's cache never changes shape and its slots are tensors, so `torch.compile` traces one
decode step for every position; host bookkeeping (`pos`, `claim`, `slide`) stays outside that graph."""

from collections.abc import Callable, Iterator
from contextlib import nullcontext
from functools import cache
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # annotations only
    from configs.model import GPTConfig

DECODE_CHUNK = 4  # tokens per compiled call: amortises its overhead, still compiles quickly


@torch.no_grad()
def generate(model: torch.nn.Module, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, *, eos_id: int | None = None,
             padding_mask: torch.Tensor | None = None, generator: torch.Generator | None = None,
             vocab_size: int | None = None, use_cache: bool = True, compile: bool = False) -> Iterator[torch.Tensor]:
    """Yield (B,) new token ids, one step at a time, for streaming. idx (B, T) is left-padded where padding_mask
    is False; logits are cut to vocab_size (a tokenizer's, below a padded model vocabulary). Finished rows
    repeat eos_id until all have; use_cache=False runs the reference loop."""
    was_training, done = model.training, torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)
    model.eval()
    args = (model, idx, padding_mask, max_new_tokens, temperature, top_k, top_p, generator, vocab_size)
    try:
        for tok in cached_decode(*args, compile) if use_cache else reference_decode(*args):
            if eos_id is not None:
                tok = torch.where(done, eos_id, tok)  # A finished row repeats its end-of-text.
                done |= tok == eos_id
            yield tok
            if eos_id is not None and bool(done.all()):
                return
    finally:
        model.train(was_training)


def reference_decode(model: torch.nn.Module, idx: torch.Tensor, padding_mask: torch.Tensor | None, max_new_tokens: int,
                     temperature: float, top_k: int | None, top_p: float | None, generator: torch.Generator | None,
                     vocab_size: int | None) -> Iterator[torch.Tensor]:
    """nanoGPT's loop, with no cache: slow, and plainly right. The fast path is tested against it."""
    block_size = model.config.block_size
    for _ in range(max_new_tokens):
        window = idx[:, -block_size:]  # (B, T) -> (B, <= block_size): the model sees no further back
        mask = None if padding_mask is None else padding_mask[:, -block_size:]
        logits, _ = model(window, padding_mask=mask)  # (B, T, V)
        logits = logits[:, -1, :vocab_size]  # (B, T, V) -> (B, vocab_size): the last position, no padding ids
        # Divide by the temperature, keep the top_k and top_p likeliest, softmax, draw (argmax at 0).
        tok = sample_next(logits, temperature, top_k, top_p, generator=generator)  # (B,)
        yield tok
        idx = torch.cat([idx, tok[:, None]], dim=1)  # (B, T) -> (B, T + 1)
        if padding_mask is not None:
            padding_mask = torch.cat([padding_mask, torch.ones_like(tok[:, None], dtype=torch.bool)], dim=1)


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                generator: torch.Generator | None = None, noise: torch.Tensor | None = None) -> torch.Tensor:
    """(B, V) logits -> (B,) token ids: temperature 0 is greedy, top_k keeps the k likeliest, top_p the
    smallest set reaching p. noise: (B, V) Exp(1) draws to sample with (default: from generator)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    # The top logit shifted to 0 and t >= float32's tiny: a tiny t sends the rest to -inf, never to nan.
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
    # An exponential race: argmax p_i / Exp(1) draws exactly as torch.multinomial, at half its cost.
    probs = logits.softmax(dim=-1)
    if noise is None:
        noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def cached_decode(model: torch.nn.Module, idx: torch.Tensor, padding_mask: torch.Tensor | None, max_new_tokens: int,
                  temperature: float, top_k: int | None, top_p: float | None, generator: torch.Generator | None,
                  vocab_size: int | None, compile: bool) -> Iterator[torch.Tensor]:
    """The fast path: the reference's tokens from a KV cache, one token a step or DECODE_CHUNK a compiled call.
    Past block_size a row restarts from its last half (KVCache.slide), as if it decoded alone."""
    if max_new_tokens == 0:
        return
    block_size, B, V = model.config.block_size, idx.size(0), vocab_size or model.config.vocab_size
    idx = idx[:, -block_size:]  # (B, T) -> (B, <= block_size): the reference's first window
    mask = None if padding_mask is None else padding_mask[:, -block_size:]
    cache = KVCache(model.config, B, cache_slots(block_size, idx.size(1) + max_new_tokens - 1, compile),
                    idx.device, model.transformer.wte.weight.dtype)
    lens = [idx.size(1)] * B if mask is None else mask.sum(1).tolist()  # Real tokens per row: slides are per row.
    sampling, x = (temperature, top_k, top_p), model.trunk(idx, mask, kv_cache=cache)
    toks = sample_next(last_logits(model, x, vocab_size), *sampling, generator=generator)[None]  # (1, B)
    n, chunk, checked = 0, DECODE_CHUNK if compile else 1, False
    while True:
        for tok in toks:  # (B,) each
            yield tok
            idx = torch.cat([idx, tok[:, None]], dim=1)[:, -block_size:]  # (B, <= block_size): all a slide reads
        n += toks.size(0)
        if n == max_new_tokens:
            return
        cache.slide(lens, idx, model.trunk, room=chunk)
        # A chunk is compiled only where no slide falls inside it; elsewhere the step runs eagerly.
        K = chunk if min(cache.max_len - cache.pos, block_size - max(lens), max_new_tokens - n) >= chunk else 1
        # The noise (K, B, V) is drawn here, step by step as sample_next draws it: every path samples alike.
        noise = None if temperature == 0 else torch.stack(
            [torch.empty(B, V, device=idx.device).exponential_(generator=generator) for _ in range(K)])
        step = compiled_decode_steps() if K > 1 else decode_steps
        # The newest token (B, 1) as drawn, not a view of idx, whose changing strides would retrace.
        args = (toks[-1][:, None], cache.claim(K), cache, noise)
        # After the first compiled step its guards cannot change here; skipping them saves a small model's arithmetic.
        try:
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True) if checked and K > 1 else nullcontext():
                toks = step(model, *args, sampling, vocab_size)  # (K, B)
        except torch._dynamo.exc.FailOnRecompileLimitHit:  # a 9th shape in this process: eager from here on
            toks, chunk = decode_steps(model, *args, sampling, vocab_size), 1
        checked, lens = checked or K > 1, [m + K for m in lens]


def decode_steps(model: torch.nn.Module, idx: torch.Tensor, slots: torch.Tensor, cache: "KVCache",
                 noise: torch.Tensor | None, sampling: tuple, vocab_size: int | None) -> torch.Tensor:
    """One step per slot in slots (K,) from idx (B, 1), step i drawing with noise[i] -> (K, B). Compiled, the
    loop unrolls: K tokens for one call's overhead."""
    toks = []
    for i in range(slots.size(0)):
        x = model.trunk(idx, kv_cache=cache, slots=slots[i : i + 1])
        logits = last_logits(model, x, vocab_size)  # (B, vocab_size)
        toks.append(sample_next(logits, *sampling, noise=None if noise is None else noise[i]))
        idx = toks[-1][:, None]  # (B,) -> (B, 1)
    return torch.stack(toks)  # K x (B,) -> (K, B)


def last_logits(model: torch.nn.Module, x: torch.Tensor, vocab_size: int | None) -> torch.Tensor:
    """The next-token logits from the last position, cut to vocab_size: (B, T, C) -> (B, vocab_size)."""
    return model.lm_head(model.transformer.ln_f(x[:, -1]))[:, :vocab_size]


@cache
def compiled_decode_steps() -> Callable[..., torch.Tensor]:
    """decode_steps compiled once per process (one graph per shape), for small models' per-op overhead.
    decompose_mm_pass lets inductor fuse one-row matmuls; size asserts cost more than the arithmetic."""
    options = {"post_grad_fusion_options": {"decompose_mm_pass": {}}, "size_asserts": False}
    return torch.compile(decode_steps, fullgraph=True, dynamic=False, options=options)


class KVCache:
    """Keys and values of every layer in max_len slots, all rows writing the same slot at each step.
    Attention reads every slot; `mask` (B, max_len) is True where a slot holds a real token of that row."""

    def __init__(self, config: "GPTConfig", batch_size: int, max_len: int, device, dtype):
        self.config = config
        # One tensor per layer: a compiled step writes in place, where a stacked one was copied whole.
        shape = (batch_size, config.n_head, max_len, config.head_size)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.mask = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)
        self.max_len, self.pos = max_len, 0

    def claim(self, T: int) -> torch.Tensor:
        """Host side of a step: reserve the next T slots and return their indices (T,)."""
        self.pos += T
        return torch.arange(self.pos - T, self.pos, device=self.mask.device)

    def begin(self, slots: torch.Tensor, padding_mask: torch.Tensor | None) -> torch.Tensor:
        """Tensor side of a step: write slots (T,) next, set `attn_mask` (B, 1, T, max_len) for every layer and
        return the tokens' positions (B, T), which count real tokens only (padding_mask None: all real)."""
        T = slots.size(0)
        before = self.mask.sum(1, keepdim=True)  # (B, 1)
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
        """Make room before a step, per row, as if it decoded alone; lens[b] (updated in place) counts row b's last
        real slots. A full row re-prefills its last block_size // 2 tokens of idx (B, T) from position 0 (halving
        keeps this rare), and when fewer than `room` slots are free the real ones move to the front."""
        block_size = self.config.block_size
        rows = [b for b, n in enumerate(lens) if n >= block_size]
        P, keep = self.pos, max(0, block_size // 2 - 1)
        if rows:
            self.mask[rows, :P] = False  # stale
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
    """KV cache slots for `needed` positions, at most block_size. Compiled, rounded up to a multiple of
    block_size / 8, so at most 8 graphs (one per size) serve every length."""
    step = max(1, block_size // 8)
    return min(block_size, -(-needed // step) * step if compile else needed)
