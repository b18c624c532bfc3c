"""training/optim.py: the learning-rate schedules' exact values, which parameters decay, Muon."""

import ast
from dataclasses import replace

import pytest
import torch
from conftest import rows

from configs import TrainConfig, load_config
from model.gpt import GPT, GPTConfig
from training.optim import Muon, lr_factor, make_optimizers, orthogonalize
from training.runtime import Runtime

# Fields over TrainConfig(warmup_iters=4, lr=2.0, min_lr=0.2) => the progress => lr_factor at
# step 4, the first past the warmup (not 5 / 5), by each. lr 2 and min_lr 0.2 make the floor 0.1,
# where min_lr * lr (0.4) or lr - min_lr would not be. Cosine at a quarter: 0.1 + 0.45 * (1 +
# 0.5**0.5); wsd: flat, then straight to the floor over the last 40%; a zero lr: a zero floor, not
# a division by zero.
SCHEDULES = """
{} => -0.5 0 0.25 0.5 1 1.5 => 1 1 0.868198051534 0.55 0.1 0.1
{"lr_schedule": "wsd", "decay_frac": 0.4} => -1 0 0.6 0.7 0.8 1 2 => 1 1 1 0.775 0.55 0.1 0.1
{"lr_schedule": "constant"} => 0 0.5 1 => 1 1 1
{"lr": 0.0, "min_lr": 0.0} => 0.5 1 => 0.5 0
{"lr": 0.0, "min_lr": 0.0, "lr_schedule": "wsd"} => 1 => 0
"""


@pytest.mark.parametrize("fields, progress, expected", rows(SCHEDULES, " => "))
def test_lr_factor_warms_up_then_follows_the_schedule_with_progress_clamped(
    fields, progress, expected
):
    cfg = replace(TrainConfig(warmup_iters=4, lr=2.0, min_lr=0.2), **ast.literal_eval(fields))
    # steps 0 to 3: (step + 1) / (warmup + 1), whatever the progress: the first step learns, then
    # the peak; then step 4 by each progress
    warmup = [lr_factor(s, cfg, 0.9) for s in range(4)]
    assert warmup + [lr_factor(4, cfg, float(p)) for p in progress.split()] == pytest.approx(
        [0.2, 0.4, 0.6, 0.8, *map(float, expected.split())]
    )


def test_shakespeare_gpu_schedule_warms_up_holds_then_decays_to_zero_at_its_last_step():
    """The values pin its warmup_iters 100, wsd, decay_frac 0.8 and min_lr 0."""
    cfg = load_config("shakespeare_gpu")
    assert (cfg.optimizer, cfg.max_iters) == ("muon", 1000)
    lr = [lr_factor(s, cfg, (s - 100) / 900) for s in range(1001)]  # train.py's progress
    # flat for the first 20% after the warmup, half way down at 640, zero at the last step
    assert lr[:100:99] + lr[100:281] + lr[640::359] + lr[1000:] == pytest.approx(
        [1 / 101, 100 / 101] + [1] * 181 + [0.5, 1 / 720, 0]
    )
    assert all(a > b for a, b in zip(lr[280:], lr[281:]))


# the optimizer, the model (gpt2: GPT-2's biases and tied head; bare: neither), the device, and
# whether AdamW is fused there
OPTIMIZERS = """
adamw gpt2 cpu fused
adamw bare cuda:0 fused
muon gpt2 mps unfused
"""


@pytest.mark.parametrize("optimizer, shape, device, fused", rows(OPTIMIZERS, " "))
def test_matrices_decay_once_vectors_do_not_and_muon_takes_the_blocks_matrices(
    optimizer, shape, device, fused
):
    gpt2 = shape == "gpt2"
    model = GPT(GPTConfig(11, 8, 2, 2, 16, bias=gpt2, tie_weights=gpt2))
    cfg = TrainConfig(
        optimizer=optimizer, weight_decay=0.3, lr=0.004, muon_lr=0.05, beta1=0.8, beta2=0.95
    )
    opts = make_optimizers(model, cfg, Runtime(device, torch.float32))
    names = {p: n for n, p in model.named_parameters()}  # a tied weight once
    # each group's parameters in the model's order: each parameter in one group, once
    got = [
        (type(o), g["lr"], g["weight_decay"], [names[p] for p in g["params"]])
        for o in opts
        for g in o.param_groups
    ]
    # with Muon: c_attn, attn.c_proj, c_fc and mlp.c_proj in each of 2 blocks
    hidden = [n for p, n in names.items() if p.dim() == 2 and ".h." in n and optimizer == "muon"]
    matrices = [n for p, n in names.items() if p.dim() == 2 and n not in hidden]
    assert got == [
        (torch.optim.AdamW, 0.004, 0.3, matrices),
        (torch.optim.AdamW, 0.004, 0.0, [n for p, n in names.items() if p.dim() == 1]),
    ] + [(Muon, 0.05, 0.3, hidden)] * (len(hidden) == 8)
    assert opts[0].defaults["betas"] == (0.8, 0.95)
    assert bool(opts[0].defaults["fused"]) == (fused == "fused")
    # Muon orthogonalizes in the run's autocast dtype, not its bfloat16 default
    assert all(o.defaults["momentum"] == 0.95 and o.dtype == torch.float32 for o in opts[1:])


def muon_vs_torch(ours_kw, torch_kw):
    """Three steps of ours and of torch.optim.Muon on the same weights and gradients: the largest
    difference of the weights, relative to how far torch's moved. Ours also holds a parameter
    without a gradient, which must stay as it was, out of its state, weight decay or not."""
    torch.manual_seed(0)
    # a tall pair orthogonalized together, a wide one
    start = [torch.randn(s) for s in [(48, 16), (16, 48), (48, 16), (32, 32)]]
    ours, theirs = [[p.clone() for p in start] for _ in "ab"]
    idle = torch.ones(8, 4)
    opts = [
        Muon([*ours, idle], **ours_kw),
        # Nesterov momentum: torch's default
        torch.optim.Muon(theirs, adjust_lr_fn="original", ns_steps=4, **torch_kw),
    ]
    for _ in range(3):
        for p, q in zip(ours, theirs):  # the same gradients
            p.grad = torch.randn_like(p) * 1e-2
            q.grad = p.grad.clone()
        for opt in opts:
            opt.step()
    assert idle.eq(1).all() and idle not in opts[0].state and ours[0] in opts[0].state
    return max((a - b).norm() / (b - p0).norm() for a, b, p0 in zip(ours, theirs, start))


def test_muon_takes_torch_optim_muons_steps_and_leaves_parameters_without_a_gradient_alone():
    """Our momentum buffer is torch's / (1 - momentum), a scale that orthogonalizing removes: with
    momentum 0.75 the scale is a power of two, so that bfloat16 rounds both alike."""
    kw = dict(lr=0.05, momentum=0.75, weight_decay=0.1)
    assert muon_vs_torch(kw, kw) < 1e-3
    # the same tolerance tells a slightly other momentum, or no weight decay, apart
    assert muon_vs_torch(kw, kw | dict(momentum=0.8)) > 1e-2
    assert muon_vs_torch(kw | dict(weight_decay=0.0), kw) > 1e-2
    # the defaults are torch's usual lr 0.02, momentum 0.95, no weight decay: within bfloat16's
    # rounding (1.2% measured), where momentum 0.9 is 4.7% away
    usual = dict(lr=0.02, momentum=0.95, weight_decay=0.0)
    assert muon_vs_torch({}, usual) < 0.025 < 0.035 < muon_vs_torch({}, usual | dict(momentum=0.9))


@pytest.mark.parametrize("shape", [(2, 48, 16), (2, 16, 48), (1, 32, 32)])
def test_orthogonalize_brings_every_singular_value_near_one_keeping_the_directions(shape):
    """Newton-Schulz maps each singular value s of G / |G| by f(x) = a x + b x^3 + c x^5, four
    times, and keeps the singular vectors: U V^T, up to the band [0.68, 1.14] f leaves."""
    torch.manual_seed(0)
    g = torch.randn(shape)
    o, low = orthogonalize(g, torch.float32), orthogonalize(g, torch.bfloat16)
    s, t = torch.linalg.svdvals(torch.stack([o, low]).double())
    u, x, vh = torch.linalg.svd(g.double(), full_matrices=False)
    x = x / x.norm(dim=-1, keepdim=True)  # |G|'s Frobenius norm
    for _ in range(4):
        x = 3.4445 * x - 4.7750 * x**3 + 2.0315 * x**5
    # f is not monotonic on [0, 1]: compare the values sorted
    assert torch.allclose(s, x.sort(descending=True).values, atol=2e-5)
    # bfloat16's band is wider (float32's is f's, held by the values above)
    assert 0.6 < t.min() and t.max() < 1.25
    r = u.mT @ o.double() @ vh.mT  # diagonal when o has g's singular vectors
    assert (r - r.triu().tril()).abs().max() < 1e-5
    # bfloat16 inside, returned in the input's dtype
    assert o.shape == g.shape and low.dtype == torch.float32 and not torch.equal(low, o)
