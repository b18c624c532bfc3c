"""A printable walk of one forward pass: each module, the shape it returns, its parameters."""

from __future__ import annotations

import torch
import torch.nn as nn

from .gpt import GPT


def _shape(out) -> str:
    out = out[0] if isinstance(out, tuple) else out
    return str(tuple(out.shape)) if isinstance(out, torch.Tensor) else "-"


def shape_trace(model: GPT, batch_size: int = 1, seq_len: int | None = None, blocks_in_detail: int = 1) -> str:
    """Run one forward pass on zeros and return a table in execution order. The first
    `blocks_in_detail` blocks are shown module by module; later ones as one row each."""
    c = model.config
    T = seq_len or c.block_size
    rows: list[tuple[str, str, str, int]] = []
    hooks = []
    for name, module in model.named_modules():
        parts = name.split(".")
        inside_block = len(parts) > 3 and parts[1] == "h"
        if not name or name in ("transformer", "transformer.h") or isinstance(module, nn.Dropout):
            continue
        if inside_block and int(parts[2]) >= blocks_in_detail:
            continue
        own = sum(p.numel() for p in module.parameters(recurse=True))

        def hook(mod, inp, out, name=name, own=own):
            rows.append((name, type(mod).__name__, _shape(out), own))

        hooks.append(module.register_forward_hook(hook))
    idx = torch.zeros(batch_size, T, dtype=torch.long, device=next(model.parameters()).device)
    try:
        with torch.no_grad():
            logits, _ = model(idx)
    finally:
        for h in hooks:
            h.remove()
    hs = c.head_size
    lines = [
        f"GPT: {model.num_params():,} parameters, {c.n_layer} layers, {c.n_head} heads of size {hs}, "
        f"n_embd {c.n_embd}, vocab {c.vocab_size}, block {c.block_size}",
        f"input idx {(batch_size, T)} token ids",
        f"{'module':<34} {'type':<22} {'output shape':<22} {'params':>12}",
    ]
    for name, kind, shape, n in rows:
        depth = name.count(".") - 1
        lines.append(f"{'  ' * max(depth, 0) + name.removeprefix('transformer.'):<34} {kind:<22} {shape:<22} {n:>12,}")
        if name.endswith("attn.c_attn"):
            note = f"split q, k, v; heads (B, T, C) -> (B, nh, T, hs) = {(batch_size, c.n_head, T, hs)}"
            lines.append(f"{'  ' * (depth + 1)}{note}")
    lines.append(f"logits {tuple(logits.shape)}: one score per vocabulary entry at every position")
    return "\n".join(lines)
