"""Compiled decoding, for sample.py --compile: a small model's many tiny ops become a few kernels.

On small's shape, on a CPU, it decodes at about 2.7x the eager tokens/s once compiled (tens of
seconds, cached after); a large model's decoding is bound by memory, and gains little
(docs/sampling.md).
"""

import torch


def compiled(model: torch.nn.Module) -> torch.nn.Module:
    """The model, its forward compiled for generate(): a graph for every length of the KV cache
    (dynamic shapes), and one-row matmuls decomposed so that they fuse with their neighbours."""
    fuse = {"post_grad_fusion_options": {"decompose_mm_pass": {}}}
    return torch.compile(model, dynamic=True, options=fuse)
