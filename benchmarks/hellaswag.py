"""HellaSwag scoring speed: seconds per 100 items for a config's model (random weights and items).

    python -m benchmarks hellaswag --config gpt2 --items 100        # GPT-2 124M's shape
"""

import argparse
from collections.abc import Callable

import torch

from benchmarks import emit, timed
from configs import load_config
from configs.cli import integer
from model import GPT
from training.hellaswag import score
from training.runtime import setup

# Token lengths near the validation split's typical item: a context of about two sentences, endings of one.
CONTEXT_TOKENS, ENDING_TOKENS, SPLIT_ITEMS = 60, 25, 10042


def add_hellaswag_parser(add_parser: Callable[..., argparse.ArgumentParser]) -> None:
    p = add_parser("hellaswag", help="HellaSwag seconds per 100 items (random weights, synthetic items)")
    p.add_argument("--config", default="gpt2", help="a configs/<name>.py or a .toml; other flags are its fields")
    p.add_argument("--items", type=integer(lo=1), default=100, help="items timed")
    p.set_defaults(func=bench_hellaswag, passthrough=True)


def bench_hellaswag(args: argparse.Namespace) -> None:
    cfg, g = load_config(args.config, args.extra), torch.Generator().manual_seed(0)
    rt, vocab, batch = setup(cfg), cfg.vocab_size or 50257, cfg.eval_batch_size or cfg.batch_size
    model = GPT(cfg.model_config(vocab)).to(rt.device)
    items = [(torch.randint(vocab, (CONTEXT_TOKENS,), generator=g).tolist(),
              torch.randint(vocab, (4, ENDING_TOKENS), generator=g).tolist(), 0) for _ in range(args.items)]
    score(model, items[:2], vocab, rt, batch)  # warm-up
    _, seconds = timed(lambda: score(model, items, vocab, rt, batch), rt.device)
    emit({"bench": "hellaswag", "config": cfg.name, "device": rt.device, "dtype": str(rt.dtype).removeprefix("torch."),
          "threads": torch.get_num_threads(), "batch_rows": batch, "items": args.items,
          "seconds_per_100_items": round(100 * seconds / args.items, 2),
          "whole_split_s": round(SPLIT_ITEMS * seconds / args.items, 1)})
