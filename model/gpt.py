"""The GPT: token ids -> embeddings -> n_layer blocks -> final norm -> logits over the vocab.

Shapes through one forward pass (B batch, T time, C = n_embd, V = vocab_size):
    idx (B, T) -> wte (B, T, C) [+ wpe (1|B, T, C)] -> h[0..n_layer-1] (B, T, C)
    -> ln_f (B, T, C) -> lm_head (B, T, V)
`python -m model --config small` prints this walk for a real config.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from functools import cache

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
        self.activation = config.activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)  # (B, T, C) -> (B, T, 4C)
        if self.activation == "relu2":
            h = F.relu(h).square()
        else:  # torch's CPU kernels for the tanh form run 2-5x slower than for the exact one
            h = F.gelu(h, approximate="tanh" if self.activation == "gelu" else "none")
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
        slots: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """Everything before the final norm: (B, T) ids -> residual stream (B, T, C), plus the
        per-layer hidden states and attention weights when asked (else empty lists).
        With kv_cache the tokens go to the cache's next slots, or to `slots` (T,) when the
        caller claimed them (a compiled decode step reads no Python int that changes)."""
        B, T = idx.size()
        if valid_lens is not None:
            padding_mask = lengths_to_mask(valid_lens, T)
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
        hidden, attentions = [x], []
        for block in self.transformer.h:
            x = block(x, padding_mask=padding_mask, rotary=rotary, kv_cache=kv_cache, return_attention=return_attention)
            if return_attention:
                x, att = x
                attentions.append(att)
            if output_hidden_states:
                hidden.append(x)
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
        compile: bool = False,
    ) -> Iterator[torch.Tensor]:
        """Yield (B,) new token ids, one step at a time, for streaming.

        idx (B, T) prompts, left-padded where padding_mask (B, T) is False. With the KV cache
        each step feeds one token; when a row's context fills block_size its cache is rebuilt
        from its last block_size // 2 tokens (re-prefill, row by row, so a batch decodes exactly
        like its rows one at a time), so decoding never stops for length.
        use_cache=False recomputes the last block_size tokens every step (the reference).
        compile=True runs DECODE_CHUNK one-token steps per torch.compile'd call (the same code,
        unrolled: the cache is static, so it traces once per model, batch size and cache length,
        a multiple of block_size / 8, eager past dynamo's 8 graphs a process; worth it for small models,
        whose eager steps are mostly per-op overhead).
        Rows that produced eos_id keep yielding eos_id; the iterator ends when all have.
        temperature 0 means greedy. The model is put in eval mode while generating.
        """
        was_training = self.training
        self.eval()
        try:
            yield from self._generate(idx, max_new_tokens, temperature, top_k, top_p, eos_id, padding_mask,
                                      generator, use_cache, compile)
        finally:
            self.train(was_training)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """The next-token logits from the last position: (B, T, C) -> (B, V)."""
        return self.lm_head(self.transformer.ln_f(x[:, -1]))

    def _decode_steps(self, idx: torch.Tensor, slots: torch.Tensor, cache: KVCache, noise: torch.Tensor | None,
                      sampling: tuple) -> torch.Tensor:
        """(B, 1) tokens, then one step per cache slot in slots (K,) the caller claimed, each feeding
        the token the step before drew (with sample_next(*sampling), noise[i] of (K, B, V)) -> (K, B).
        Compiled, the loop is unrolled: one call decodes K tokens for one call's overhead."""
        toks = []
        for i in range(slots.size(0)):
            x = self.trunk(idx, kv_cache=cache, slots=slots[i : i + 1])[0]
            toks.append(sample_next(self._head(x), *sampling, noise=None if noise is None else noise[i]))
            idx = toks[-1][:, None]
        return torch.stack(toks)

    def _generate(self, idx, max_new_tokens, temperature, top_k, top_p, eos_id, padding_mask, generator, use_cache,
                  compile):
        block_size, B, V = self.config.block_size, idx.size(0), self.config.vocab_size
        mask = padding_mask if padding_mask is not None and not bool(padding_mask.all()) else None
        done = torch.zeros(B, dtype=torch.bool, device=idx.device)
        cache, next_input, window, checked, n = None, None, slice(-block_size, None), False, 0
        sampling, chunk = (temperature, top_k, top_p), DECODE_CHUNK if compile else 1

        def draw(k: int) -> torch.Tensor | None:  # (k, B, V) noise for k steps, drawn here, from the caller's
            # generator, one step at a time, so every path (eager, compiled, uncached) samples alike
            return None if temperature == 0 else torch.stack(
                [torch.empty(B, V, device=idx.device).exponential_(generator=generator) for _ in range(k)])

        def first(x: torch.Tensor) -> torch.Tensor:  # the prefill's or a recompute's (B, T, C) -> (1, B) tokens
            noise = draw(1)
            return sample_next(self._head(x), *sampling, noise=None if noise is None else noise[0])[None]

        while n < max_new_tokens:
            if not use_cache:
                x, _, _ = self.trunk(idx[:, window], None if mask is None else mask[:, window])
                toks = first(x)
            elif cache is None:  # the prefill fills the prompt's slots, each later step one more
                cache = KVCache(self.config, B, cache_slots(block_size, idx[:, window].size(1) + max_new_tokens - 1,
                                                            compile), idx.device, self.transformer.wte.weight.dtype)
                x, _, _ = self.trunk(idx[:, window], None if mask is None else mask[:, window], kv_cache=cache)
                toks = first(x)
                # real tokens per row in the cache; they always fill the cache's last lens[b] slots
                lens = mask[:, window].sum(1).tolist() if mask is not None else [cache.pos] * B
            else:
                cache.slide(lens, idx, self.trunk, room=chunk)
                # compiled: `chunk` tokens a call while no slide falls inside them, else eager steps
                K = chunk if min(cache.max_len - cache.pos, block_size - max(lens), max_new_tokens - n) >= chunk else 1
                step = compiled_decode_steps() if K > 1 else GPT._decode_steps
                slots, noise = cache.claim(K), draw(K)
                # Once a compiled step has run, nothing its guards check changes within this
                # generate(): skip them (they cost as much as a small model's arithmetic).
                try:
                    with torch.compiler.set_stance(skip_guard_eval_unsafe=True) if checked and K > 1 else nullcontext():
                        toks = step(self, next_input, slots, cache, noise, sampling)  # (K, B)
                except torch._dynamo.exc.FailOnRecompileLimitHit:  # a 9th shape in this process: eager from here
                    toks, chunk = GPT._decode_steps(self, next_input, slots, cache, noise, sampling), 1
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


# Tokens per compiled call: 4 amortises the call's overhead (~0.4 ms) over 4 steps of the small
# model (~0.3 ms of arithmetic each), and compiles in about twice one step's time. bench.py sample.
DECODE_CHUNK = 4


def cache_slots(block_size: int, needed: int, compile: bool) -> int:
    """KV cache slots for a prompt plus new tokens needing `needed`, at most block_size (past it
    the cache slides). Compiled, rounded up to a multiple of block_size / 8: each size is its own
    graph, so at most 8 serve every length, while attention (which reads every slot) reads few
    more than the run needs (GPT-2's 1024 slots for a 263-token run made its step no faster than
    eager; 512 slots decoded int8 GPT-2 at 2.08x transformers, 263 at 2.35x)."""
    step = max(1, block_size // 8)
    return min(block_size, -(-needed // step) * step if compile else needed)


@cache
def compiled_decode_steps() -> Callable[..., torch.Tensor]:
    """GPT._decode_steps through torch.compile, made once per process; every model shares it
    (parameters are graph inputs, so models of one shape share a graph too).
    decompose_mm_pass: one-row matmuls become loops inductor fuses with their neighbours,
    instead of a library call each. size_asserts off: the step's shapes are fixed, and
    checking ~60 of them per call cost more than a small model's arithmetic."""
    options = {"post_grad_fusion_options": {"decompose_mm_pass": {}}, "size_asserts": False}
    return torch.compile(GPT._decode_steps, fullgraph=True, dynamic=False, options=options)


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """(B, V) logits -> (B,) token ids. temperature 0 is greedy; top_k keeps the k likeliest,
    top_p the smallest set whose probability reaches p (nucleus). noise: (B, V) Exp(1) draws
    to sample with (default: drawn from generator)."""
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
    # A draw from probs: the index of the smallest of independent Exp(1) / p_i (an exponential
    # race; each Exp(1) / p_i is exponential with rate p_i). Exact, like torch.multinomial,
    # and half its cost per step, which checks its input with an extra pass.
    probs = logits.softmax(dim=-1)
    if noise is None:
        noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)
