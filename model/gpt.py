"""The GPT: token ids -> embeddings -> n_layer blocks -> final norm -> logits; and generate().

Shapes through a forward pass (B batch, T time, C = n_embd, nh heads of hs = C / nh, V = vocab):
    idx (B, T) -> wte (B, T, C) [+ wpe (T, C)] -> h[0..n_layer-1] (B, T, C) -> ln_f -> lm_head
    -> logits (B, T, V)
`python -m model --config small` prints this walk for a real config.
"""

import math
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

LOSS_CHUNK = 2**25  # logits the loss makes at once: 128 MiB in float32


@dataclass(frozen=True)
class GPTConfig:
    """The network's shape. The defaults are GPT-2 small's (124M parameters)."""

    vocab_size: int = 50257  # rows of the token embedding: GPT-2's BPE has 50257
    block_size: int = 1024  # the longest context, in tokens
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # in the Linear layers and LayerNorms, as GPT-2 has
    pos_emb: Literal["learned", "rope"] = "learned"  # GPT-2's position embedding, or rotary
    activation: Literal["gelu", "gelu_exact"] = "gelu"  # GPT-2's tanh GELU, or the exact one
    tie_weights: bool = True  # lm_head shares the token embedding's weight
    attention: Literal["sdpa", "explicit"] = "sdpa"  # a fused kernel, or softmax(QK^T)V spelled out


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding: turn each pair (x1[i], x2[i]) of a head's two halves by the angle of its
    position and frequency."""
    x1, x2 = x.chunk(2, dim=-1)  # (B, nh, T, hs) -> 2 x (B, nh, T, hs/2)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # under autocast x is bf16: stay there
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class CausalSelfAttention(nn.Module):
    """All heads at once: one Linear makes q, k and v for every head; a token sees only the past."""

    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.n_head, self.layer, self.dropout = config.n_head, layer, config.dropout
        self.explicit = config.attention == "explicit"
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        # True above the diagonal: the future. It follows from block_size, so it is not saved.
        future = torch.ones(config.block_size, config.block_size, dtype=torch.bool).triu(1)
        self.register_buffer("future", future, persistent=False)

    def forward(self, x, rope=None, kv_cache=None):
        """x (B, T, C) -> (B, T, C). rope is (cos, sin) at the tokens' positions; with kv_cache, the
        keys and values of earlier calls are seen too."""
        B, T, C = x.size()
        # (B, T, 3C) -> (B, T, 3, nh, hs) -> (3, B, nh, T, hs): q, k and v of every head
        qkv = self.c_attn(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        q, k, v = qkv
        if rope is not None:  # q and k turned together: half the calls, which decoding counts
            q, k = rotate(qkv[:2], *rope)
        if kv_cache is not None:  # (B, nh, T, hs) -> (B, nh, Tk, hs): the cached keys, then these
            k, v = kv_cache.update(self.layer, k, v)
        # One new token sees every key before it; several see each other causally, and the keys
        # cached before them: is_causal would hide those, as it aligns its mask with the first key.
        Tk, mask, causal = k.size(2), None, T > 1  # mask: which keys each query sees, (T, Tk)
        if causal and Tk > T:
            mask, causal = ~self.future[Tk - T : Tk, :Tk], False
        if self.explicit and T > 1:  # one query (decoding) is one call in SDPA, six spelled out
            # (B, nh, T, hs) @ (B, nh, hs, Tk) -> (B, nh, T, Tk)
            att = q @ k.transpose(-2, -1) / math.sqrt(k.size(-1))
            att = att.masked_fill(self.future[Tk - T : Tk, :Tk], float("-inf"))  # the future
            att = self.attn_dropout(F.softmax(att.float(), dim=-1).type_as(q))
            y = att @ v  # (B, nh, T, Tk) @ (B, nh, Tk, hs) -> (B, nh, T, hs)
        else:
            p = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, mask, p, is_causal=causal)
        # (B, nh, T, hs) -> (B, T, C): the heads' outputs side by side
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)
        self.approximate = "tanh" if config.activation == "gelu" else "none"

    def forward(self, x):
        h = F.gelu(self.c_fc(x), approximate=self.approximate)  # (B, T, C) -> (B, T, 4C)
        return self.dropout(self.c_proj(h))  # (B, T, 4C) -> (B, T, C)


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, layer)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, rope=None, kv_cache=None):
        x = x + self.attn(self.ln_1(x), rope, kv_cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList(Block(config, i) for i in range(config.n_layer)),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        if config.pos_emb == "learned":
            self.transformer.wpe = nn.Embedding(config.block_size, config.n_embd)
        else:  # the rotary angles of every position and frequency, (T, hs/2): derived, so not saved
            hs = config.n_embd // config.n_head
            inv_freq = 10000.0 ** (-torch.arange(0, hs, 2, dtype=torch.float32) / hs)
            angles = torch.outer(torch.arange(config.block_size, dtype=torch.float32), inv_freq)
            self.register_buffer("cos", angles.cos(), persistent=False)
            self.register_buffer("sin", angles.sin(), persistent=False)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.transformer.wte.weight
        self.init_weights()

    def init_weights(self) -> None:
        """GPT-2's scheme: weights ~ N(0, 0.02), biases 0. The projections back into the residual
        stream (c_proj) get 0.02 / sqrt(2 * n_layer), so that its variance does not grow with
        depth."""
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = 0.02 / math.sqrt(2 * self.config.n_layer) if name.endswith("c_proj") else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def crop(self, block_size: int) -> None:
        """Shorten the context to block_size, for a run with shorter windows than its weights': the
        position embedding's rows, the masks and the rotary angles past it go."""
        self.config = replace(self.config, block_size=block_size)
        for block in self.transformer.h:
            block.attn.future = block.attn.future[:block_size, :block_size]
        if self.config.pos_emb == "learned":
            self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size])
        else:
            self.cos, self.sin = self.cos[:block_size], self.sin[:block_size]

    def num_params(self) -> int:
        """Parameters, a tied weight counted once."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx, targets=None, kv_cache=None):
        """idx (B, T) token ids -> (logits (B, T, V), None); with targets (B, T), (None, their mean
        loss), a target of -1 left out. With kv_cache, the tokens follow those of earlier calls."""
        T = idx.size(1)
        start = kv_cache.pos if kv_cache is not None else 0
        if start + T > self.config.block_size:
            raise ValueError(
                f"{start + T} positions, more than block_size {self.config.block_size}"
            )
        pos = torch.arange(start, start + T, device=idx.device)  # (T,)
        x = self.transformer.wte(idx)  # (B, T) -> (B, T, C)
        rope = None
        if self.config.pos_emb == "learned":
            x = x + self.transformer.wpe(pos)  # (T,) -> (T, C), added to every row
        else:  # (T,) -> (1, T, hs/2): the same angles for every head
            rope = self.cos[pos].unsqueeze(-3), self.sin[pos].unsqueeze(-3)
        x = self.transformer.drop(x)
        for block in self.transformer.h:
            x = block(x, rope, kv_cache)
        if kv_cache is not None:
            kv_cache.pos += T
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x), None  # (B, T, C) -> (B, T, V)
        # The loss a chunk of rows at a time, each chunk's logits made again in backward: a step
        # never holds the (B, T, V) logits, which at GPT-2's vocabulary outweigh a small model.
        rows = max(1, LOSS_CHUNK // self.config.vocab_size)
        chunks = zip(x.flatten(0, 1).split(rows), targets.flatten().split(rows))  # (B*T, C), (B*T,)
        total = sum(checkpoint(self.summed_loss, h, t, use_reentrant=False) for h, t in chunks)
        return None, total / (targets != -1).sum()

    def summed_loss(self, x, targets):
        """The cross-entropy of rows x (N, C) against targets (N,), summed; a target of -1 is left
        out."""
        logits = self.lm_head(x).float()  # (N, C) -> (N, V), in float32: a stable log-softmax
        return F.cross_entropy(logits, targets, ignore_index=-1, reduction="sum")


class KVCache:
    """Every layer's keys and values, for up to block_size positions; `pos` counts the filled."""

    def __init__(self, config: GPTConfig, batch_size: int, device, dtype):
        hs = config.n_embd // config.n_head
        shape = (config.n_layer, batch_size, config.n_head, config.block_size, hs)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.pos = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store k, v (B, nh, T, hs) after the filled positions; return all those filled since 0."""
        end = self.pos + k.size(2)
        self.k[layer, :, :, self.pos : end] = k
        self.v[layer, :, :, self.pos : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]  # (B, nh, end, hs)


def sample_next(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """(B, V) logits -> (B,) token ids: the likeliest at temperature 0, else a draw from the softmax
    of logits / temperature, among the top_k likeliest and the fewest whose probabilities reach
    top_p."""
    if temperature == 0:
        return logits.argmax(-1)
    # From the top logit down, and never over 0: a tiny temperature sends the rest to -inf, not nan.
    logits = logits.float()
    tiny = torch.finfo(torch.float32).tiny
    logits = (logits - logits.amax(-1, keepdim=True)) / max(temperature, tiny)
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k).values[:, [-1]]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p  # the likelier tokens already reach top_p
        drop[:, 0] = False  # the likeliest always stays
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


@torch.no_grad()
def generate(
    model,
    idx,
    max_new_tokens,
    temperature=1.0,
    top_k=None,
    top_p=None,
    generator=None,
    vocab_size=None,
):
    """Yield (B,) new token ids, a step at a time, after the prompts idx (B, T), with a KV cache.
    Logits past vocab_size (a padded embedding's) are never drawn. Once the context fills
    block_size, the cache starts again from its last half. Call it with the model in eval mode."""
    block = model.config.block_size
    cache = KVCache(model.config, idx.size(0), idx.device, model.lm_head.weight.dtype)
    context = x = idx[:, -block:]  # (B, <= block): all the model can see
    for _ in range(max_new_tokens):
        if cache.pos + x.size(1) > block:  # full: decode on from the last half, as from a prompt
            cache.pos, x = 0, context[:, -max(1, block // 2) :]
        logits, _ = model(x, kv_cache=cache)
        # (B, T, V) -> (B, vocab_size): the last position's logits, the padding's left out
        tok = sample_next(logits[:, -1, :vocab_size], temperature, top_k, top_p, generator)
        yield tok
        x = tok[:, None]  # (B,) -> (B, 1)
        context = torch.cat((context, x), dim=1)[:, -block:]
