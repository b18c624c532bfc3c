"""Multi-head attention as the write-ups build it: a ModuleList of heads, concatenated, projected.

It is for reading, and it is the oracle that the GPT's fused attention is tested against
(`from_fused`). Each head has its own query, key and value projections and, when causal, its own
triu mask buffer; keys and values may come from another source than the queries (cross-attention),
and each may have a width of its own.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Head(nn.Module):
    def __init__(self, query_size, key_size, value_size, head_size, max_seq_len, dropout, bias):
        super().__init__()
        self.query = nn.Linear(query_size, head_size, bias=bias)
        self.key = nn.Linear(key_size, head_size, bias=bias)
        self.value = nn.Linear(value_size, head_size, bias=bias)
        self.dropout = nn.Dropout(dropout)
        future = None
        if max_seq_len is not None:  # True above the diagonal: each query's future
            future = torch.ones(max_seq_len, max_seq_len, dtype=torch.bool).triu(1)
        self.register_buffer("future", future, persistent=False)

    def forward(self, query, key, value, keep=None, fill=-1e9):
        """-> (B, Tq, hs). keep (True: attend) broadcasts to (B, Tq, Tk); hidden keys score fill."""
        q, k, v = self.query(query), self.key(key), self.value(value)  # (B, Tq|Tk|Tk, hs)
        att = q @ k.transpose(-2, -1) * q.size(-1) ** -0.5  # (B, Tq, Tk)
        if keep is not None:
            att = att.masked_fill(~keep, fill)
        if self.future is not None:  # -inf, and last: a row hidden whole never sees the future
            att = att.masked_fill(self.future[: att.size(-2), : att.size(-1)], float("-inf"))
        return self.dropout(F.softmax(att, dim=-1)) @ v  # (B, Tq, Tk) @ (B, Tk, hs) -> (B, Tq, hs)


class MultiHeadAttention(nn.Module):
    """num_heads heads of head_size, concatenated and projected to emb_size. causal=True gives each
    head a (max_seq_len, max_seq_len) triu mask; query_size, key_size and value_size default to
    emb_size."""

    def __init__(
        self,
        *,
        num_heads,
        emb_size,
        head_size,
        query_size=None,
        key_size=None,
        value_size=None,
        causal=False,
        max_seq_len=None,
        dropout=0.0,
        bias=True,
    ):
        super().__init__()
        if causal != (max_seq_len is not None):
            raise ValueError("causal=True needs max_seq_len, each head's mask size, and only it")
        sizes = (query_size or emb_size, key_size or emb_size, value_size or emb_size, head_size)
        self.heads = nn.ModuleList(
            Head(*sizes, max_seq_len, dropout, bias) for _ in range(num_heads)
        )
        self.proj = nn.Linear(num_heads * head_size, emb_size, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, query, key=None, value=None, mask=None, *, valid_lens=None):
        """query (B, Tq, query_size), key (B, Tk, key_size), value (B, Tk, value_size) -> (B, Tq,
        emb_size); key defaults to query, and value to key. mask says which keys each query sees:
        bool (True: attend) or 0/1 float, (Tq, Tk), (B, 1, 1, Tk) or (B, 1, Tq, Tk). valid_lens (B,)
        or (B, Tq) hides the keys at or past each length. A hidden key scores -1e9 with a mask and
        -1e6 with valid_lens alone, as the write-ups fill them, so that a query that sees no key
        averages the values (a causal one, those up to it)."""
        key = query if key is None else key
        value = key if value is None else value
        keep = None
        if mask is not None:
            if mask.dim() not in (2, 4) or not (
                mask.dtype == torch.bool or mask.is_floating_point()
            ):
                raise ValueError("mask: bool or 0/1 float, (Tq, Tk) or (B, 1, Tq|1, Tk)")
            # (Tq, Tk) or (B, 1, Tq|1, Tk) -> (Tq, Tk) or (B, Tq|1, Tk)
            keep = (mask if mask.dim() == 2 else mask.squeeze(1)) != 0
        if valid_lens is not None:
            lens = valid_lens[:, None] if valid_lens.dim() == 1 else valid_lens  # (B,) -> (B, 1)
            below = torch.arange(key.size(1), device=lens.device) < lens[..., None]  # (B, Tq|1, Tk)
            keep = below if keep is None else keep & below
        fill = -1e9 if mask is not None else -1e6
        # nh x (B, Tq, hs) -> (B, Tq, nh * hs) -> (B, Tq, emb_size)
        y = torch.cat([head(query, key, value, keep, fill) for head in self.heads], dim=-1)
        return self.dropout(self.proj(y))

    @classmethod
    @torch.no_grad()
    def from_fused(cls, attn) -> "MultiHeadAttention":
        """A GPT's CausalSelfAttention as heads of their own, with its weights: its test oracle."""
        C, nh, bias = attn.c_proj.weight.size(0), attn.n_head, attn.c_attn.bias is not None
        ref = cls(
            num_heads=nh,
            emb_size=C,
            head_size=C // nh,
            causal=True,
            bias=bias,
            max_seq_len=attn.future.size(0),
            dropout=attn.dropout,
        )
        w = attn.c_attn.weight.view(3, nh, C // nh, C)  # (3C, C) -> (q|k|v, nh, hs, C)
        b = attn.c_attn.bias.view(3, nh, C // nh) if bias else None  # (3C,) -> (q|k|v, nh, hs)
        for h, head in enumerate(ref.heads):
            for i, linear in enumerate((head.query, head.key, head.value)):
                linear.weight.copy_(w[i, h])
                if bias:
                    linear.bias.copy_(b[i, h])
        ref.proj.load_state_dict(attn.c_proj.state_dict())
        return ref
