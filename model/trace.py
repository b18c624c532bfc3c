"""Forward hooks that look inside a model: the shape walk, hidden states, attention weights."""

from collections.abc import Callable, Iterable
from contextlib import ExitStack
from typing import Any

import torch
import torch.nn as nn

from .attention import CausalSelfAttention
from .gpt import GPT


def hooked(modules: Iterable[nn.Module], hook: Callable[..., Any]) -> ExitStack:
    """hook(module, inputs, output) runs after each module's forward inside the with-block."""
    stack = ExitStack()  # each hook's handle is a context manager that removes it
    for m in modules:
        stack.enter_context(m.register_forward_hook(hook))
    return stack


@torch.no_grad()
def hidden_states(model: GPT, idx: torch.Tensor, **kwargs) -> torch.Tensor:
    """(n_layer + 1, B, T, C) for idx (B, T): the embeddings (after dropout), then each block's output."""
    states = []
    with hooked([model.transformer.drop, *model.transformer.h], lambda mod, inp, out: states.append(out)):
        model(idx, **kwargs)
    return torch.stack(states)


@torch.no_grad()
def attention_weights(module: nn.Module, *args, **kwargs) -> tuple[Any, list[torch.Tensor]]:
    """module(*args, **kwargs), and each CausalSelfAttention's weights (B, nh, T, Tk) in call order. SDPA
    never forms them, so for this call every attention takes the explicit path."""
    attns = [m for m in module.modules() if isinstance(m, CausalSelfAttention)]
    weights, sdpa = [], [a.use_sdpa for a in attns]
    try:
        for a in attns:
            a.use_sdpa = False
        with hooked([a.attn_dropout for a in attns], lambda mod, inp, out: weights.append(inp[0])):
            return module(*args, **kwargs), weights
    finally:
        for a, flag in zip(attns, sdpa):
            a.use_sdpa = flag


def shape_trace(model: GPT, batch_size: int = 1, seq_len: int | None = None, blocks_in_detail: int = 1) -> str:
    """A table of one forward pass on zeros, in execution order; blocks past `blocks_in_detail` get a row each."""
    c = model.config
    T = seq_len or c.block_size
    lines = [f"GPT: {model.num_params():,} parameters, {c.n_layer} layers, {c.n_head} heads of size {c.head_size}, "
             f"n_embd {c.n_embd}, vocab {c.vocab_size}, block {c.block_size}",
             f"input idx {(batch_size, T)} token ids",
             f"{'module':<34} {'type':<22} {'output shape':<22} {'params':>12}"]
    names = {}
    for name, module in model.named_modules():
        parts = name.split(".")
        later = len(parts) > 3 and parts[1] == "h" and int(parts[2]) >= blocks_in_detail  # inside a later block
        if name and not isinstance(module, nn.Dropout) and not later:  # (containers have no forward: no rows)
            names[module] = name

    def row(mod, inp, out):  # one line per module, in the order they run
        out = out[0] if isinstance(out, tuple) else out  # Rotary returns (cos, sin)
        name, shape, n = names[mod], str(tuple(out.shape)), sum(p.numel() for p in mod.parameters())
        indent = "  " * max(name.count(".") - 1, 0)
        lines.append(f"{indent + name.removeprefix('transformer.'):<34} {type(mod).__name__:<22} {shape:<22} {n:>12,}")
        if name.endswith("attn.c_attn"):
            heads = (batch_size, c.n_head, T, c.head_size)
            lines.append(f"{indent}  split q, k, v; heads (B, T, C) -> (B, nh, T, hs) = {heads}")

    idx = torch.zeros(batch_size, T, dtype=torch.long, device=next(model.parameters()).device)
    with hooked(names, row), torch.no_grad():
        logits, _ = model(idx)
    lines.append(f"logits {tuple(logits.shape)}: one score per vocabulary entry at every position")
    return "\n".join(lines)

