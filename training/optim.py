"""The optimizers, AdamW and (--optimizer muon) Muon for the blocks' matrices; the lr schedule."""

import math

import torch


@torch.no_grad()
def orthogonalize(update: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """About U V^T for each matrix of a batch update = U S V^T: Newton-Schulz steps bring every
    singular value near 1, in a low precision where the hardware has one. Four steps train small as
    well as the usual five, and a Muon step takes a fifth less time (docs/performance.md)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = update.to(dtype)
    if tall := x.size(-2) > x.size(-1):  # the wide side up: x @ x^T is then the smaller product
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # singular values <= 1: it converges there
    for _ in range(4):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.mT if tall else x).to(update.dtype)


class Muon(torch.optim.Optimizer):
    """SGD with Nesterov momentum whose update is orthogonalized, then scaled by sqrt(max(1, rows /
    cols)): torch.optim.Muon's steps, with the matrices of a shape orthogonalized together, which is
    faster on a CPU."""

    def __init__(self, params, lr=0.02, momentum=0.95, weight_decay=0.0, dtype=torch.bfloat16):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))
        self.dtype = dtype

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, momentum, updates = group["lr"], group["momentum"], {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p)
                buf = self.state[p]["momentum_buffer"]
                buf.mul_(momentum).add_(p.grad)
                updates[p] = p.grad.add(buf, alpha=momentum)  # Nesterov: a momentum step ahead
                p.mul_(1 - lr * group["weight_decay"])
            for shape in {p.shape for p in updates}:
                same = [p for p in updates if p.shape == shape]
                directions = orthogonalize(torch.stack([updates[p] for p in same]), self.dtype)
                for p, direction in zip(same, directions):
                    p.add_(direction, alpha=-lr * max(1.0, shape[0] / shape[1]) ** 0.5)


def make_optimizers(model: torch.nn.Module, cfg, rt) -> list[torch.optim.Optimizer]:
    """AdamW, and with --optimizer muon a Muon for the blocks' matrices. Matrices decay; biases and
    norms do not."""
    named = list(model.named_parameters())  # a tied weight once
    muon = [p for name, p in named if cfg.optimizer == "muon" and p.dim() == 2 and ".h." in name]
    rest = [p for _, p in named if all(p is not q for q in muon)]
    groups = [
        {"params": [p for p in rest if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = rt.device.split(":")[0] in ("cuda", "cpu")  # one kernel for every parameter
    optimizers = [torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=fused)]
    if muon:  # it orthogonalizes in autocast's dtype: bfloat16 where the hardware has it
        optimizers.append(Muon(muon, cfg.muon_lr, weight_decay=cfg.weight_decay, dtype=rt.dtype))
    return optimizers


def lr_factor(step: int, cfg, progress: float) -> float:
    """The share of the peak learning rate at 0-based `step`: a linear warmup, then cfg.lr_schedule
    by `progress`, the share of the run done (by steps, or by the clock under --max-time)."""
    if step < cfg.warmup_iters:
        return (step + 1) / (cfg.warmup_iters + 1)
    if cfg.lr_schedule == "constant":
        return 1.0
    floor = cfg.min_lr / cfg.lr if cfg.lr else 0.0
    progress = min(max(progress, 0.0), 1.0)
    if cfg.lr_schedule == "wsd":  # flat, then straight down to the floor over the last decay_frac
        return 1.0 - max(0.0, progress - (1 - cfg.decay_frac)) / cfg.decay_frac * (1.0 - floor)
    return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (1.0 - floor)
