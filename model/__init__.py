"""A decoder-only transformer (GPT) and its parts; see gpt.py for the walk of shapes."""

from configs.model import GPTConfig

from .attention import CausalSelfAttention, MultiHeadAttention
from .gpt import GPT
from .kv_cache import KVCache, sample_next

__all__ = ["GPT", "GPTConfig", "KVCache", "CausalSelfAttention", "MultiHeadAttention", "sample_next"]
