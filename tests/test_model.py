"""The model package: shapes, causality, fast path == reference paths, masks, cache, init."""

import dataclasses
import math

import pytest
import torch

from configs.errors import UserError
from model import GPT, GPTConfig, MultiHeadAttention
from model.attention import CausalSelfAttention
from model.trace import attention_weights, hidden_states

V = 37
GPT2_ARCH: dict = {}
MODERN = dict(pos_emb="rope", norm="rmsnorm", bias=False, activation="relu2", qk_norm=True, tie_weights=False)
VARIANTS = pytest.mark.parametrize("arch", [GPT2_ARCH, MODERN], ids=["gpt2", "modern"])


def tiny(**kw) -> GPTConfig:
    return GPTConfig(**{**dict(vocab_size=V, block_size=24, n_layer=2, n_head=2, n_embd=16), **kw})


def make(seed: int = 0, **kw) -> GPT:
    torch.manual_seed(seed)
    return GPT(tiny(**kw)).eval()


def with_attention(model: GPT, impl: str) -> GPT:
    """The same weights under the other attention implementation."""
    other = GPT(dataclasses.replace(model.config, attention=impl)).eval()
    other.load_state_dict(model.state_dict())
    return other


def ids(B=3, T=16, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kw", [dict(n_embd=15), dict(n_layer=0), dict(pos_emb="alibi"), dict(dropout=1.5)])
def test_config_rejects_bad_values_with_one_clear_line(kw):
    with pytest.raises(UserError) as e:
        tiny(**kw)
    assert "\n" not in str(e.value) and str(e.value).startswith("model config:")


@pytest.mark.parametrize("bad, good", [
    (dict(vocab_size=0), dict(vocab_size=1)), (dict(block_size=True), dict(block_size=1)),
    (dict(n_layer=1.0), dict(n_layer=1)), (dict(mlp_ratio=-1), dict(mlp_ratio=1)),
    (dict(n_head=3), dict(n_head=4)), (dict(n_head=16, pos_emb="rope"), dict(n_head=8, pos_emb="rope")),
    (dict(dropout=-0.01), dict(dropout=0.0)), (dict(dropout=1.0), dict(dropout=0.999)),
    (dict(norm="batchnorm"), dict(norm="rmsnorm")), (dict(activation="relu"), dict(activation="relu2")),
    (dict(attention="flash"), dict(attention="explicit"))])
def test_config_draws_each_line_exactly(bad, good):
    with pytest.raises(UserError, match=f"model config: {next(iter(bad))}|n_embd \\(16\\) must be divisible|rope needs"):
        tiny(**bad)
    tiny(**good)


def test_config_defaults_are_gpt2_small():
    assert GPTConfig().to_dict() == dict(
        vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768, dropout=0.0, bias=True,
        pos_emb="learned", norm="layernorm", activation="gelu", qk_norm=False, tie_weights=True, mlp_ratio=4,
        norm_eps=1e-5, rope_base=10000.0, attention="sdpa")


def test_config_dict_round_trip():
    c = tiny(**MODERN)
    assert GPTConfig.from_dict({**c.to_dict(), "unknown_future_field": 1}) == c


@pytest.mark.parametrize("activation, reference", [("gelu", torch.nn.GELU("tanh")), ("gelu_exact", torch.nn.GELU()),
                                                    ("relu2", lambda h: torch.relu(h) ** 2)])
def test_mlp_activation_is_the_one_named(activation, reference):
    mlp = make(activation=activation).transformer.h[0].mlp
    seen = []
    mlp.c_proj.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    x = 30 * torch.randn(2, 5, 16)  # pre-activations of order 1, where the GELU forms differ by ~1e-3
    mlp(x)
    torch.testing.assert_close(seen[0], reference(mlp.c_fc(x)))


@VARIANTS
def test_shapes_and_loss(arch):
    m = make(**arch)
    x = ids()
    logits, loss = m(x)
    assert logits.shape == (3, 16, V) and loss is None
    logits, loss = m(x, x)
    assert loss.ndim == 0


@VARIANTS
@pytest.mark.parametrize("impl", ["sdpa", "explicit"])
def test_changing_a_future_token_leaves_earlier_logits_unchanged(arch, impl):
    m = with_attention(make(**arch), impl)
    x = ids(B=2, T=12)
    t = 6
    y = x.clone()
    y[:, t + 1] = (y[:, t + 1] + 1) % V
    a, b = m(x)[0], m(y)[0]
    assert torch.equal(a[:, : t + 1], b[:, : t + 1])
    assert not torch.allclose(a[:, t + 1], b[:, t + 1])  # the change is visible where it should be


@VARIANTS
def test_explicit_path_equals_sdpa(arch):
    m = make(**arch)
    x = ids()
    pad = torch.ones_like(x, dtype=torch.bool)
    pad[0, :5] = False
    for kwargs in ({}, {"padding_mask": pad}):
        fast = m(x, **kwargs)[0]
        slow = with_attention(m, "explicit")(x, **kwargs)[0]
        torch.testing.assert_close(fast, slow, atol=1e-5, rtol=0)


def test_fused_attention_equals_modulelist_of_heads():
    torch.manual_seed(0)
    attn = CausalSelfAttention(tiny(n_head=4)).eval()
    ref = MultiHeadAttention.from_fused(attn).eval()
    assert len(ref.heads) == 4
    x = torch.randn(2, 10, 16)
    torch.testing.assert_close(attn(x), ref(x), atol=1e-6, rtol=0)


@VARIANTS
def test_left_padding_gives_the_same_logits_as_no_padding(arch):
    m = make(**arch)
    x = ids(B=2, T=10)
    padded = torch.cat([torch.zeros(2, 4, dtype=torch.long), x], dim=1)
    mask = torch.cat([torch.zeros(2, 4, dtype=torch.bool), torch.ones(2, 10, dtype=torch.bool)], dim=1)
    out = m(padded, padding_mask=mask)[0]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:, 4:], m(x)[0], atol=1e-5, rtol=0)


def test_padding_mask_hides_keys_in_attention_module():
    torch.manual_seed(0)
    attn = CausalSelfAttention(dataclasses.replace(tiny(), attention="explicit")).eval()
    x = torch.randn(2, 8, 16)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, :3] = False
    w = attention_weights(attn, x, padding_mask=mask)[1][0]
    assert w.shape == (2, 2, 8, 8)
    assert torch.all(w[1, :, 3:, :3] == 0)  # real queries never look at padding
    assert torch.all(w.triu(1) == 0)  # nor at the future
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 8))


@VARIANTS
def test_kv_cache_prefill_then_one_token_at_a_time_equals_full_forward(arch):
    from model import KVCache

    m = make(**arch)
    x = ids(B=2, T=20)
    full = m(x)[0]
    cache = KVCache(m.config, 2, m.config.block_size, "cpu", torch.float32)
    steps = [m(x[:, :8], kv_cache=cache)[0]]
    for t in range(8, 20):
        steps.append(m(x[:, t : t + 1], kv_cache=cache)[0])
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)


def test_hidden_states_shape_and_last_is_the_input_of_ln_f():
    m = make()
    x = ids()
    seen = {}
    m.transformer.ln_f.register_forward_hook(lambda mod, inp, out: seen.setdefault("x", inp[0]))
    hidden = hidden_states(m, x)
    assert hidden.shape == (m.config.n_layer + 1, 3, 16, 16)
    assert torch.equal(hidden[-1], seen["x"])
    torch.testing.assert_close(hidden[0], m.transformer.wte(x) + m.transformer.wpe(torch.arange(16)))


def test_attention_weights_returned_per_layer():
    m = make()  # SDPA, which forms no weights: the explicit path runs for this call only
    logits, att = attention_weights(m, ids())
    assert len(att) == 2 and att[0].shape == (3, 2, 16, 16)
    torch.testing.assert_close(logits[0], m(ids())[0], atol=1e-5, rtol=0)
    assert all(block.attn.use_sdpa for block in m.transformer.h)


def test_mask_buffers_stay_out_of_the_state_dict():
    m = make(**MODERN)
    names = {n for n, _ in m.named_buffers()}
    assert any("causal_mask" in n for n in names) and any("rotary" in n for n in names)
    assert not names & set(m.state_dict())
    assert m.transformer.h[0].attn.causal_mask.dtype == torch.bool
    assert torch.equal(m.transformer.h[0].attn.causal_mask, torch.triu(torch.ones(24, 24, dtype=torch.bool), 1))


@VARIANTS
def test_initial_loss_is_close_to_uniform(arch):
    m = make(**{**arch, "vocab_size": 500, "n_embd": 32})
    x, y = torch.randint(0, 500, (2, 8, 24))
    loss = m(x, y)[1].item()  # targets unrelated to inputs: a tied head favours the input token itself
    assert abs(loss - math.log(500)) < 0.1


def test_init_scales_residual_projections():
    m = make(n_layer=8, n_embd=64, n_head=4)
    std = lambda p: p.std().item()
    assert abs(std(m.transformer.h[0].mlp.c_fc.weight) - 0.02) < 0.002
    assert abs(std(m.transformer.h[0].mlp.c_proj.weight) - 0.02 / 4) < 0.0003  # 1/sqrt(2 * 8), not 1/sqrt(3 * 8)
    assert abs(std(m.transformer.h[0].attn.c_proj.weight) - 0.02 / 4) < 0.0003
    assert m.lm_head.weight is m.transformer.wte.weight


def test_init_centres_every_weight_on_zero_and_zeroes_the_biases():
    m = make(n_layer=2, n_embd=64, n_head=4, bias=True)
    for name, p in m.named_parameters():
        if name.endswith("bias"):
            assert (p == 0).all(), name
        elif p.dim() == 2:  # Linear and Embedding weights; the norms' weights start at one
            assert abs(p.mean().item()) < 0.002 and 0.001 < p.std().item() < 0.03, name


def test_ignore_index_leaves_padding_out_of_the_loss():
    m = make()
    x = ids(B=1, T=10)
    t = x.clone()
    t[:, 5:] = -1
    logits = m(x)[0]
    expected = torch.nn.functional.cross_entropy(logits[0, :5], x[0, :5])
    torch.testing.assert_close(m(x, t)[1], expected)


def test_num_params_and_flops_for_gpt2_small():
    with torch.device("meta"):  # shapes only: no 0.5 GB to allocate and initialise
        m = GPT(GPTConfig())  # GPT-2 124M
    assert m.num_params() == 124_439_808
    assert m.num_params(non_embedding=True) == 124_439_808 - 1024 * 768
    # 6 * (matmul weights incl. lm_head) + 12 * L * C * T
    per_layer = 12 * 768 * 768  # c_attn 3C^2 + c_proj C^2 + c_fc 4C^2 + mlp.c_proj 4C^2
    assert m.flops_per_token() == 6 * (12 * per_layer + 768 * 50257) + 12 * 12 * 768 * 1024


def test_sequence_longer_than_block_size_is_refused():
    with pytest.raises(ValueError, match="block_size"):
        make()(torch.zeros(1, 25, dtype=torch.long))


def test_shape_trace_walks_from_ids_to_logits():
    from model.trace import shape_trace

    m = make(**MODERN)
    text = shape_trace(m, batch_size=2, seq_len=5)
    lines = text.splitlines()
    assert "input idx (2, 5)" in text
    assert any(l.split()[0] == "wte" and "(2, 5, 16)" in l for l in lines)
    assert "(B, T, C) -> (B, nh, T, hs) = (2, 2, 5, 8)" in text
    assert any(l.split()[0] == "h.1" and "(2, 5, 16)" in l for l in lines)
    assert lines[-1].startswith("logits (2, 5, 37)")


TRACE = """\
GPT: 1,912 parameters, 2 layers, 2 heads of size 4, n_embd 8, vocab 11, block 8
input idx (1, 8) token ids
module                             type                   output shape                 params
wte                                Embedding              (1, 8, 8)                        88
wpe                                Embedding              (1, 8, 8)                        64
    h.0.ln_1                       LayerNorm              (1, 8, 8)                        16
      h.0.attn.c_attn              Linear                 (1, 8, 24)                      216
        split q, k, v; heads (B, T, C) -> (B, nh, T, hs) = (1, 2, 8, 4)
      h.0.attn.c_proj              Linear                 (1, 8, 8)                        72
    h.0.attn                       CausalSelfAttention    (1, 8, 8)                       288
    h.0.ln_2                       LayerNorm              (1, 8, 8)                        16
      h.0.mlp.c_fc                 Linear                 (1, 8, 32)                      288
      h.0.mlp.c_proj               Linear                 (1, 8, 8)                       264
    h.0.mlp                        MLP                    (1, 8, 8)                       552
  h.0                              Block                  (1, 8, 8)                       872
  h.1                              Block                  (1, 8, 8)                       872
ln_f                               LayerNorm              (1, 8, 8)                        16
lm_head                            Linear                 (1, 8, 11)                       88
logits (1, 8, 11): one score per vocabulary entry at every position"""


def test_shape_trace_prints_this_table():
    from model.trace import shape_trace

    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8, bias=True))
    assert shape_trace(model) == TRACE  # defaults: one row of block_size tokens, block 0 in detail
    with torch.device("meta"):  # shapes only: GPT-2 XL's walk needs no memory
        assert shape_trace(GPT(model.config)) == TRACE
    detailed = shape_trace(model, blocks_in_detail=2).splitlines()
    assert len(detailed) == len(TRACE.splitlines()) + 9 and "      h.1.mlp.c_fc " in "\n".join(detailed)


def test_rotary_turns_each_pair_by_position_times_its_frequency():
    from model.layers import Rotary, apply_rotary

    hs, T = 8, 5
    x = torch.randn(2, 3, T, hs, generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([[0, 1, 2, 3, 4], [4, 0, 3, 1, 2]])
    got = apply_rotary(x, *Rotary(hs, T, base=100.0)(pos))
    # reference: the halves as one complex number, times e^(i pos theta_j), theta_j = base^(-2j / hs)
    theta = 100.0 ** (-torch.arange(0, hs, 2, dtype=torch.float64) / hs)
    turn = torch.polar(torch.ones(2, 1, T, hs // 2, dtype=torch.float64), pos[:, None, :, None] * theta)
    z = torch.complex(x[..., : hs // 2].double(), x[..., hs // 2 :].double()) * turn
    torch.testing.assert_close(got, torch.cat([z.real, z.imag], -1).float())
    assert apply_rotary(x.bfloat16(), *Rotary(hs, T, 100.0)(pos)).dtype == torch.bfloat16  # stays in bf16


def test_rmsnorm_is_x_over_its_root_mean_square_times_weight():
    from model.layers import make_norm

    x = 1e-3 * torch.randn(3, 8, generator=torch.Generator().manual_seed(0))  # small: eps 1e-5 matters
    norm = make_norm(GPTConfig(norm="rmsnorm", norm_eps=1e-5), 8)
    with torch.no_grad():
        norm.weight.copy_(torch.arange(1.0, 9.0))
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * torch.arange(1.0, 9.0)
    torch.testing.assert_close(norm(x), expected)


def test_multi_head_attention_options():
    torch.manual_seed(0)
    plain = MultiHeadAttention(num_heads=2, emb_size=8, head_size=4, bias=False)
    assert all(p.dim() == 2 for p in plain.parameters())  # bias=False: no bias anywhere
    mha = MultiHeadAttention(num_heads=2, emb_size=8, head_size=4).train()  # defaults: biases, no dropout
    assert sum(p.dim() == 1 for p in mha.parameters()) == 2 * 3 + 1
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(mha(x), mha(x))
    assert mha(x).abs().min() > 0
    one_key = torch.randn(2, 1, 8)  # a (Tq, Tk) mask with Tk = 1 is still (Tq, Tk)
    torch.testing.assert_close(mha(x, one_key, mask=torch.ones(5, 1, dtype=torch.bool)), mha(x, one_key))
    with pytest.raises(ValueError, match="mask is bool or 0/1 float"):
        mha(x, mask=torch.ones(2, 5, 5, dtype=torch.bool))  # 3-D: neither write-up's shape
    # a mask and valid lengths together: a key hidden by either stays hidden
    mask = torch.ones(5, 5, dtype=torch.bool)
    mask[:, 0] = False
    both = mha(x, mask=mask, valid_lens=torch.tensor([3, 5]))
    keep = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    keep[:, :, :, 0] = False
    keep[0, :, :, 3:] = False
    torch.testing.assert_close(both, mha(x, mask=keep))


def test_lengths_become_a_mask_on_their_own_device():
    from model.attention import lengths_to_mask

    assert lengths_to_mask(torch.tensor([2, 0]), 3).tolist() == [[True, True, False], [False, False, False]]
    assert lengths_to_mask(torch.tensor([2, 0], device="meta"), 3).device.type == "meta"


def test_kv_cache_lives_on_the_device_and_dtype_it_is_given():
    from model import KVCache

    cache = KVCache(tiny(n_layer=2), batch_size=2, max_len=8, device="meta", dtype=torch.float16)
    tensors = [*cache.k, *cache.v, cache.mask, cache.claim(3)]
    assert {t.device.type for t in tensors} == {"meta"} and cache.pos == 3 and cache.max_len == 8
    assert [t.dtype for t in tensors] == [torch.float16] * 4 + [torch.bool, torch.long]
    assert [tuple(t.shape) for t in tensors[:5]] == [(2, 2, 8, 8)] * 4 + [(2, 8)]


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_positions_reach_the_logits(pos_emb):
    """Without positions, attention sees a prefix as a bag of tokens: "aba" and "baa" would end in
    the same logits (one layer: a causal stack of several tells them apart by itself). Learned
    positions and rotary ones tell them apart."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=8, block_size=8, n_layer=1, n_head=2, n_embd=16, pos_emb=pos_emb)).eval()
    with torch.no_grad():
        for p in model.parameters():  # sharper than the 0.02 init, so attention is far from uniform
            if p.dim() == 2:
                p.normal_(0.0, 0.5)
        logits = model(torch.tensor([[1, 2, 1], [2, 1, 1]]))[0][:, -1]
    assert (logits[0] - logits[1]).abs().max() > 1e-2


@pytest.mark.parametrize("impl", ["sdpa", "explicit"])
def test_attention_dropout_acts_while_training_only(impl):
    """The attention weights' own dropout, on either path (the output's dropout taken away)."""
    torch.manual_seed(0)
    attn = CausalSelfAttention(dataclasses.replace(tiny(), attention=impl, dropout=0.5))
    attn.resid_dropout = torch.nn.Identity()
    x = torch.randn(2, 8, 16)
    assert not torch.allclose(attn.train()(x), attn(x))  # two draws of the mask
    torch.testing.assert_close(attn.eval()(x), attn(x))


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_the_switches_build_what_they_name(norm):
    """--no-bias leaves no bias anywhere; the norm is the one named, with the config's eps."""
    from torch.nn import RMSNorm

    model = GPT(GPTConfig(vocab_size=8, block_size=8, n_layer=1, n_head=2, n_embd=16, bias=False, norm=norm,
                          norm_eps=1e-3, qk_norm=True))
    assert [n for n, _ in model.named_parameters() if n.endswith("bias")] == []
    norms = [m for n, m in model.named_modules() if isinstance(m, (torch.nn.LayerNorm, RMSNorm)) and ".attn." not in n]
    assert len(norms) == 3 and all(type(m) is (RMSNorm if norm == "rmsnorm" else torch.nn.LayerNorm) for m in norms)
    attn = model.transformer.h[0].attn
    assert isinstance(attn.q_norm, RMSNorm) and isinstance(attn.k_norm, RMSNorm)  # qk_norm: per head, always RMS
    assert all(m.eps == 1e-3 for m in [*norms, attn.q_norm, attn.k_norm])


def test_a_query_with_no_key_to_see_gets_0_on_both_paths():
    """A cached step whose one token is row 0's padding, with nothing real cached before it: that
    query's attention is 0 (SDPA's safe softmax; the explicit path follows), so its output is
    c_proj's bias, and a loss over the other rows has finite gradients, equal on both paths.
    (Cross-attention's empty context is MultiHeadAttention's: test_attention_writeups.py.)"""
    from model import KVCache

    torch.manual_seed(0)
    x = torch.randn(2, 1, 16)
    outs, grads = [], []
    for impl in ("sdpa", "explicit"):
        torch.manual_seed(1)
        attn = CausalSelfAttention(dataclasses.replace(tiny(), attention=impl)).eval()
        with torch.no_grad():
            attn.c_proj.bias.normal_()  # not 0, so that the output shows it
        cache = KVCache(tiny(n_layer=1), 2, 8, "cpu", torch.float32)
        cache.begin(cache.claim(1), torch.tensor([[False], [True]]))
        y = attn(x, kv_cache=cache)
        torch.testing.assert_close(y[0], attn.c_proj.bias.expand_as(y[0]), atol=1e-6, rtol=0)
        y[1].square().sum().backward()  # the real rows only
        assert all(p.grad.isfinite().all() for p in attn.parameters())
        outs.append(y.detach())
        grads.append([p.grad for p in attn.parameters()])
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)
    for fast, slow in zip(*grads):
        torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-4)
