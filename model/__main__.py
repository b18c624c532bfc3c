"""Print the walk of shapes through the model for a config (a preset, a .toml file or a run directory).

    python -m model --config small
    python -m model --config gpt2 --seq-len 8
"""

from __future__ import annotations

import sys
from pathlib import Path

from configs.errors import entry_point


@entry_point
def main(argv: list[str] | None = None) -> int:
    from configs import available_configs, load_config
    from configs.cli import ArgumentParser, integer
    from data.manifest import read_manifest

    parser = ArgumentParser(prog="python -m model", description=__doc__)
    parser.add_argument("--config", default="small", metavar="NAME|FILE|RUN_DIR",
                        help=f"a preset ({', '.join(available_configs())}), a .toml file or a run directory")
    parser.add_argument("--batch-size", type=integer.within(">= 1"), default=1, help="rows of the dummy input")
    parser.add_argument("--seq-len", type=integer.within(">= 1"),
                        help="tokens per row (default: the config's block_size)")
    parser.add_argument("--blocks", type=integer.within(">= 0"), default=1,
                        help="how many blocks to show module by module")
    args = parser.parse_args(argv)
    from . import GPT
    from .trace import shape_trace

    cfg = load_config(args.config)
    manifest = Path(cfg.data_root) / cfg.dataset / "manifest.json"
    vocab = cfg.vocab_size or (read_manifest(manifest)["vocab_size"] if manifest.is_file() else 0)
    vocab = vocab or (65 if "char" in cfg.dataset else 50257)  # not prepared yet: the two tokenizers' sizes
    print(shape_trace(GPT(cfg.model_config(vocab)), args.batch_size, args.seq_len, args.blocks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
