"""training/optim.py: the learning-rate schedule's values, which parameters decay, Muon against torch's."""

import math
from dataclasses import replace

import pytest
import torch

from configs import load_config
from model import GPT, GPTConfig
from training.optim import Muon, configure_optimizer, lr_multiplier, orthogonalize, set_lr


def test_lr_schedules():
    cfg = load_config("tiny", ["--max-iters", "100", "--warmup-iters", "10", "--lr", "1", "--min-lr", "0.1"])
    lrs = [lr_multiplier(s, (s - 10) / 90, cfg) for s in range(120)]
    assert lrs[0] < lrs[9] < 1 and lrs[10] == pytest.approx(1) and lrs[100:] == [0.1] * 20
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # cosine never goes back up
    wsd = replace(cfg, lr_schedule="wsd", decay_frac=0.2)
    assert [lr_multiplier(s, (s - 10) / 90, wsd) for s in (10, 80, 82)] == [1, 1, 1]
    assert lr_multiplier(91, 0.9, wsd) == pytest.approx(0.55)



def test_lr_multipliers_exactly():
    cfg = load_config("tiny", ["--warmup-iters", "4", "--lr", "1", "--min-lr", "0.1"])
    # warmup: (step + 1) / (warmup + 1), so the first step already learns and the peak follows warmup
    assert [lr_multiplier(s, 0.0, cfg) for s in range(5)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    cosine = [lr_multiplier(9, p, cfg) for p in (-0.5, 0.0, 0.25, 0.5, 1.0, 1.5)]  # progress clamped to [0, 1]
    assert cosine == pytest.approx([1.0, 1.0, 0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2, 0.55, 0.1, 0.1])
    wsd = replace(cfg, lr_schedule="wsd", decay_frac=0.2)
    assert [lr_multiplier(9, p, wsd) for p in (0.0, 0.8, 0.9, 1.0, 2.0)] == pytest.approx([1.0, 1.0, 0.55, 0.1, 0.1])
    assert [lr_multiplier(9, p, replace(cfg, lr_schedule="constant")) for p in (0.0, 1.0)] == [1.0, 1.0]
    assert lr_multiplier(9, 1.0, replace(cfg, lr=0.0, min_lr=0.0)) == 0.0  # lr 0: no 0 / 0



@pytest.mark.parametrize("recipe", ["adamw", "muon"])
def test_weight_decay_goes_to_matrices_only(recipe):
    muon = ["--muon-lr", "0.05", "--muon-momentum", "0.9"] if recipe == "muon" else []  # refused under adamw
    cfg = load_config("tiny", ["--optimizer", recipe, "--weight-decay", "0.3", "--lr", "0.004", "--beta1", "0.8",
                               "--beta2", "0.95", *muon])
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16, bias=True))
    opt = configure_optimizer(model, cfg, fused=False)
    name = {id(p): n for n, p in model.named_parameters()}
    groups = [(g["weight_decay"], g["lr"], {name[id(p)] for p in g["params"]}) for g in opt.param_groups]
    matrices = {n for n, p in model.named_parameters() if p.dim() == 2}
    vectors = {n for n, p in model.named_parameters() if p.dim() < 2}  # biases, norm weights
    assert vectors and all(n.endswith(("bias", "weight")) for n in vectors)
    hidden = {n for n in matrices if n.startswith("transformer.h.")} if recipe == "muon" else set()
    assert groups[:2] == [(0.3, 0.004, matrices - hidden), (0.0, 0.004, vectors)]  # AdamW's
    assert groups[2:] == ([(0.3, 0.05, hidden)] if hidden else [])  # Muon's
    adam = opt.optimizers[0]
    assert adam.defaults["betas"] == (0.8, 0.95) and all(g["base_lr"] == g["lr"] for g in opt.param_groups)
    assert recipe == "adamw" or opt.optimizers[1].defaults["momentum"] == 0.9
    set_lr(opt, 0.5)
    assert [g["lr"] for g in opt.param_groups] == [0.002, 0.002] + ([0.025] if hidden else [])



def test_muon_optimizer_trains_and_orthogonalizes():
    assert Muon([torch.zeros(2, 3, requires_grad=True)]).defaults == dict(  # the usual values
        lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.0)
    g = torch.randn(48, 16, generator=torch.Generator().manual_seed(0))
    o = orthogonalize(g, dtype=torch.float32)
    s = torch.linalg.svdvals(o)
    assert o.shape == g.shape and s.min() > 0.6 and s.max() < 1.25  # all directions move alike
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16))
    opt = configure_optimizer(model, load_config("tiny", ["--optimizer", "muon"]), fused=True)
    muon = [o for o in opt.optimizers if isinstance(o, Muon)][0]
    assert {id(p) for p in muon.param_groups[0]["params"]} == {
        id(p) for n, p in model.named_parameters() if n.startswith("transformer.h.") and p.dim() == 2}
    assert muon.param_groups[0]["weight_decay"] == load_config("tiny").weight_decay > 0  # decayed like AdamW's matrices
    with pytest.raises(ValueError):  # an AdamW-only state (another --optimizer) does not fit AdamW + Muon
        opt.load_state_dict({"chain": opt.state_dict()["chain"][:1]})
    # Newton-Schulz in the run's dtype: emulated bf16 (an AVX2 CPU) is 30-50x slower than float32
    assert muon.ns_dtype == torch.float32
    assert configure_optimizer(model, load_config("tiny", ["--optimizer", "muon"]), fused=True,
                               dtype=torch.bfloat16).optimizers[1].ns_dtype == torch.bfloat16
    x = torch.randint(0, 11, (4, 8), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(30):
        loss = model(x, x)[1]
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert losses[-1] < 0.8 * losses[0]
    state = opt.state_dict()
    again = configure_optimizer(model, load_config("tiny", ["--optimizer", "muon"]), fused=True)
    again.load_state_dict(state)
    assert torch.equal(again.optimizers[1].state[muon.param_groups[0]["params"][0]]["momentum_buffer"],
                       muon.state[muon.param_groups[0]["params"][0]]["momentum_buffer"])



def test_muon_takes_the_steps_of_torch_optim_muon():
    """Ours batches the Newton-Schulz iteration over same-shape matrices; the rule is torch's."""
    gen = torch.Generator().manual_seed(0)
    ours = [torch.randn(s, generator=gen) for s in [(48, 16), (16, 48), (48, 16)]]
    theirs = [p.clone() for p in ours]
    opts = [Muon(ours, lr=0.02), torch.optim.Muon(theirs, lr=0.02, weight_decay=0.0)]
    start = [p.clone() for p in ours]
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=gen) for p in ours]
        for params, opt in zip((ours, theirs), opts):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
    for a, b, p0 in zip(ours, theirs, start):  # both orthogonalize in bf16: a few % apart, not O(1)
        assert (a - b).norm() < 0.05 * (b - p0).norm()


def test_shakespeare_gpu_schedule_warms_up_holds_then_decays_to_zero_at_its_last_step():
    """The GPU recipe measured on an H100 (docs/gpu.md): 100 warmup steps, the peak until 20% of the
    rest is done, then linear to 0 at step 1000."""
    from train import schedule_progress

    cfg = load_config("shakespeare_gpu")
    lr = {s: lr_multiplier(s, schedule_progress(s, cfg, None), cfg) for s in (0, 99, 100, 280, 640, 999, 1000)}
    assert (cfg.optimizer, cfg.max_iters, cfg.lr, cfg.muon_lr, cfg.min_lr) == ("muon", 1000, 2e-2, 0.02, 0.0)
    assert lr[0] == pytest.approx(1 / 101) and lr[99] == pytest.approx(100 / 101)
    assert lr[100] == pytest.approx(1.0) and lr[280] == pytest.approx(1.0) and lr[640] == pytest.approx(0.5)
    assert lr[1000] == pytest.approx(0.0, abs=1e-12)
    assert 0 < lr[999] < 0.002
