"""Data: tokenizers, token files, batch loaders and `python -m data.prepare`.

The names load on first use: data.prepare (left out, so that `python -m` runs it once) must run its first
lines before numpy is imported, and the loader needs torch, which is slow to import.
"""

import importlib
from typing import Any

_HOMES = dict.fromkeys(["BatchLoader", "GlobalBatchLoader", "eval_batches"], "data.loader") \
    | dict.fromkeys(["read_header", "read_tokens", "write_tokens"], "data.tokenfile") \
    | dict.fromkeys(["CharTokenizer", "GPT2Tokenizer", "Tokenizer", "get_tokenizer", "tokenizer_from_manifest"],
                    "data.tokenizer")
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'data' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
