"""Multi-head attention, fused (the GPT's) and per-head (the write-ups' form, the tests' oracle)."""

import math
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from .layers import apply_rotary

if TYPE_CHECKING:  # annotations only
    from configs.model import GPTConfig

    from .kv_cache import KVCache


def lengths_to_mask(valid_lens: torch.Tensor, size: int) -> torch.Tensor:
    """(B,) or (B, Tq) valid lengths -> (B, size) or (B, Tq, size) bool, True below the length."""
    return torch.arange(size, device=valid_lens.device) < valid_lens[..., None]


class CausalSelfAttention(nn.Module):
    """Fused multi-head causal self-attention, the GPT's. A query with no key to attend to (a cached padding
    step with nothing real before it) gets attention 0 on both paths, so its output is c_proj's bias."""

    def __init__(self, config: "GPTConfig", layer_idx: int = 0):
        super().__init__()
        self.n_head = config.n_head
        self.head_size = config.head_size
        self.layer_idx = layer_idx  # which slot of a shared KVCache belongs to this layer
        self.dropout = config.dropout
        self.use_sdpa = config.attention == "sdpa"
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.q_norm = nn.RMSNorm(self.head_size, eps=config.norm_eps) if config.qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_size, eps=config.norm_eps) if config.qk_norm else None
        # True above the diagonal, the future. It follows from block_size, so it is not saved with the weights.
        future = torch.ones(config.block_size, config.block_size, dtype=torch.bool).triu_(1)
        self.register_buffer("causal_mask", future, persistent=False)

    def forward(self, x: torch.Tensor, *, padding_mask: torch.Tensor | None = None,
                rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                kv_cache: "KVCache | None" = None) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C). padding_mask (B, T) is True at real tokens; rotary is (cos, sin) for the
        query positions. With kv_cache, keys and values go to the step's slots and the cache's mask applies."""
        B, T, C = x.size()
        # (B, T, 3C) -> 3 x (B, T, C) -> 3 x (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.n_head, self.head_size).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        mask = None  # bool (B, 1, T, Tk), True = attend. None means plain causal, which SDPA runs fastest.
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)  # (B, nh, max_len, hs): every slot
            mask = kv_cache.attn_mask  # (B, 1, T, max_len): which slots each query sees
        elif padding_mask is not None:
            # A padding query sees no real key before it, so it also sees itself (the diagonal) to keep
            # its softmax finite. Its output is garbage that nothing downstream reads.
            eye = torch.eye(T, dtype=torch.bool, device=x.device)
            mask = (padding_mask[:, None, None, :] & ~self.causal_mask[:T, :T]) | eye  # (B, T) -> (B, 1, T, T)
        if self.use_sdpa:  # what the config names runs, compiled or not (a device's faster path is a config's)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                               dropout_p=self.dropout if self.training else 0.0)
        else:  # softmax(q k^T / sqrt(hs)) v, spelled out
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_size))  # (B, nh, T, Tk)
            att = att.masked_fill(self.causal_mask[:T, :T] if mask is None else ~mask, float("-inf"))
            att = F.softmax(att.float(), dim=-1).type_as(q)
            if mask is not None:  # A row that hides every key has a NaN softmax; SDPA gives it 0, so do we.
                att = att.masked_fill(~mask.any(-1, keepdim=True), 0.0)
            att = self.attn_dropout(att)  # the weights pass here: model/trace.py reads them with a hook
            y = att @ v  # (B, nh, T, Tk) @ (B, nh, Tk, hs) -> (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, nh, T, hs) -> (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class Head(nn.Module):
    """One head: its own query, key and value projections, and its own triu mask when causal."""

    def __init__(self, query_size: int, key_size: int, value_size: int, head_size: int,
                 max_seq_len: int | None, dropout: float, bias: bool):
        super().__init__()
        self.query = nn.Linear(query_size, head_size, bias=bias)
        self.key = nn.Linear(key_size, head_size, bias=bias)
        self.value = nn.Linear(value_size, head_size, bias=bias)
        self.dropout = nn.Dropout(dropout)
        future = None if max_seq_len is None else torch.ones(max_seq_len, max_seq_len, dtype=torch.bool).triu(1)
        self.register_buffer("causal_mask", future, persistent=False)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                keep: torch.Tensor | None, fill: float = -1e9) -> torch.Tensor:
        """-> (B, Tq, hs). keep (bool, True = attend) broadcasts to (B, Tq, Tk); a hidden key scores fill."""
        q, k, v = self.query(query), self.key(key), self.value(value)  # (B, Tq, hs), 2 x (B, Tk, hs)
        att = q @ k.transpose(-2, -1) * q.size(-1) ** -0.5  # (B, Tq, hs) @ (B, hs, Tk) -> (B, Tq, Tk)
        if keep is not None:
            att = att.masked_fill(~keep, fill)
        if self.causal_mask is not None:  # -inf, and last: a row the mask hides entirely never sees the future
            att = att.masked_fill(self.causal_mask[: att.size(-2), : att.size(-1)], float("-inf"))
        att = self.dropout(F.softmax(att, dim=-1))
        return att @ v  # (B, Tq, Tk) @ (B, Tk, hs) -> (B, Tq, hs)


class MultiHeadAttention(nn.Module):
    """num_heads independent heads, concatenated and projected to emb_size. Queries, keys and values may each
    have their own width (default emb_size); causal=True gives each head a (max_seq_len, max_seq_len) triu mask."""

    def __init__(self, *, num_heads: int, emb_size: int, head_size: int, query_size: int | None = None,
                 key_size: int | None = None, value_size: int | None = None, causal: bool = False,
                 max_seq_len: int | None = None, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        if causal != (max_seq_len is not None):
            raise ValueError("causal=True needs max_seq_len (the size of each head's mask), and only it")
        sizes = (query_size or emb_size, key_size or emb_size, value_size or emb_size, head_size)
        self.heads = nn.ModuleList(Head(*sizes, max_seq_len, dropout, bias) for _ in range(num_heads))
        self.proj = nn.Linear(num_heads * head_size, emb_size, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, query: torch.Tensor, key: torch.Tensor | None = None, value: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, *, valid_lens: torch.Tensor | None = None) -> torch.Tensor:
        """query (B, Tq, query_size), key (B, Tk, key_size), value (B, Tk, value_size) -> (B, Tq, emb_size).
        key defaults to query and value to key. mask says which keys each query may see: bool (True = attend)
        or 0/1 float, shaped (Tq, Tk), (B, 1, 1, Tk) or (B, 1, Tq, Tk). valid_lens (B,) or (B, Tq) hides the keys
        at or past it. A hidden key scores the write-ups' -1e9 with a mask, d2l's -1e6 with valid_lens alone,
        not -inf, so a query that sees no key averages the values (a causal module's: those up to it)."""
        key = query if key is None else key
        value = key if value is None else value
        keep = None
        if mask is not None:
            # Both write-up signatures put a tensor fourth: refuse lengths here, not misread them.
            if mask.dim() not in (2, 4) or not (mask.dtype == torch.bool or mask.is_floating_point()):
                raise ValueError("mask is bool or 0/1 float, (Tq, Tk) or (B, 1, Tq|1, Tk); "
                                 "pass lengths as valid_lens=")
            keep = (mask if mask.dim() == 2 else mask.squeeze(1)) != 0  # (B, 1, Tq|1, Tk) -> (B, Tq|1, Tk)
        if valid_lens is not None:
            lens = valid_lens[:, None] if valid_lens.dim() == 1 else valid_lens  # (B,) -> (B, 1), all queries alike
            lens_keep = lengths_to_mask(lens, key.size(1))  # (B, Tq|1) -> (B, Tq|1, Tk)
            keep = lens_keep if keep is None else keep & lens_keep
        fill = -1e9 if mask is not None else -1e6
        # nh x (B, Tq, hs) -> (B, Tq, nh * hs)
        y = torch.cat([h(query, key, value, keep, fill) for h in self.heads], dim=-1)
        return self.dropout(self.proj(y))  # (B, Tq, nh * hs) -> (B, Tq, emb_size)

    @classmethod
    @torch.no_grad()
    def from_fused(cls, attn: CausalSelfAttention) -> "MultiHeadAttention":
        """The fused module's weights, head by head (no RoPE, no QK-norm): its test oracle."""
        bias, nh, hs = attn.c_attn.bias is not None, attn.n_head, attn.head_size
        ref = cls(num_heads=nh, emb_size=nh * hs, head_size=hs, causal=True,
                  max_seq_len=attn.causal_mask.size(0), dropout=attn.dropout, bias=bias)
        w = attn.c_attn.weight.view(3, nh, hs, -1)  # (3C, C) -> (q|k|v, nh, hs, C)
        b = attn.c_attn.bias.view(3, nh, hs) if bias else None  # (3C,) -> (q|k|v, nh, hs)
        for h, head in enumerate(ref.heads):
            for i, lin in enumerate((head.query, head.key, head.value)):
                lin.weight.copy_(w[i, h])
                if bias:
                    lin.bias.copy_(b[i, h])
        ref.proj.load_state_dict(attn.c_proj.state_dict())
        return ref
