"""The GPT: token ids -> embeddings -> n_layer blocks -> final norm -> logits over the vocab.

Shapes through one forward pass (B batch, T time, C = n_embd, V = vocab_size):
    idx (B, T) -> wte (B, T, C) [+ wpe (1|B, T, C)] -> h[0..n_layer-1] (B, T, C)
    -> ln_f (B, T, C) -> lm_head (B, T, V)
`python -m model --config small` prints this walk for a real config.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import CausalSelfAttention, lengths_to_mask
from .config import GPTConfig
from .kv_cache import KVCache
from .layers import RMSNorm, Rotary, make_norm


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        hidden = config.mlp_ratio * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)
        self.relu2 = config.activation == "relu2"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)  # (B, T, C) -> (B, T, 4C)
        h = F.relu(h).square() if self.relu2 else F.gelu(h, approximate="tanh")
        return self.dropout(self.c_proj(h))  # (B, T, 4C) -> (B, T, C)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: GPTConfig, layer_idx: int = 0):
        super().__init__()
        self.ln_1 = make_norm(config, config.n_embd)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = make_norm(config, config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, return_attention: bool = False, **attn_kwargs):
        a = self.attn(self.ln_1(x), return_attention=return_attention, **attn_kwargs)
        a, att = a if return_attention else (a, None)
        x = x + a
        x = x + self.mlp(self.ln_2(x))
        return (x, att) if return_attention else x


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList(Block(config, i) for i in range(config.n_layer)),
                ln_f=make_norm(config, config.n_embd),
            )
        )
        if config.pos_emb == "learned":
            self.transformer.wpe = nn.Embedding(config.block_size, config.n_embd)
            self.rotary = None
        else:
            self.rotary = Rotary(config.head_size, config.block_size, config.rope_base)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.transformer.wte.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2's scheme: every Linear and Embedding weight ~ N(0, 0.02), biases zero, norms one;
        the projections that write into the residual stream (attn.c_proj, mlp.c_proj) use
        0.02 / sqrt(2 * n_layer), so the residual's variance does not grow with depth."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = residual_std if name.endswith("c_proj") else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, (nn.LayerNorm, RMSNorm)):
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count (tied weights once); non_embedding leaves out position embeddings."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and self.config.pos_emb == "learned":
            n -= self.transformer.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward = 3x forward): 6 per weight of every
        matmul (the lm_head included, the embedding lookups not) plus attention's
        12 * n_layer * n_embd * seq_len, the usual convention for MFU (PaLM, appendix B)."""
        T = seq_len or self.config.block_size
        matmul_params = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        return 6 * matmul_params + 12 * self.config.n_layer * self.config.n_embd * T

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        padding_mask: torch.Tensor | None = None,
        valid_lens: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        output_hidden_states: bool = False,
        return_attention: bool = False,
    ):
        """idx (B, T) token ids -> (logits (B, T, V), loss or None).

        targets (B, T): next-token ids; positions holding -1 (padding) are left out of the loss.
        padding_mask (B, T) bool, True = real token, or valid_lens (B,) for right padding:
        padding never serves as a key, and positions count real tokens only, so a
        left-padded row gives the same logits as the same row unpadded.
        output_hidden_states adds (n_layer + 1, B, T, C): the embeddings, then each block's output.
        return_attention adds a list of per-layer weights (B, nh, T, Tk) (explicit path).
        """
        x, hidden, attentions = self.trunk(idx, padding_mask, valid_lens, kv_cache, output_hidden_states, return_attention)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, C) -> (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)
        out = (logits, loss)
        if output_hidden_states:
            out += (torch.stack(hidden),)
        if return_attention:
            out += (attentions,)
        return out

    def trunk(
        self,
        idx: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
        valid_lens: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        output_hidden_states: bool = False,
        return_attention: bool = False,
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """Everything before the final norm: (B, T) ids -> residual stream (B, T, C), plus the
        per-layer hidden states and attention weights when asked (else empty lists)."""
        B, T = idx.size()
        offset = kv_cache.pos if kv_cache is not None else 0
        if offset + T > self.config.block_size:
            raise ValueError(f"sequence of length {offset + T} is longer than block_size {self.config.block_size}")
        if valid_lens is not None:
            padding_mask = lengths_to_mask(valid_lens, T)
        key_mask = kv_cache.extend_mask(padding_mask, T) if kv_cache is not None else padding_mask
        if key_mask is None:
            pos = torch.arange(offset, offset + T, device=idx.device)[None, :]  # (1, T)
        else:  # a left-padded row starts counting at its first real token
            pos = (key_mask.long().cumsum(-1) - 1).clamp(min=0)[:, offset:]  # (B, T)

        x = self.transformer.wte(idx)  # (B, T) -> (B, T, C)
        if self.rotary is None:
            x = x + self.transformer.wpe(pos)  # (1|B, T) -> (1|B, T, C)
        rotary = self.rotary(pos) if self.rotary is not None else None
        x = self.transformer.drop(x)
        hidden, attentions = [x], []
        for block in self.transformer.h:
            x = block(x, padding_mask=key_mask, rotary=rotary, kv_cache=kv_cache, return_attention=return_attention)
            if return_attention:
                x, att = x
                attentions.append(att)
            if output_hidden_states:
                hidden.append(x)
        if kv_cache is not None:
            kv_cache.pos += T
        return x, hidden, attentions

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_id: int | None = None,
        padding_mask: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
    ) -> Iterator[torch.Tensor]:
        """Yield (B,) new token ids, one step at a time, for streaming.

        idx (B, T) prompts, left-padded where padding_mask (B, T) is False. With the KV cache
        each step feeds one token; when a row's context fills block_size its cache is rebuilt
        from its last block_size // 2 tokens (re-prefill, row by row, so a batch decodes exactly
        like its rows one at a time), so decoding never stops for length.
        use_cache=False recomputes the last block_size tokens every step (the reference).
        Rows that produced eos_id keep yielding eos_id; the iterator ends when all have.
        temperature 0 means greedy. The model is put in eval mode while generating.
        """
        was_training = self.training
        self.eval()
        try:
            yield from self._generate(idx, max_new_tokens, temperature, top_k, top_p, eos_id, padding_mask, generator, use_cache)
        finally:
            self.train(was_training)

    def _generate(self, idx, max_new_tokens, temperature, top_k, top_p, eos_id, padding_mask, generator, use_cache):
        block_size = self.config.block_size
        B = idx.size(0)
        mask = padding_mask if padding_mask is not None and not bool(padding_mask.all()) else None
        done = torch.zeros(B, dtype=torch.bool, device=idx.device)
        cache, next_input = None, None
        for _ in range(max_new_tokens):
            if not use_cache:
                window = slice(-block_size, None)
                x, _, _ = self.trunk(idx[:, window], None if mask is None else mask[:, window])
            elif cache is None:
                cache = KVCache(self.config, B, block_size, idx.device, self.transformer.wte.weight.dtype)
                window = slice(-block_size, None)
                x, _, _ = self.trunk(idx[:, window], None if mask is None else mask[:, window], kv_cache=cache)
                # real tokens per row in the cache; they always fill the cache's last lens[b] slots
                lens = mask[:, window].sum(1).tolist() if mask is not None else [cache.pos] * B
            else:
                cache.slide(lens, idx, self.trunk)
                x, _, _ = self.trunk(next_input, kv_cache=cache)
                lens = [n + 1 for n in lens]
            logits = self.lm_head(self.transformer.ln_f(x[:, -1]))  # (B, C) -> (B, V)
            tok = sample_next(logits, temperature, top_k, top_p, generator)  # (B,)
            if eos_id is not None:
                tok = torch.where(done, torch.full_like(tok, eos_id), tok)
                done |= tok == eos_id
            yield tok
            next_input = tok[:, None]
            idx = torch.cat([idx[:, -block_size:], next_input], dim=1)  # no step reads further back
            if mask is not None:
                mask = torch.cat([mask[:, -block_size:], torch.ones_like(next_input, dtype=torch.bool)], dim=1)
            if eos_id is not None and bool(done.all()):
                return

def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """(B, V) logits -> (B,) token ids. temperature 0 is greedy; top_k keeps the k likeliest,
    top_p the smallest set whose probability reaches p (nucleus)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens before it already reach top_p; the first always stays.
        drop_sorted = (cum - sorted_logits.softmax(dim=-1)) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
