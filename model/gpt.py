"""The GPT: token ids -> embeddings -> n_layer blocks -> final norm -> logits over the vocab.

Shapes through one forward pass (B batch, T time, C = n_embd, V = vocab_size):
    idx (B, T) -> wte (B, T, C) [+ wpe (1|B, T, C)] -> h[0..n_layer-1] (B, T, C)
    -> ln_f (B, T, C) -> lm_head (B, T, V)
`python -m model --config small` prints this walk for a real config."""

import math
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import CausalSelfAttention
from .layers import Rotary, make_norm

if TYPE_CHECKING:  # annotations only
    from configs.model import GPTConfig

    from .kv_cache import KVCache


class MLP(nn.Module):
    def __init__(self, config: "GPTConfig"):
        super().__init__()
        hidden = config.mlp_ratio * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)
        self.activation = config.activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)  # (B, T, C) -> (B, T, 4C)
        if self.activation == "relu2":
            h = F.relu(h).square()
        else:  # "gelu" is GPT-2's tanh form; the exact (erf) one is near-equal, with a faster CPU kernel
            h = F.gelu(h, approximate="tanh" if self.activation == "gelu" else "none")
        return self.dropout(self.c_proj(h))  # (B, T, 4C) -> (B, T, C)


class Block(nn.Module):
    def __init__(self, config: "GPTConfig", layer_idx: int = 0):
        super().__init__()
        self.ln_1 = make_norm(config, config.n_embd)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = make_norm(config, config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, **attn_kwargs) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), **attn_kwargs)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: "GPTConfig"):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList(Block(config, i) for i in range(config.n_layer)),
            ln_f=make_norm(config, config.n_embd),
        ))
        if config.pos_emb == "learned":
            self.transformer.wpe = nn.Embedding(config.block_size, config.n_embd)
        rope = config.pos_emb == "rope"
        self.rotary = Rotary(config.head_size, config.block_size, config.rope_base) if rope else None
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.transformer.wte.weight
        self.init_weights()

    def init_weights(self) -> None:
        """GPT-2's scheme: weights ~ N(0, 0.02), biases zero; the residual projections (c_proj) use
        0.02 / sqrt(2 * n_layer), so the residual's variance does not grow with depth."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = residual_std if name.endswith("c_proj") else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count (tied weights once); non_embedding leaves out position embeddings."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and self.config.pos_emb == "learned":
            n -= self.transformer.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token, the MFU convention (PaLM, appendix B): 6 per matmul weight (lm_head
        included, embedding lookups not) plus attention's 12 * n_layer * n_embd * seq_len."""
        T = seq_len or self.config.block_size
        matmul_params = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        return 6 * matmul_params + 12 * self.config.n_layer * self.config.n_embd * T

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *,
                padding_mask: torch.Tensor | None = None,
                kv_cache: "KVCache | None" = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx (B, T) token ids -> (logits (B, T, V), loss or None); targets of -1 are left out of the loss.
        padding_mask (B, T), True at real tokens, gives a left-padded row the logits of the row unpadded."""
        x = self.trunk(idx, padding_mask, kv_cache)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, C) -> (B, T, V)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)  # (B*T, V)

    def trunk(self, idx: torch.Tensor, padding_mask: torch.Tensor | None = None,
              kv_cache: "KVCache | None" = None, slots: torch.Tensor | None = None) -> torch.Tensor:
        """Everything before the final norm: (B, T) ids -> residual stream (B, T, C). With kv_cache the
        tokens go to its next slots, or to the slots (T,) that a compiled step claimed."""
        B, T = idx.size()
        if kv_cache is not None:  # the cache's attn_mask carries the padding from here on
            pos = kv_cache.begin(kv_cache.claim(T) if slots is None else slots, padding_mask)  # (B, T)
        elif T > self.config.block_size:
            raise ValueError(f"sequence of length {T} is longer than block_size {self.config.block_size}")
        elif padding_mask is None:
            pos = torch.arange(T, device=idx.device)[None, :]  # (1, T)
        else:  # a left-padded row starts counting at its first real token
            pos = (padding_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, T)

        x = self.transformer.wte(idx)  # (B, T) -> (B, T, C)
        if self.rotary is None:
            x = x + self.transformer.wpe(pos)  # (1|B, T) -> (1|B, T, C)
        rotary = self.rotary(pos) if self.rotary is not None else None
        x = self.transformer.drop(x)
        for block in self.transformer.h:
            x = block(x, padding_mask=padding_mask, rotary=rotary, kv_cache=kv_cache)
        return x
