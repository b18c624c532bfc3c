"""The key/value cache for incremental decoding, and its window slide past block_size.

The cache is static: every buffer is allocated once and never changes shape, and which slots
a step writes and may read are tensors, not Python ints. So a decode step is the same graph at
every position, and `torch.compile` traces it once (GPT.generate(compile=True)).

Host bookkeeping (`pos`, `claim`, `slide`) stays outside that graph; `begin` and `update` are
pure tensor code that runs inside it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .config import GPTConfig


class KVCache:
    """Keys and values of the positions seen so far, for every layer, in max_len slots.

    Rows are left-padded, so all rows write the same slot at each step. `pos` is how many
    slots are written. `mask` (B, max_len) is True where a slot holds a real token of that row
    (padding, stale slots after a slide, and slots not written yet are False): attention reads
    every slot and lets the mask decide, so its shapes never change.
    """

    def __init__(self, config: GPTConfig, batch_size: int, max_len: int, device, dtype):
        self.config = config
        # One tensor per layer, not one stacked tensor: a compiled step then writes the new
        # slot in place, where writing into a slice of a stacked input copied the whole cache.
        shape = (batch_size, config.n_head, max_len, config.head_size)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.mask = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)
        self.pos = 0
        # The current step (set by begin): the slots it writes, and which slots each query sees.
        self.slots = torch.empty(0, dtype=torch.long, device=device)
        self.attn_mask = self.mask[:, None, None, :]

    @property
    def max_len(self) -> int:
        return self.mask.size(1)

    def claim(self, T: int) -> torch.Tensor:
        """Host side of a step: reserve the next T slots and return their indices (T,)."""
        end = self.pos + T
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions, asked for {end}")
        slots = torch.arange(self.pos, end, device=self.mask.device)
        self.pos = end
        return slots

    def begin(self, slots: torch.Tensor, padding_mask: torch.Tensor | None) -> torch.Tensor:
        """Tensor side of a step: make slots (T,) this step's, real where padding_mask (B, T)
        says so (None: all real), and set `attn_mask` (B, 1, T, max_len), True = may attend,
        which every layer's attention reads. Returns the positions (B, T) of the new tokens,
        counting real tokens only (a left-padded row starts at 0 at its first real token)."""
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
        """Make room before a cached decode step, per row, as if each row decoded alone.

        lens[b] is how many real tokens row b has in the cache (always its last lens[b] slots);
        idx (B, T) holds each row's recent tokens. A row whose context filled block_size is
        rebuilt from its last block_size // 2 tokens, the newest of which the coming step
        feeds itself: `prefill(ids, kv_cache=fresh)` (the GPT's trunk) recomputes the rest, so
        positions restart from 0 as they would for a fresh prompt. Halving, not dropping one
        token at a time, keeps re-prefills rare. Then, if fewer than `room` slots are free (the
        tokens the coming call decodes), every row's real slots move to the front. Updates lens in place.
        """
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
