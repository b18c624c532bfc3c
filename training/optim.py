"""Optimizers (AdamW; Muon for the blocks' matrices under --optimizer muon) and the lr schedule."""

import math
from typing import Any

import torch


@torch.no_grad()
def orthogonalize(update: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """About U V^T for each matrix update = U S V^T (batched): 5 Newton-Schulz steps put each singular value near 1."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = update.to(dtype).reshape(-1, *update.shape[-2:])
    if tall := x.size(-2) > x.size(-1):  # the wide orientation makes x @ x^T the smaller Gram matrix
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # singular values <= 1, where the iteration converges
    for _ in range(steps):
        gram = x @ x.mT
        # x <- a x + (b gram + c gram^2) x, each sum fused into its matmul (docs/performance.md)
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.mT if tall else x).reshape(update.shape).to(update.dtype)


class Muon(torch.optim.Optimizer):
    """SGD with Nesterov momentum whose update is orthogonalized, for 2-D weights, scaled by sqrt(max(1, rows/cols))."""

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, weight_decay: float = 0.0, ns_dtype: torch.dtype = torch.bfloat16):
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                      weight_decay=weight_decay))
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for group in self.param_groups:
            lr, mu = group["lr"], group["momentum"]
            params = [p for p in group["params"] if p.grad is not None]
            grads = [p.grad for p in params]
            for p in (p for p in params if "momentum_buffer" not in self.state[p]):
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)
            bufs = [self.state[p]["momentum_buffer"] for p in params]
            torch._foreach_mul_(bufs, mu)
            torch._foreach_add_(bufs, grads)
            updates = torch._foreach_add(grads, bufs, alpha=mu) if group["nesterov"] else bufs
            if group["weight_decay"]:
                torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
            for shape in dict.fromkeys(p.shape for p in params):  # one batched Newton-Schulz per shape
                idx = [i for i, p in enumerate(params) if p.shape == shape]
                directions = orthogonalize(torch.stack([updates[i] for i in idx]), group["ns_steps"], self.ns_dtype)
                scale = max(1.0, shape[0] / shape[1]) ** 0.5
                torch._foreach_add_([params[i] for i in idx], list(directions.unbind()), alpha=-lr * scale)


class Chain:
    """Several optimizers that act as one, so that the training loop (and GradScaler) need not know there are two."""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def step(self, closure=None) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"chain": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the optimizers' state but keep this run's hyperparameters (a changed --lr on --resume)."""
        for opt, s in zip(self.optimizers, state["chain"], strict=True):
            configured = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
            opt.load_state_dict(s)
            for group, hyper in zip(opt.param_groups, configured, strict=True):
                group.update(hyper)


def configure_optimizer(model: torch.nn.Module, cfg: Any, *, fused: bool, dtype: torch.dtype = torch.float32) -> Chain:
    """The optimizer for cfg.optimizer, each group's peak rate kept as "base_lr" for set_lr; `dtype` is Muon's."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # tied weights once
    hidden = [p for n, p in named if cfg.optimizer == "muon" and p.dim() == 2 and ".h." in n]
    rest = [p for n, p in named if not any(p is q for q in hidden)]
    adam_groups = [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                   {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]
    adam = torch.optim.AdamW([g for g in adam_groups if g["params"]], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             fused=fused)
    # decoupled weight decay on Muon's matrices too gave a lower val loss on small (docs/performance.md)
    muon = [Muon(hidden, lr=cfg.muon_lr, momentum=cfg.muon_momentum, weight_decay=cfg.weight_decay,
                 ns_dtype=dtype)] if hidden else []
    chain = Chain(adam, *muon)
    for group in chain.param_groups:
        group["base_lr"] = group["lr"]
    return chain


def lr_multiplier(step: int, progress: float, cfg: Any) -> float:
    """The fraction of the peak lr at 0-based `step`: a linear warmup, then cfg.lr_schedule by `progress` (0-1)."""
    if step < cfg.warmup_iters:
        return (step + 1) / (cfg.warmup_iters + 1)
    if cfg.lr_schedule == "constant":
        return 1.0
    floor = cfg.min_lr / cfg.lr if cfg.lr else 0.0
    progress = min(max(progress, 0.0), 1.0)
    if cfg.lr_schedule == "wsd":  # flat, then linear to the floor over the last decay_frac of the run
        return 1.0 - max(0.0, (progress - (1 - cfg.decay_frac)) / cfg.decay_frac) * (1.0 - floor)
    return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (1.0 - floor)


def set_lr(optimizer: Chain, multiplier: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * multiplier
