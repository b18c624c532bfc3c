"""Views inside a model, by forward hooks: the shape walk, hidden states, attention maps.

`python -m model` prints the walk; `sample.py --show-attention` draws the maps."""

from __future__ import annotations

import errno
import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from configs.errors import UserError

from .attention import CausalSelfAttention
from .gpt import GPT


@contextmanager
def hooked(modules: Iterable[nn.Module], hook: Callable[..., Any]) -> Iterator[None]:
    """hook(module, inputs, output) runs after each module's forward inside the with-block."""
    handles = [m.register_forward_hook(hook) for m in modules]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


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


def token_label(tok: Any, token_id: int) -> str:
    return tok.decode([token_id]).replace("\n", "\\n").replace("\t", "\\t").replace(" ", "\u2423")


@torch.no_grad()
def plot_attention(model: GPT, tok: Any, ids: list[int], path: str, layer: int) -> Path:
    """One heat map per head of `layer` (query rows, key columns) for the prompt, as a PNG."""
    n_layer = model.config.n_layer
    if not -n_layer <= layer < n_layer:
        raise UserError(f"--layer {layer} is out of range: the model has layers 0..{n_layer - 1}")
    try:  # a Figure of its own, not pyplot's: no GUI backend, nothing to close
        from matplotlib.colors import PowerNorm
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError("--show-attention needs matplotlib: pip install matplotlib") from None
    layer %= n_layer
    ids = ids[-model.config.block_size :]
    x = torch.tensor([ids], device=next(model.parameters()).device)
    att = attention_weights(model, x)[1][layer][0].float().cpu()  # (nh, T, T)
    nh, T = att.shape[0], att.shape[-1]
    ncols = math.ceil(math.sqrt(nh))  # a near-square grid of heads
    nrows = math.ceil(nh / ncols)
    labels = [token_label(tok, i) for i in ids] if T <= 48 else None
    size = 3.5 if labels is None else min(9.0, max(3.5, 0.15 * T + 1.0))  # inches per head
    fig = Figure(figsize=(ncols * size + 1.0, nrows * size + 0.6), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for ax in axes.flat[nh:]:
        ax.axis("off")
    for h, ax in enumerate(axes.flat[:nh]):
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
    return _save(fig, path)


def _save(fig: Any, path: str) -> Path:
    """fig as a PNG at path (.png added when it has no suffix); a path it cannot write is one line."""
    out = Path(path) if Path(path).suffix else Path(path).with_suffix(".png")  # what savefig writes then
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110)
    except ValueError as e:  # an extension matplotlib cannot write
        raise UserError(f"--show-attention {path}: {e}") from None
    except OSError as e:
        raise UserError(f"--show-attention {path}: cannot write there ({e.strerror or e}); "
                        + ("raise the file-size limit or free disk space" if e.errno in (errno.EFBIG, errno.ENOSPC)
                           else "pick another path")) from None
    return out
