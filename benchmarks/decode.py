"""Decoding speed: generate()'s tokens/s on a config's shape, random weights, eager and compiled."""

import time
from dataclasses import fields

import torch

from benchmarks import emit
from configs import load_config
from model.gpt import GPT, GPTConfig, generate


def main(args) -> None:
    cfg = load_config(args.config)
    torch.manual_seed(0)
    shape = {f.name: getattr(cfg, f.name) for f in fields(GPTConfig)}
    vocab = cfg.vocab_size or (65 if cfg.dataset.endswith("char") else 50257)
    model = GPT(GPTConfig(**shape | {"vocab_size": vocab})).eval()
    if model.config.n_embd <= 256:
        torch.set_num_threads(1)  # as sample.py decodes a small model
    for mode in args.modes.split(","):
        decoder = model
        if mode == "compiled":
            from model.compiled import compiled

            decoder = compiled(model)
        rates = []
        for _ in range(4):  # the first round compiles, or warms up
            generator = torch.Generator().manual_seed(0)
            t0 = time.perf_counter()
            steps = generate(
                decoder,
                torch.zeros(1, 1, dtype=torch.long),
                args.tokens,
                0.8,
                None,
                None,
                generator,
                vocab,
            )
            n = sum(1 for _ in steps)
            rates.append(n / (time.perf_counter() - t0))
        emit(
            {
                "bench": "sample",
                "config": args.config,
                "mode": mode,
                "threads": torch.get_num_threads(),
                "tokens_per_s": round(max(rates[1:])),
            }
        )
