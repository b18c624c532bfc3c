"""The key/value cache for incremental decoding, and its window slide past block_size.

Pure bookkeeping on tensors: attention writes into it (`update`), the GPT counts positions
(`pos`) and `slide` keeps decoding going once a row's context fills the model's block_size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .config import GPTConfig


class KVCache:
    """Keys and values of the positions seen so far, for every layer, preallocated.

    `pos` is how many positions are stored. `key_mask` (B, pos) is kept only when some
    position is padding, so unpadded decoding stays on the mask-free fast path.
    """

    def __init__(self, config: GPTConfig, batch_size: int, max_len: int, device, dtype):
        self.config = config
        shape = (config.n_layer, batch_size, config.n_head, max_len, config.head_size)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.pos = 0
        self.key_mask: torch.Tensor | None = None

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, nh, T, hs) at positions pos .. pos+T-1; return all keys/values so far."""
        end = self.pos + k.size(2)
        if end > self.k.size(3):
            raise ValueError(f"KV cache holds {self.k.size(3)} positions, asked for {end}")
        self.k[layer, :, :, self.pos : end] = k
        self.v[layer, :, :, self.pos : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def extend_mask(self, padding_mask: torch.Tensor | None, T: int) -> torch.Tensor | None:
        """The key mask over all positions after appending T new ones (None: no padding anywhere)."""
        if padding_mask is None and self.key_mask is None:
            return None
        B = self.k.size(1)
        if self.key_mask is None:
            self.key_mask = torch.ones(B, self.pos, dtype=torch.bool, device=self.k.device)
        if padding_mask is None:
            padding_mask = torch.ones(B, T, dtype=torch.bool, device=self.k.device)
        self.key_mask = torch.cat([self.key_mask, padding_mask], dim=1)
        return self.key_mask

    def slide(self, lens: list[int], idx: torch.Tensor, prefill: Callable[..., Any]) -> None:
        """Make room before a cached decode step, per row, as if each row decoded alone.

        lens[b] is how many real tokens row b has in the cache (always its last lens[b] slots);
        idx (B, T) holds each row's recent tokens. A row whose context filled block_size is
        rebuilt from its last block_size // 2 tokens, the newest of which the coming step
        feeds itself: `prefill(ids, kv_cache=fresh)` (the GPT's trunk) recomputes the rest, so
        positions restart from 0 as they would for a fresh prompt. Halving, not dropping one
        token at a time, keeps re-prefills rare. Then, if the cache is full, the leading slots
        that are padding in every row are dropped. Updates lens in place.
        """
        block_size = self.config.block_size
        rows = [b for b, n in enumerate(lens) if n >= block_size]
        P, keep = self.pos, block_size // 2 - 1
        if rows and keep > 0:
            fresh = KVCache(self.config, len(rows), keep, idx.device, self.k.dtype)
            prefill(idx[rows, -keep - 1 : -1], kv_cache=fresh)
            self.k[:, rows, :, P - keep : P] = fresh.k
            self.v[:, rows, :, P - keep : P] = fresh.v
        if rows:
            if self.key_mask is None:
                self.key_mask = torch.ones(len(lens), P, dtype=torch.bool, device=idx.device)
            self.key_mask[rows, : P - keep] = False  # the rebuilt rows' older slots are now stale
            for b in rows:
                lens[b] = keep
        if P == self.k.size(3):  # full: every row's real tokens are its last lens[b] slots
            need = max(lens)
            self.k[:, :, :, :need] = self.k[:, :, :, P - need : P].clone()
            self.v[:, :, :, :need] = self.v[:, :, :, P - need : P].clone()
            self.pos = need
            if self.key_mask is not None:
                self.key_mask = self.key_mask[:, P - need :]
                if bool(self.key_mask.all()):
                    self.key_mask = None  # back on the mask-free fast path
