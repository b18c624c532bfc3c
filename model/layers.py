"""Small building blocks shared by attention and the GPT: norms and rotary embeddings."""

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

if TYPE_CHECKING:  # annotations only
    from configs.model import GPTConfig


def make_norm(config: "GPTConfig", dim: int) -> nn.Module:
    """LayerNorm, or RMSNorm: x / rms(x) * weight, LayerNorm without the mean and the bias (cheaper, as good)."""
    rms = config.norm == "rmsnorm"
    return nn.RMSNorm(dim, eps=config.norm_eps) if rms else nn.LayerNorm(dim, eps=config.norm_eps, bias=config.bias)


class Rotary(nn.Module):
    """Rotary position embedding tables for positions 0 .. block_size - 1: non-persistent buffers,
    derived from the config, so checkpoints never carry them and .to() moves them with the model."""

    def __init__(self, head_size: int, max_positions: int, base: float):
        super().__init__()
        inv_freq = base ** (-torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # (Tmax, hs/2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pos (B|1, T) positions -> cos, sin each (B|1, 1, T, hs/2), ready to broadcast over heads."""
        return self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x1[i], x2[i]) of the two halves of the head dimension by position angles."""
    x1, x2 = x.chunk(2, dim=-1)  # (B, nh, T, hs) -> 2 x (B, nh, T, hs/2)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # under autocast x is bf16: stay there
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
