"""Views inside a model: a printable walk of one forward pass (each module, the shape it returns,
its parameters; `python -m model`), and the prompt's attention maps (`sample.py --show-attention`)."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn as nn

from errors import UserError

from .gpt import GPT


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
        if not name or isinstance(module, nn.Dropout):  # (containers have no forward: no rows)
            continue
        if inside_block and int(parts[2]) >= blocks_in_detail:
            continue
        own = sum(p.numel() for p in module.parameters(recurse=True))

        def hook(mod, inp, out, name=name, own=own):
            out = out[0] if isinstance(out, tuple) else out  # Rotary returns (cos, sin)
            rows.append((name, type(mod).__name__, str(tuple(out.shape)), own))

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


def token_label(tok, token_id: int) -> str:
    text = tok.decode([token_id])
    return text.replace("\n", "\\n").replace("\t", "\\t").replace(" ", "\u2423")


@torch.no_grad()
def plot_attention(model, tok, ids: list[int], path: str, layer: int) -> Path:
    """One heat map per head of `layer` (query rows, key columns) for the prompt, as a PNG."""
    n_layer = model.config.n_layer
    if not -n_layer <= layer < n_layer:
        raise UserError(f"--layer {layer} is out of range: the model has layers 0..{n_layer - 1}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import PowerNorm
    except ImportError:
        raise UserError("--show-attention needs matplotlib: pip install matplotlib") from None
    layer %= n_layer
    ids = ids[-model.config.block_size :]
    x = torch.tensor([ids], device=next(model.parameters()).device)
    _, _, att = model(x, return_attention=True)
    att = att[layer][0].float().cpu()  # (nh, T, T)
    nh, T = att.shape[0], att.shape[-1]
    ncols = math.ceil(math.sqrt(nh))  # a near-square grid of heads
    nrows = math.ceil(nh / ncols)
    labels = [token_label(tok, i) for i in ids] if T <= 48 else None
    size = 3.5 if labels is None else min(9.0, max(3.5, 0.15 * T + 1.0))  # inches per head
    fig, axes = plt.subplots(nrows, ncols, figsize=(ncols * size + 1.0, nrows * size + 0.6),
                             squeeze=False, layout="constrained")
    image = None
    for h, ax in enumerate(axes.flat):
        if h >= nh:
            ax.axis("off")
            continue
        # sqrt colour scale: weights spread over many keys stay visible next to sharp peaks
        image = ax.imshow(att[h].numpy(), cmap="viridis", norm=PowerNorm(0.5, vmin=0.0, vmax=1.0),
                          interpolation="nearest")
        ax.set_title(f"head {h}", fontsize=10)
        if labels is not None:
            fs = max(5, min(9, 220 // T))
            ax.set_xticks(range(T), labels, rotation=90, fontsize=fs, fontfamily="monospace")
            ax.set_yticks(range(T), labels, fontsize=fs, fontfamily="monospace")
        if h % ncols == 0:
            ax.set_ylabel("query (attending)")
        if h >= nh - ncols:
            ax.set_xlabel("key (attended to)")
    fig.suptitle(f"attention weights, layer {layer} (of 0..{n_layer - 1}), {T} prompt tokens")
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="weight")
    out = Path(path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110)
    except ValueError as e:  # an extension matplotlib cannot write
        raise UserError(f"--show-attention {path}: {e}") from None
    except OSError as e:
        raise UserError(f"--show-attention {path}: cannot write there ({e.strerror}: {e.filename}); "
                        "pick another path") from None
    finally:
        plt.close(fig)
    return out
