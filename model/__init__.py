"""A decoder-only transformer (GPT) and its parts; see gpt.py for the walk of shapes.

`from model import GPT` loads torch on first use, not here: `python -m model` and `python -m model.hf` run
this first, and only then their own code, which makes Ctrl-C during torch's import one line."""

import importlib
from typing import Any

_HOMES = {"GPT": "model.gpt", "GPTConfig": "configs.model", "KVCache": "model.kv_cache",
          "sample_next": "model.kv_cache", "generate": "model.kv_cache",
          "CausalSelfAttention": "model.attention", "MultiHeadAttention": "model.attention"}
__all__ = list(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'model' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
