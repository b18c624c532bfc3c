"""A decoder-only transformer (GPT) and its parts; see gpt.py for the walk of shapes."""

from .attention import CausalSelfAttention, MultiHeadAttention
from .config import GPTConfig
from .gpt import GPT, sample_next
from .kv_cache import KVCache

__all__ = ["GPT", "GPTConfig", "KVCache", "CausalSelfAttention", "MultiHeadAttention", "sample_next"]
