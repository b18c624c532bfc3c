"""Optimizers and the learning-rate schedule. They belong to training, not to the model.

Two recipes, chosen by `--optimizer`:
  adamw  AdamW on everything; weight decay on matrices (Linear weights, embeddings) only.
  muon   Muon on the 2-D weights inside the transformer blocks (attention and MLP matrices),
         AdamW on the rest (embeddings, the head, norms, biases); weight decay on every matrix,
         decoupled in both (Muon's: p *= 1 - lr * weight_decay at the step's lr). Muon replaces
         each update with the nearest semi-orthogonal matrix, so every direction of a weight
         matrix learns at the same rate; on the small config it reaches a given loss in ~35%
         fewer steps for ~30% more time per step (README, Performance).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch


@torch.no_grad()
def orthogonalize(update: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Approximately U V^T for each matrix update = U S V^T (batched over leading dims), by a
    quintic Newton-Schulz iteration.

    The coefficients (3.4445, -4.7750, 2.0315) push every singular value into roughly
    [0.7, 1.2] within 5 steps instead of converging exactly; that is accurate enough for an
    optimizer step and cheap enough to run in bfloat16.
    """
    a, b, c = 3.4445, -4.7750, 2.0315
    x = update.to(dtype).reshape(-1, *update.shape[-2:])  # (..., m, n) -> (batch, m, n)
    tall = x.size(-2) > x.size(-1)
    if tall:  # iterate on the wide orientation so x @ x^T is the smaller Gram matrix
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # singular values <= 1: the basin
    for _ in range(steps):
        gram = x @ x.mT
        # x <- a x + (b gram + c gram^2) x, each sum fused into its matmul (baddbmm): 1.6x faster
        # on CPU in bf16 than the separate scalings and adds
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    x = x.mT if tall else x
    return x.reshape(update.shape).to(update.dtype)


class Muon(torch.optim.Optimizer):
    """SGD with Nesterov momentum whose update is orthogonalized before it is applied.

    Only for 2-D weights. The step is scaled by sqrt(max(1, rows / cols)) so tall and wide
    matrices move their outputs by similar amounts. Weight decay is decoupled, as in AdamW.
    ns_dtype: the Newton-Schulz iteration's precision; bfloat16 only where its matmuls are native.
    """

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, weight_decay: float = 0.0, ns_dtype: torch.dtype = torch.bfloat16):
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                      weight_decay=weight_decay))
        self.ns_dtype = ns_dtype
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(f"Muon takes 2-D weights only, got shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for group in self.param_groups:
            lr, mu = group["lr"], group["momentum"]
            params = [p for p in group["params"] if p.grad is not None]
            grads = [p.grad for p in params]
            for p in params:
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p)
            bufs = [self.state[p]["momentum_buffer"] for p in params]
            # One foreach op over all parameters instead of one small op each: fewer launches.
            torch._foreach_mul_(bufs, mu)
            torch._foreach_add_(bufs, grads)
            updates = torch._foreach_add(grads, bufs, alpha=mu) if group["nesterov"] else bufs
            if group["weight_decay"]:
                torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
            same_shape: dict[torch.Size, list[int]] = defaultdict(list)
            for i, p in enumerate(params):
                same_shape[p.shape].append(i)
            # One batched Newton-Schulz per shape (e.g. every layer's c_fc at once): fewer, larger matmuls.
            for shape, idx in same_shape.items():
                directions = orthogonalize(torch.stack([updates[i] for i in idx]), group["ns_steps"], self.ns_dtype)
                scale = max(1.0, shape[0] / shape[1]) ** 0.5
                torch._foreach_add_([params[i] for i in idx], list(directions.unbind()), alpha=-lr * scale)


class Chain:
    """Several optimizers that act as one: step, zero_grad, param_groups and state_dict span
    them all, so the training loop (and GradScaler) need not know there are two."""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def state(self) -> dict:
        return {k: v for opt in self.optimizers for k, v in opt.state.items()}

    def step(self, closure=None) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"chain": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the optimizers' state (moments, momentum buffers, step counts) but keep the
        hyperparameters this run was configured with: torch's load_state_dict brings back the
        saved ones, which would silently ignore a changed --lr or --weight-decay on --resume."""
        for opt, s in zip(self.optimizers, state["chain"], strict=True):
            configured = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
            opt.load_state_dict(s)
            for group, hyper in zip(opt.param_groups, configured, strict=True):
                group.update(hyper)


def configure_optimizer(model: torch.nn.Module, cfg: Any, *, fused: bool,
                        dtype: torch.dtype = torch.float32) -> Chain:
    """The optimizer for cfg.optimizer. Every param group records its peak rate as
    "base_lr"; set_lr scales them all together. fused: AdamW's one-kernel step (runtime.TABLE
    says where, through rt.plan.fused_adamw). dtype: the run's compute dtype (rt.plan.dtype),
    which Muon's Newton-Schulz matmuls use too, so they are bf16 only where bf16 is native
    (an AVX2 CPU, which emulates it, ran small's bf16 iteration 30-50x slower than float32)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # tied weights once
    use_muon = cfg.optimizer == "muon"
    hidden = [p for n, p in named if use_muon and p.dim() == 2 and ".h." in n]
    rest = [p for n, p in named if not any(p is q for q in hidden)]
    adam_groups = [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                   {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]
    adam = torch.optim.AdamW([g for g in adam_groups if g["params"]], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             fused=fused)
    optimizers: list[torch.optim.Optimizer] = [adam]
    if hidden:
        # decoupled weight decay on Muon's matrices too: val 1.627 vs 1.640 after small's 1800 steps
        optimizers.append(Muon(hidden, lr=cfg.muon_lr, momentum=cfg.muon_momentum, weight_decay=cfg.weight_decay,
                               ns_dtype=dtype))
    chain = Chain(*optimizers)
    for group in chain.param_groups:
        group["base_lr"] = group["lr"]
    return chain


def lr_multiplier(step: int, progress: float, cfg: Any) -> float:
    """Fraction of the peak learning rate for optimizer step `step` (0-based).

    Linear warmup over warmup_iters steps, then the schedule over `progress` in [0, 1], the
    share of the run done: steps / lr_decay_iters, or elapsed time / --max-time if that is
    further along (so a time-budgeted run still ends its decay on time).
      cosine    half a cosine from 1 down to min_lr / lr
      wsd       warmup-stable-decay: 1 until the last decay_frac of the run, then linear to min_lr / lr
      constant  1
    """
    if step < cfg.warmup_iters:
        return (step + 1) / (cfg.warmup_iters + 1)
    if cfg.lr_schedule == "constant":
        return 1.0
    floor = cfg.min_lr / cfg.lr if cfg.lr else 0.0
    progress = min(max(progress, 0.0), 1.0)
    if cfg.lr_schedule == "wsd":
        decay = min(1.0, max(0.0, (progress - (1 - cfg.decay_frac)) / cfg.decay_frac))
        return 1.0 - decay * (1.0 - floor)
    return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (1.0 - floor)


def set_lr(optimizer: Chain, multiplier: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * multiplier
