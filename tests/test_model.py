"""The GPT of model/gpt.py: shapes, loss, causality, masks, the KV cache, init, and its shape walk.

The logits are checked against `reference_forward`, a forward pass spelled out here from the
model's weights (rotary as complex numbers), and the fused attention against the write-ups'
ModuleList of heads (MultiHeadAttention.from_fused).
"""

import math
from dataclasses import asdict, replace

import pytest
import torch
import torch.nn.functional as F

from model import gpt
from model.gpt import GPT, CausalSelfAttention, GPTConfig, KVCache, rotate
from model.textbook import MultiHeadAttention

V = 37
BOTH_PATHS = pytest.mark.parametrize("attention", ["sdpa", "explicit"])
BOTH_POS = pytest.mark.parametrize("pos_emb", ["learned", "rope"])


def config(**kw) -> GPTConfig:
    return GPTConfig(**dict(vocab_size=V, block_size=24, n_layer=2, n_head=2, n_embd=16) | kw)


def make(seed: int = 0, scale: float | None = 0.3, **kw) -> GPT:
    """A tiny GPT in eval mode; every parameter redrawn at `scale` (norms and biases too, so that
    each one shows in the logits), or GPT-2's init with scale=None."""
    torch.manual_seed(seed)
    model = GPT(config(**kw)).eval()
    if scale is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, scale)
    return model


def with_config(model: GPT, **kw) -> GPT:
    """The same weights in a model built with other settings (attention, dropout)."""
    other = GPT(replace(model.config, **kw)).eval()
    other.load_state_dict(model.state_dict())
    return other


def ids(B=3, T=16, seed=1) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def linear(x, layer):
    return x @ layer.weight.T + (0 if layer.bias is None else layer.bias)


def turn(x, pos):
    """Rotary by definition: each pair (x[j], x[j + hs/2]) as a complex number, times
    e^(i pos theta_j), theta_j = 10000^(-2j/hs). x (B, T, hs), pos (T,) or (B, T)."""
    hs = x.size(-1)
    theta = 10000.0 ** (-torch.arange(0, hs, 2, dtype=torch.float64) / hs)  # (hs/2,)
    angle = pos.double()[..., None] * theta  # (T, hs/2) or (B, T, hs/2)
    z = torch.complex(x[..., : hs // 2].double(), x[..., hs // 2 :].double())
    z = z * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)


def gelu(h, activation):
    if activation == "gelu":  # GPT-2's tanh approximation
        return 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
    return 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))


def reference_forward(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """idx (B, T) -> logits (B, T, V), a head at a time, from the model's weights."""
    c, tr = model.config, model.transformer
    T, C, hs = idx.size(1), c.n_embd, c.n_embd // c.n_head
    pos = torch.arange(T)

    def norm(x, ln):
        return F.layer_norm(x, (C,), ln.weight, ln.bias, eps=1e-5)

    x = tr.wte.weight[idx]
    if c.pos_emb == "learned":
        x = x + tr.wpe.weight[:T]
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    for block in tr.h:
        q, k, v = linear(norm(x, block.ln_1), block.attn.c_attn).split(C, dim=-1)
        heads = []
        for h in range(c.n_head):
            qh, kh, vh = (t[..., h * hs : (h + 1) * hs] for t in (q, k, v))
            if c.pos_emb == "rope":
                qh, kh = turn(qh, pos), turn(kh, pos)
            scores = (qh @ kh.transpose(-2, -1) / math.sqrt(hs)).masked_fill(future, -math.inf)
            heads.append(scores.softmax(-1) @ vh)
        x = x + linear(torch.cat(heads, dim=-1), block.attn.c_proj)
        h = gelu(linear(norm(x, block.ln_2), block.mlp.c_fc), c.activation)
        x = x + linear(h, block.mlp.c_proj)
    return norm(x, tr.ln_f) @ model.lm_head.weight.T


@BOTH_POS
@BOTH_PATHS
@pytest.mark.parametrize("activation", ["gelu", "gelu_exact"])
def test_logits_equal_the_forward_pass_spelled_out(pos_emb, attention, activation):
    m = make(pos_emb=pos_emb, attention=attention, activation=activation)
    x = ids()
    logits, loss = m(x)
    assert logits.shape == (3, 16, V) and loss is None
    torch.testing.assert_close(logits, reference_forward(m, x), atol=2e-5, rtol=1e-5)


def test_untied_and_biasless_models_equal_the_forward_pass_spelled_out():
    m = make(tie_weights=False, bias=False, pos_emb="rope")
    assert m.lm_head.weight is not m.transformer.wte.weight
    x = ids()
    torch.testing.assert_close(m(x)[0], reference_forward(m, x), atol=2e-5, rtol=1e-5)


def test_config_defaults_are_gpt2_smalls():
    assert asdict(GPTConfig()) == dict(
        vocab_size=50257,
        block_size=1024,
        n_layer=12,
        n_head=12,
        n_embd=768,
        dropout=0.0,
        bias=True,
        pos_emb="learned",
        activation="gelu",
        tie_weights=True,
        attention="sdpa",
    )


@BOTH_PATHS
def test_attention_setting_picks_the_path_that_runs(attention, monkeypatch):
    """explicit forms the weights softmax(QK^T / sqrt(hs)) with the future at 0; sdpa calls the
    fused kernel instead."""
    m = make(attention=attention)
    fused, weights = [], []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(
        F, "scaled_dot_product_attention", lambda *a, **k: fused.append(1) or sdpa(*a, **k)
    )
    m.transformer.h[0].attn.attn_dropout.register_forward_hook(
        lambda mod, inp, out: weights.append(out)
    )
    m(ids())
    assert (len(fused), len(weights)) == ((2, 0) if attention == "sdpa" else (0, 1))
    if weights:
        w = weights[0]  # (B, nh, T, T)
        assert w.shape == (3, 2, 16, 16) and not w.triu(1).any()
        torch.testing.assert_close(w.sum(-1), torch.ones(3, 2, 16))


@pytest.mark.parametrize("chunk", [10**9, 7 * V])  # all rows at once, or 7 rows a chunk
def test_the_loss_is_the_cross_entropy_of_the_logits_and_its_gradient_too(monkeypatch, chunk):
    """The loss, a chunk of rows at a time, is the mean cross-entropy of forward's logits; a target
    of -1 is left out; its gradients are those of the plain loss."""
    monkeypatch.setattr(gpt, "LOSS_CHUNK", chunk)
    m = make()
    x, t = ids(B=2, T=10, seed=1), ids(B=2, T=10, seed=2)
    t[0, 5:], t[1, :2] = -1, -1
    loss = m(x, t)[1]
    loss.backward()
    chunked = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    logits = m(x)[0]
    kept = t != -1
    plain = F.cross_entropy(logits[kept], t[kept])
    plain.backward()
    torch.testing.assert_close(loss, plain)
    for a, p in zip(chunked, m.parameters()):
        torch.testing.assert_close(a, p.grad)


@BOTH_POS
@BOTH_PATHS
def test_changing_a_future_token_leaves_earlier_logits_unchanged(pos_emb, attention):
    m = make(pos_emb=pos_emb, attention=attention)
    x = ids(B=2, T=12)
    for t in (0, 6, 10):
        y = x.clone()
        y[:, t + 1] = (y[:, t + 1] + 1) % V
        a, b = m(x)[0], m(y)[0]
        assert torch.equal(a[:, : t + 1], b[:, : t + 1])
        assert (a[:, t + 1] - b[:, t + 1]).abs().amax() > 1e-3  # the change shows where it may


@BOTH_POS
def test_explicit_attention_equals_sdpa_with_the_same_weights(pos_emb):
    m = make(pos_emb=pos_emb)
    slow = with_config(m, attention="explicit")
    x = ids()
    torch.testing.assert_close(m(x)[0], slow(x)[0], atol=1e-5, rtol=0)


@BOTH_PATHS
@pytest.mark.parametrize("bias", [True, False])
def test_fused_attention_equals_the_modulelist_of_heads(attention, bias):
    torch.manual_seed(0)
    cfg = config(n_head=4, bias=bias, attention=attention, dropout=0.25)
    attn = CausalSelfAttention(cfg, 0).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0.0, 0.3)
    ref = MultiHeadAttention.from_fused(attn).eval()
    assert len(ref.heads) == 4 and ref.heads[0].future.shape == (24, 24)
    dropouts = [m.p for m in ref.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts == [0.25] * 5  # each head's weights, and the output
    x = torch.randn(2, 10, 16)
    torch.testing.assert_close(attn(x), ref(x), atol=1e-5, rtol=0)


@BOTH_POS
@BOTH_PATHS
def test_kv_cache_prefill_then_one_token_at_a_time_equals_the_full_forward(pos_emb, attention):
    m = make(pos_emb=pos_emb, attention=attention)
    x = ids(B=2, T=24)  # up to block_size
    cache = KVCache(m.config, 2, "cpu", torch.float32)
    steps = [m(x[:, :8], kv_cache=cache)[0]]
    assert cache.pos == 8
    for t in range(8, 24):
        steps.append(m(x[:, t : t + 1], kv_cache=cache)[0])
    assert cache.pos == 24
    torch.testing.assert_close(torch.cat(steps, dim=1), m(x)[0], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="25 positions, more than block_size 24"):
        m(x[:, :1], kv_cache=cache)


@BOTH_POS
@BOTH_PATHS
def test_kv_cache_chunks_of_several_tokens_after_cached_ones_equal_the_full_forward(
    pos_emb, attention
):
    m = make(pos_emb=pos_emb, attention=attention)
    x = ids(B=2, T=20)
    cache = KVCache(m.config, 2, "cpu", torch.float32)
    chunks = [m(x[:, a:b], kv_cache=cache)[0] for a, b in ((0, 5), (5, 6), (6, 13), (13, 20))]
    torch.testing.assert_close(torch.cat(chunks, dim=1), m(x)[0], atol=1e-5, rtol=0)


def test_kv_cache_holds_every_layers_keys_and_values_on_the_device_and_dtype_given():
    cache = KVCache(config(n_layer=3, n_head=4), 2, "meta", torch.float16)
    assert cache.k.shape == cache.v.shape == (3, 2, 4, 24, 4) and cache.pos == 0
    assert cache.k.dtype == cache.v.dtype == torch.float16
    assert cache.k.device.type == cache.v.device.type == "meta"
    cache = KVCache(config(), 1, "cpu", torch.float32)
    k, v = torch.randn(2, 1, 2, 3, 8)
    cache.pos = 5
    got_k, got_v = cache.update(1, k, v)
    assert got_k.shape == (1, 2, 8, 8) and torch.equal(got_k[:, :, 5:], k)
    assert torch.equal(got_v[:, :, 5:], v) and torch.equal(cache.v[1, :, :, 5:8], v)
    assert not cache.k[0].any() and not got_k[:, :, :5].any()  # layer 0 and earlier slots untouched


def test_a_sequence_longer_than_block_size_raises_value_error():
    m = make()
    assert m(torch.zeros(1, 24, dtype=torch.long))[0].shape == (1, 24, V)
    with pytest.raises(ValueError, match="25 positions, more than block_size 24"):
        m(torch.zeros(1, 25, dtype=torch.long))


def test_mask_and_rotary_tables_stay_out_of_the_state_dict():
    m = make(pos_emb="rope")
    buffers = {name for name, _ in m.named_buffers()}
    assert buffers == {"cos", "sin", "transformer.h.0.attn.future", "transformer.h.1.attn.future"}
    assert not buffers & set(m.state_dict())
    future = m.transformer.h[0].attn.future
    assert future.dtype == torch.bool
    assert torch.equal(future, torch.ones(24, 24).triu(1).bool())
    fresh = GPT(m.config)
    fresh.load_state_dict(m.state_dict())  # strict: nothing missing, nothing extra
    x = ids()
    assert torch.equal(fresh.eval()(x)[0], m(x)[0])


def test_rotary_tables_hold_cos_and_sin_of_position_times_frequency():
    m = make(pos_emb="rope", n_head=2, n_embd=16)  # hs 8: 4 frequencies
    pos = torch.arange(24, dtype=torch.float64)[:, None]
    angle = pos * 10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    assert m.cos.shape == (24, 4)
    torch.testing.assert_close(m.cos, angle.cos().float())
    torch.testing.assert_close(m.sin, angle.sin().float())
    assert not hasattr(m.transformer, "wpe")


def test_rotate_turns_each_pair_by_position_times_frequency():
    hs, T = 8, 5
    x = torch.randn(2, 3, T, hs, generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([0, 3, 1, 7, 2])
    theta = 100.0 ** (-torch.arange(0, hs, 2) / hs)
    angle = pos[:, None] * theta  # (T, hs/2)
    got = rotate(x, angle.cos(), angle.sin())
    x1, x2 = x[..., : hs // 2], x[..., hs // 2 :]
    want = torch.cat(
        [x1 * angle.cos() - x2 * angle.sin(), x1 * angle.sin() + x2 * angle.cos()], dim=-1
    )
    torch.testing.assert_close(got, want)
    assert torch.equal(got[:, :, 0], x[:, :, 0])  # position 0: no turn
    torch.testing.assert_close(got.norm(dim=-1), x.norm(dim=-1))  # a rotation keeps lengths
    assert rotate(x.bfloat16(), angle.cos(), angle.sin()).dtype == torch.bfloat16


@BOTH_POS
def test_positions_reach_the_logits(pos_emb):
    """Attention alone sees a prefix as a bag of tokens: "aba" and "baa" would end in the same
    logits in one layer without positions."""
    m = make(n_layer=1, pos_emb=pos_emb, scale=0.5)
    with torch.no_grad():
        logits = m(torch.tensor([[1, 2, 1], [2, 1, 1]]))[0][:, -1]
    assert (logits[0] - logits[1]).abs().amax() > 1e-2


@BOTH_POS
def test_initial_loss_is_close_to_ln_vocab(pos_emb):
    m = make(scale=None, pos_emb=pos_emb, vocab_size=500, n_embd=32)
    x, y = torch.randint(0, 500, (2, 8, 24), generator=torch.Generator().manual_seed(0))
    assert abs(m(x, y)[1].item() - math.log(500)) < 0.1


def test_init_scales_c_proj_by_002_over_sqrt_2_n_layer():
    m = make(scale=None, n_layer=8, n_embd=64, n_head=4, tie_weights=False)
    block = m.transformer.h[3]
    for p, std in [
        (block.attn.c_attn.weight, 0.02),
        (block.mlp.c_fc.weight, 0.02),
        (m.transformer.wte.weight, 0.02),
        (m.transformer.wpe.weight, 0.02),
        (m.lm_head.weight, 0.02),
        (block.attn.c_proj.weight, 0.02 / 4),  # 0.02 / sqrt(2 * 8)
        (block.mlp.c_proj.weight, 0.02 / 4),
    ]:
        assert abs(p.std().item() / std - 1) < 0.05
        assert abs(p.mean().item()) < std / 10  # centred on zero


def test_init_zeroes_the_biases_and_leaves_the_norms_at_one():
    m = make(scale=None)
    for name, p in m.named_parameters():
        if "ln" in name:
            assert torch.equal(p, torch.ones_like(p) if name.endswith("weight") else p * 0), name
        elif name.endswith("bias"):
            assert not p.any(), name
        else:
            assert p.std() > 0.004, name


def test_tie_weights_shares_one_tensor():
    m = make(scale=None)
    assert m.lm_head.weight is m.transformer.wte.weight
    with torch.no_grad():
        m.transformer.wte.weight[3, 0] = 5.0
    assert m.lm_head.weight[3, 0] == 5.0
    untied = make(scale=None, tie_weights=False)
    assert untied.lm_head.weight.data_ptr() != untied.transformer.wte.weight.data_ptr()


def test_num_params_counts_a_tied_weight_once_and_is_124_439_808_for_gpt2_small():
    with torch.device("meta"):  # shapes only: nothing to allocate or initialise
        small = GPT(GPTConfig())
        untied = GPT(GPTConfig(tie_weights=False))
        rope = GPT(GPTConfig(pos_emb="rope"))
    assert small.num_params() == 124_439_808
    assert untied.num_params() == 124_439_808 + 50257 * 768
    assert rope.num_params() == 124_439_808 - 1024 * 768


@BOTH_PATHS
def test_attention_dropout_acts_in_training_only(attention):
    torch.manual_seed(0)
    attn = CausalSelfAttention(config(attention=attention, dropout=0.5), 0)
    attn.resid_dropout = torch.nn.Identity()  # the attention weights' own dropout, alone
    x = torch.randn(2, 8, 16)
    assert not torch.allclose(attn.train()(x), attn(x))
    no_dropout = CausalSelfAttention(config(attention=attention), 0).eval()
    no_dropout.load_state_dict(attn.state_dict())
    torch.testing.assert_close(attn.eval()(x), no_dropout(x), atol=1e-6, rtol=0)


@BOTH_PATHS
def test_dropout_acts_in_training_only(attention):
    m = make(attention=attention)
    drop = with_config(m, dropout=0.5)
    x = ids()
    torch.testing.assert_close(drop(x)[0], m(x)[0], atol=1e-5, rtol=0)  # eval: no dropout
    drop.train()
    a, b = drop(x)[0], drop(x)[0]
    assert (a - b).abs().amax() > 1e-2
    seen = []
    for site in (drop.transformer.drop, drop.transformer.h[0].mlp.dropout):
        hook = site.register_forward_hook(lambda mod, inp, out: seen.append((inp[0], out)))
        drop(x)
        hook.remove()
        inp, out = seen[-1]
        zeroed = (out == 0).float().mean().item()
        assert 0.4 < zeroed < 0.6  # about half of it
        torch.testing.assert_close(out[out != 0], 2 * inp[out != 0])  # the rest scaled by 1/0.5


@pytest.mark.parametrize("activation, approximate", [("gelu", "tanh"), ("gelu_exact", "none")])
def test_activation_is_the_one_named(activation, approximate):
    mlp = make(activation=activation).transformer.h[0].mlp
    seen = []
    mlp.c_proj.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    x = torch.randn(2, 5, 16)  # pre-activations of order 1, where the two forms differ by ~1e-4
    mlp(x)
    h = mlp.c_fc(x)
    assert torch.equal(seen[0], F.gelu(h, approximate=approximate))
    torch.testing.assert_close(seen[0], gelu(h, activation), atol=1e-6, rtol=0)
    other = "none" if approximate == "tanh" else "tanh"
    assert (seen[0] - F.gelu(h, approximate=other)).abs().amax() > 1e-5


def test_bias_false_leaves_no_bias_parameters():
    m = GPT(config(bias=False))
    assert [n for n, _ in m.named_parameters() if "bias" in n] == []
    assert all(mod.bias is None for mod in m.modules() if hasattr(mod, "bias"))
    with_bias = GPT(config())
    n_bias = sum(p.numel() for n, p in with_bias.named_parameters() if n.endswith("bias"))
    assert m.num_params() == with_bias.num_params() - n_bias


WALK = """\
GPT: 1,912 parameters, 2 layers, 2 heads of size 4, n_embd 8, vocab 11, block 8
input idx (1, 8) token ids
module                         type                 output shape               params
wte                            Embedding            (1, 8, 8)                      88
wpe                            Embedding            (8, 8)                         64
    h.0.ln_1                   LayerNorm            (1, 8, 8)                      16
      h.0.attn.c_attn          Linear               (1, 8, 24)                    216
      split into q, k, v: (B, T, C) -> 3 x (B, nh, T, hs) = 3 x (1, 2, 8, 4)
      h.0.attn.c_proj          Linear               (1, 8, 8)                      72
    h.0.attn                   CausalSelfAttention  (1, 8, 8)                     288
    h.0.ln_2                   LayerNorm            (1, 8, 8)                      16
      h.0.mlp.c_fc             Linear               (1, 8, 32)                    288
      h.0.mlp.c_proj           Linear               (1, 8, 8)                     264
    h.0.mlp                    MLP                  (1, 8, 8)                     552
  h.0                          Block                (1, 8, 8)                     872
  h.1                          Block                (1, 8, 8)                     872
ln_f                           LayerNorm            (1, 8, 8)                      16
lm_head                        Linear               (1, 8, 11)                     88
logits (1, 8, 11): a score for each token of the vocabulary, at each position"""


def test_shape_walk_prints_each_modules_output_shape_and_parameters():
    from model.__main__ import shape_walk

    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8))
    assert shape_walk(model) == WALK  # one row of block_size tokens; block 0 in detail
    lines = shape_walk(model, batch_size=3, seq_len=5).splitlines()
    assert lines[1] == "input idx (3, 5) token ids"
    assert lines[7].endswith("= 3 x (3, 2, 5, 4)") and lines[-1].startswith("logits (3, 5, 11)")


def test_python_m_model_prints_the_small_configs_walk(capsys):
    from model.__main__ import main

    main(["--config", "small"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("GPT: 801,664 parameters, 4 layers, 4 heads of size 32")
    assert lines[1] == "input idx (1, 64) token ids"
    assert lines[-1].startswith("logits (1, 64, 65): ")
    assert [line.split()[0] for line in lines[3:5]] == ["wte", "h.0.ln_1"]  # rope: no wpe
    main(["--config", "small", "--batch-size", "2", "--seq-len", "8"])
    assert capsys.readouterr().out.splitlines()[-1].startswith("logits (2, 8, 65): ")
    main(["--config", "small", "--seq-len", "100"])  # no more than block_size
    assert capsys.readouterr().out.splitlines()[-1].startswith("logits (1, 64, 65): ")


def test_python_m_model_defaults_to_small_and_walks_any_preset_on_the_meta_device(capsys, tmp_path):
    from model.__main__ import main

    main([])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("GPT: 801,664 parameters") and lines[-1].startswith("logits (1, 64")
    main(["--config", "gpt2", "--seq-len", "8"])  # 50304 rows: 47 more than GPT-2's 50257
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"GPT: {124_439_808 + 47 * 768:,} parameters, 12 layers")
    assert lines[-1].startswith("logits (1, 8, 50304): ")
    bpe = tmp_path / "bpe.toml"
    bpe.write_text('base = "tiny"\ndataset = "shakespeare"\n')  # no vocab_size: GPT-2's BPE
    main(["--config", str(bpe)])
    lines = capsys.readouterr().out.splitlines()
    assert "vocab 50257, block 32" in lines[0] and lines[-1].startswith("logits (1, 32, 50257): ")


def test_python_m_model_help_shows_the_usage_and_the_modules_docstring(capsys):
    import model.__main__

    with pytest.raises(SystemExit) as e:
        model.__main__.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("usage: python -m model [-h]")
    assert model.__main__.__doc__.strip() in out  # its lines as written, not re-wrapped


@pytest.mark.cuda
@BOTH_POS
def test_on_cuda_every_tensor_a_forward_makes_is_on_the_models_device(pos_emb):
    from model.__main__ import shape_walk

    m = make(pos_emb=pos_emb)
    x = ids()
    cpu = m(x)[0]
    gpu = m.cuda()
    torch.testing.assert_close(gpu(x.cuda())[0].cpu(), cpu, atol=1e-3, rtol=0)
    cache = KVCache(gpu.config, 3, "cuda", torch.float32)
    steps = [gpu(x[:, :8].cuda(), kv_cache=cache)[0]]
    steps += [gpu(x[:, t : t + 1].cuda(), kv_cache=cache)[0] for t in range(8, 16)]
    assert cache.k.is_cuda and cache.v.is_cuda
    torch.testing.assert_close(torch.cat(steps, 1).cpu(), m.cpu()(x)[0], atol=1e-3, rtol=0)
    assert shape_walk(GPT(config()).cuda(), seq_len=4).endswith(
        "logits (1, 4, 37): a score for each token of the vocabulary, at each position"
    )
