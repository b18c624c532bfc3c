"""Print the walk of shapes through the model for a config (a preset, a .toml file or a run directory).

    python -m model --config small
    python -m model --config gpt2 --seq-len 8
"""

import sys
from pathlib import Path

from configs.errors import UserError, entry_point, first_line


@entry_point
def main(argv: list[str] | None = None) -> None:
    from configs import available_configs, load_config
    from configs.cli import ArgumentParser, integer
    from data.manifest import read_manifest

    p = ArgumentParser(prog="python -m model", description=__doc__)
    p.add_argument("--config", default="small", metavar="NAME|FILE|RUN_DIR",
                   help=f"a preset ({', '.join(available_configs())}), a .toml file or a run directory")
    p.add_argument("--batch-size", type=integer(lo=1), default=1, help="rows of the dummy input")
    p.add_argument("--seq-len", type=integer(lo=1), help="tokens per row (default: the config's block_size)")
    p.add_argument("--blocks", type=integer(lo=0), default=1, help="how many blocks to show module by module")
    args = p.parse_args(argv)
    import torch

    from . import GPT
    from .trace import shape_trace

    cfg = load_config(args.config)
    if args.seq_len and args.seq_len > cfg.block_size:
        raise UserError(f"--seq-len {args.seq_len} is longer than the config's block_size {cfg.block_size}; "
                        f"use at most {cfg.block_size}")
    manifest = Path(cfg.data_root) / cfg.dataset / "manifest.json"
    vocab = cfg.vocab_size or (read_manifest(manifest)["vocab_size"] if manifest.is_file() else 0)
    vocab = vocab or (65 if "char" in cfg.dataset else 50257)  # not prepared yet: the two tokenizers' sizes
    with torch.device("meta"):  # shapes only: no memory, so any size can be walked
        model = GPT(cfg.model_config(vocab))
    try:
        print(shape_trace(model, args.batch_size, args.seq_len, args.blocks))
    except RuntimeError as e:  # even a meta tensor's size in bytes must fit in 63 bits
        if "overflow" not in str(e):
            raise
        raise UserError(f"a tensor of this walk would hold more than 2**63 bytes ({first_line(e)}); "
                        "use a smaller --batch-size, --seq-len or vocabulary") from None


if __name__ == "__main__":
    sys.exit(main())
