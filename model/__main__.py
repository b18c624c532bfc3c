"""Print the walk of shapes through the model, from token ids to logits, for a config.

Run it from the repository:
    python -m model --config small
    python -m model --config gpt2 --seq-len 8
"""

import contextlib

import torch

from configs import ArgumentParser, UserError, load_config, run

from .gpt import GPT


def shape_walk(model: GPT, batch_size: int = 1, seq_len: int = 0) -> str:
    """A table of a forward pass on zeros: each module's output shape and parameters in the order
    they run; the first block module by module, the others a row each."""
    c, T = model.config, seq_len or model.config.block_size
    hs = c.n_embd // c.n_head
    lines = [
        f"GPT: {model.num_params():,} parameters, {c.n_layer} layers, {c.n_head} heads of size "
        f"{hs}, n_embd {c.n_embd}, vocab {c.vocab_size}, block {c.block_size}",
        f"input idx {(batch_size, T)} token ids",
        f"{'module':<30} {'type':<20} {'output shape':<20} {'params':>12}",
    ]

    def row(module, inputs, output):
        name, indent = names[module], "  " * names[module].count(".")
        params = sum(p.numel() for p in module.parameters())
        shape = str(tuple(output.shape))
        lines.append(f"{indent + name:<30} {type(module).__name__:<20} {shape:<20} {params:>12,}")
        if name.endswith("c_attn"):  # the split into heads happens inside the attention's forward
            heads = f"3 x {(batch_size, c.n_head, T, hs)}"
            lines.append(f"{indent}split into q, k, v: (B, T, C) -> 3 x (B, nh, T, hs) = {heads}")

    names = {}  # modules with a row: no dropout or container, nor the insides of blocks past h.0
    for name, module in model.named_modules():
        later_block = name.startswith("transformer.h.") and name.split(".")[2] != "0"
        skipped = (torch.nn.Dropout, torch.nn.ModuleList, torch.nn.ModuleDict)
        if name and not isinstance(module, skipped) and not (later_block and name.count(".") > 2):
            names[module] = name.removeprefix("transformer.")
    with contextlib.ExitStack() as hooks:  # each hook's handle removes it on exit
        for module in names:
            hooks.enter_context(module.register_forward_hook(row))
        idx = torch.zeros(batch_size, T, dtype=torch.long, device=model.lm_head.weight.device)
        logits, _ = model(idx)
    lines.append(
        f"logits {tuple(logits.shape)}: a score for each token of the vocabulary, at each position"
    )
    return "\n".join(lines)


def main(argv=None) -> None:
    p = ArgumentParser(
        prog="python -m model",
        description=__doc__,
    )
    p.add_argument(
        "--config", default="small", help="a preset, a .toml file or a run's config.json"
    )
    p.add_argument("--batch-size", type=int, default=1, help="rows of the input")
    p.add_argument("--seq-len", type=int, default=0, help="tokens a row (default: its block_size)")
    args = p.parse_args(argv)
    if args.batch_size < 1 or args.seq_len < 0:
        raise UserError("--batch-size: at least 1; --seq-len: at least 0")
    cfg = load_config(args.config)
    vocab = 65 if cfg.dataset.endswith("char") else 50257  # the tokenizer's
    with torch.device("meta"):  # shapes without memory: any size can be walked
        model = GPT(cfg.model_config(vocab))
    print(shape_walk(model, args.batch_size, min(args.seq_len, cfg.block_size)))


if __name__ == "__main__":
    run(main)
