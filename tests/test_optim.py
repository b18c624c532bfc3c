"""training/optim.py: the learning-rate schedules' exact values, which parameters decay, Muon."""

import math
from dataclasses import replace

import pytest
import torch

from configs import TrainConfig, load_config
from model.gpt import GPT, GPTConfig
from training.optim import Muon, lr_factor, make_optimizers, orthogonalize
from training.runtime import Runtime

# lr 2, min_lr 0.2: the floor is 0.1, and min_lr * lr (0.4) or lr - min_lr would not be
CFG = TrainConfig(warmup_iters=4, lr=2.0, min_lr=0.2)


def factors(cfg, step, progresses):
    return [lr_factor(step, cfg, p) for p in progresses]


def test_warmup_is_step_plus_one_over_warmup_plus_one_whatever_the_progress():
    """The first step already learns, and the peak comes right after the warmup."""
    for schedule in ("cosine", "wsd", "constant"):
        cfg = replace(CFG, lr_schedule=schedule)
        assert [lr_factor(s, cfg, 0.9) for s in range(4)] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    # step 4 is past the warmup: the schedule's value at the progress given, not 5 / 5
    assert lr_factor(4, CFG, 0.5) == pytest.approx(0.55)


def test_cosine_decays_from_the_peak_to_min_lr_over_lr_with_progress_clamped():
    progress = [-0.5, 0.0, 0.25, 0.5, 1.0, 1.5]
    quarter = 0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2
    assert factors(CFG, 9, progress) == pytest.approx([1.0, 1.0, quarter, 0.55, 0.1, 0.1])


def test_wsd_holds_the_peak_then_falls_straight_to_the_floor_over_the_last_decay_frac():
    wsd = replace(CFG, lr_schedule="wsd", decay_frac=0.4)
    progress = [-1.0, 0.0, 0.6, 0.7, 0.8, 1.0, 2.0]
    # 0.7: a quarter of the way down the last 40%, from 1 to 0.1
    assert factors(wsd, 9, progress) == pytest.approx([1.0, 1.0, 1.0, 0.775, 0.55, 0.1, 0.1])


def test_constant_stays_at_the_peak_after_warmup():
    constant = replace(CFG, lr_schedule="constant")
    assert factors(constant, 4, [0.0, 0.5, 1.0]) == [1.0, 1.0, 1.0]


def test_a_zero_lr_has_a_zero_floor_not_a_division_by_zero():
    zero = replace(CFG, lr=0.0, min_lr=0.0)
    assert factors(zero, 9, [0.5, 1.0]) == pytest.approx([0.5, 0.0])
    assert lr_factor(9, replace(zero, lr_schedule="wsd"), 1.0) == pytest.approx(0.0, abs=1e-12)


def test_shakespeare_gpu_schedule_warms_up_holds_then_decays_to_zero_at_its_last_step():
    cfg = load_config("shakespeare_gpu")
    assert (cfg.optimizer, cfg.lr_schedule, cfg.min_lr) == ("muon", "wsd", 0.0)
    assert (cfg.warmup_iters, cfg.max_iters, cfg.decay_frac) == (100, 1000, 0.8)

    def lr(step):  # the progress train.py gives the schedule
        return lr_factor(step, cfg, (step - 100) / (1000 - 100))

    assert lr(0) == pytest.approx(1 / 101) and lr(99) == pytest.approx(100 / 101)
    assert [lr(s) for s in (100, 200, 280)] == pytest.approx(
        [1.0, 1.0, 1.0]
    )  # the first 20% after warmup
    assert lr(640) == pytest.approx(0.5) and lr(999) == pytest.approx(1 / 720)
    assert lr(1000) == pytest.approx(0.0, abs=1e-12)
    decay = [lr(s) for s in range(280, 1001)]
    assert all(a > b for a, b in zip(decay, decay[1:]))


def names(model, params) -> set[str]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    return {by_id[id(p)] for p in params}


def tiny_model(**kw) -> GPT:
    return GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16, **kw))


@pytest.mark.parametrize("bias", [True, False])
def test_adamw_decays_the_matrices_not_the_biases_and_norms_and_a_tied_weight_once(bias):
    model = tiny_model(bias=bias)
    cfg = TrainConfig(weight_decay=0.3, lr=0.004, beta1=0.8, beta2=0.95)
    [adamw] = make_optimizers(model, cfg, Runtime("cpu", torch.float32))
    assert isinstance(adamw, torch.optim.AdamW)
    matrices = {n for n, p in model.named_parameters() if p.dim() == 2}
    vectors = {n for n, p in model.named_parameters() if p.dim() == 1}
    assert "transformer.wte.weight" in matrices and "lm_head.weight" not in matrices  # tied
    assert any(".ln_" in n for n in vectors) and any(n.endswith(".bias") for n in vectors) == bias
    decay, no_decay = adamw.param_groups
    assert (decay["weight_decay"], names(model, decay["params"])) == (0.3, matrices)
    assert (no_decay["weight_decay"], names(model, no_decay["params"])) == (0.0, vectors)
    every = [id(p) for g in adamw.param_groups for p in g["params"]]
    assert len(every) == len(set(every)) == len(list(model.parameters()))
    assert adamw.defaults["lr"] == 0.004 and adamw.defaults["betas"] == (0.8, 0.95)


def test_an_untied_lm_head_decays_as_a_matrix_of_its_own():
    model = tiny_model(tie_weights=False)
    [adamw] = make_optimizers(model, TrainConfig(), Runtime("cpu", torch.float32))
    decay = names(model, adamw.param_groups[0]["params"])
    assert {"lm_head.weight", "transformer.wte.weight"} <= decay


@pytest.mark.parametrize("device, fused", [("cpu", True), ("cuda:0", True), ("mps", False)])
def test_adamw_is_fused_on_cpus_and_cuda_gpus(device, fused):
    [adamw] = make_optimizers(tiny_model(), TrainConfig(), Runtime(device, torch.float32))
    assert bool(adamw.defaults["fused"]) == fused


def test_with_muon_the_blocks_matrices_go_to_muon_and_the_rest_to_adamw():
    model = tiny_model()
    cfg = TrainConfig(optimizer="muon", weight_decay=0.3, lr=0.004, muon_lr=0.05)
    adamw, muon = make_optimizers(model, cfg, Runtime("cpu", torch.float32))
    hidden = {
        n for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("transformer.h.")
    }
    assert len(hidden) == 8  # c_attn, attn.c_proj, c_fc, mlp.c_proj in each of 2 blocks
    assert isinstance(muon, Muon) and len(muon.param_groups) == 1
    [group] = muon.param_groups
    assert names(model, group["params"]) == hidden
    assert (group["lr"], group["weight_decay"], group["momentum"]) == (0.05, 0.3, 0.95)
    assert muon.dtype == torch.float32  # the run's autocast dtype, not its bfloat16 default
    decay, no_decay = adamw.param_groups
    assert names(model, decay["params"]) == {"transformer.wte.weight", "transformer.wpe.weight"}
    assert decay["weight_decay"] == 0.3 and decay["lr"] == 0.004
    vectors = {n for n, p in model.named_parameters() if p.dim() == 1}
    assert names(model, no_decay["params"]) == vectors and no_decay["weight_decay"] == 0.0


def test_muon_under_adamw_makes_no_muon():
    model = tiny_model()
    assert len(make_optimizers(model, TrainConfig(), Runtime("cpu", torch.bfloat16))) == 1


SHAPES = [(48, 16), (16, 48), (48, 16), (32, 32)]  # a tall pair orthogonalized together, a wide one


def muon_vs_torch(ours_kw: dict, torch_kw: dict, steps: int = 3) -> float:
    """Three steps of ours and of torch.optim.Muon on the same weights and gradients: the largest
    difference of the weights, relative to how far torch's moved."""
    gen = torch.Generator().manual_seed(0)
    ours = [torch.randn(s, generator=gen) for s in SHAPES]
    theirs = [p.clone() for p in ours]
    start = [p.clone() for p in ours]
    opts = [
        Muon(ours, **ours_kw),
        torch.optim.Muon(theirs, nesterov=True, adjust_lr_fn="original", ns_steps=4, **torch_kw),
    ]
    for _ in range(steps):
        grads = [torch.randn(s, generator=gen) * 1e-2 for s in SHAPES]
        for params, opt in zip((ours, theirs), opts):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
    return max(((a - b).norm() / (b - p0).norm()).item() for a, b, p0 in zip(ours, theirs, start))


def test_muon_takes_torch_optim_muons_steps():
    """Our momentum buffer is torch's / (1 - momentum), a scale that orthogonalizing removes: with
    momentum 0.75 the scale is a power of two, so that bfloat16 rounds both alike."""
    settings = dict(lr=0.05, momentum=0.75, weight_decay=0.1)
    assert muon_vs_torch(settings, settings) < 1e-3
    # the same tolerance tells a slightly other momentum, or no weight decay, apart
    assert muon_vs_torch(settings, {**settings, "momentum": 0.8}) > 1e-2
    assert muon_vs_torch({**settings, "weight_decay": 0.0}, settings) > 1e-2


def test_muons_defaults_are_torchs_usual_values():
    """lr 0.02, momentum 0.95, no weight decay: within bfloat16's rounding (1.2% measured) of
    torch's steps, where momentum 0.9 is 4.7% away."""
    assert muon_vs_torch({}, dict(lr=0.02, momentum=0.95, weight_decay=0.0)) < 0.025
    assert muon_vs_torch({}, dict(lr=0.02, momentum=0.9, weight_decay=0.0)) > 0.035


def test_muon_leaves_parameters_without_a_gradient_alone():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 4, generator=gen), torch.randn(8, 4, generator=gen)
    before = b.clone()
    opt = Muon([a, b], weight_decay=0.1)
    a.grad = torch.randn(8, 4, generator=gen)
    opt.step()
    assert torch.equal(b, before) and b not in opt.state and a in opt.state


@pytest.mark.parametrize("shape", [(2, 48, 16), (2, 16, 48), (1, 32, 32)])
def test_orthogonalize_brings_every_singular_value_near_one_keeping_the_directions(shape):
    """Newton-Schulz maps each singular value s of G / |G| by f(x) = a x + b x^3 + c x^5, four
    times, and keeps the singular vectors: U V^T, up to the band [0.68, 1.14] f leaves."""
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    o = orthogonalize(g, torch.float32)
    assert o.shape == g.shape and o.dtype == torch.float32
    s = torch.linalg.svdvals(o)
    assert 0.65 < s.min() and s.max() < 1.2
    x = torch.linalg.svdvals(g.double()) / (g.double().norm(dim=(-2, -1), keepdim=True)[..., 0])
    for _ in range(4):
        x = 3.4445 * x - 4.7750 * x**3 + 2.0315 * x**5
    # f is not monotonic on [0, 1]: compare the values sorted
    assert torch.allclose(s.double(), x.sort(descending=True).values, atol=2e-5)
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    rotated = u.mT @ o @ vh.mT  # diagonal when o has g's singular vectors
    off = rotated - torch.diag_embed(torch.diagonal(rotated, dim1=-2, dim2=-1))
    assert off.abs().max() < 1e-5


def test_orthogonalize_in_bfloat16_returns_the_input_dtype_and_stays_in_the_band():
    g = torch.randn(2, 48, 16, generator=torch.Generator().manual_seed(1))
    o = orthogonalize(g, torch.bfloat16)
    assert o.dtype == torch.float32
    s = torch.linalg.svdvals(o)
    assert 0.6 < s.min() and s.max() < 1.25
    assert (o - orthogonalize(g, torch.float32)).abs().max() > 0  # it did run in bfloat16
