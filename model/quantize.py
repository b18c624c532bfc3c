"""Weight-only int8 for CPU decoding: every Linear's weight as int8 with one scale per output row.

Decoding reads every weight once per token, so int8 (a quarter of float32's bytes) runs it faster. The
matmul input is rounded to bfloat16, for torch's fast CPU kernel; a tied lm_head gets its own int8 copy."""

from __future__ import annotations

import torch
import torch.nn as nn


class Int8Linear(nn.Module):
    """y = (x @ q.T) * scale + bias, q int8 (out, in), scale (out,): symmetric, per output row."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127  # the row's largest weight maps to +-127
        self.register_buffer("q", torch.round(w / scale[:, None]).to(torch.int8))
        self.register_buffer("scale", scale.to(torch.bfloat16))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (..., in) as (N, in) -> (N, out)
        y = torch._weight_int8pack_mm(x.reshape(-1, x.size(-1)).bfloat16(), self.q, self.scale)
        y = y.to(x.dtype).view(*x.shape[:-1], -1)  # (N, out) -> (..., out)
        return y if self.bias is None else y + self.bias


def quantize_int8(model: nn.Module) -> nn.Module:
    """Swap every nn.Linear in model (in place) for an Int8Linear, for inference only; returns model."""
    for name, child in model.named_children():
        if isinstance(child, nn.Linear):
            setattr(model, name, Int8Linear(child))
        else:
            quantize_int8(child)
    return model
