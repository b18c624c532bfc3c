"""Data: tokenizers, token files, batch loaders and `python -m data.prepare`.

The loader needs torch, slow to import, so it is loaded on first use: `python -m data.prepare` and
the tokenizers start fast. ``data.prepare`` is not imported here, so `python -m` runs it only once.
"""

from typing import Any

from .tokenfile import read_header, read_tokens, write_tokens
from .tokenizer import CharTokenizer, GPT2Tokenizer, Tokenizer, get_tokenizer, tokenizer_from_manifest

__all__ = ["BatchLoader", "CharTokenizer", "GPT2Tokenizer", "GlobalBatchLoader", "Tokenizer", "eval_batches",
           "get_tokenizer", "read_header", "read_tokens", "tokenizer_from_manifest", "write_tokens"]


def __getattr__(name: str) -> Any:
    if name in ("BatchLoader", "GlobalBatchLoader", "eval_batches"):
        from . import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'data' has no attribute {name!r}")
