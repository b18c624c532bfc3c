"""The GPT of model/gpt.py: logits, loss, causality, the KV cache, buffers, init and its shape walk.

The logits are checked against `reference_forward`, a forward pass spelled out here from the
model's weights (rotary as complex numbers), and the fused attention against the write-ups'
ModuleList of heads (MultiHeadAttention.from_fused), whose own test is test_textbook.py.
"""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from model.gpt import GPT, GPTConfig, KVCache, rotate
from model.textbook import MultiHeadAttention

V = 37


def config(**kw):
    return replace(GPTConfig(V, 24, 2, 2, 16), **kw)


def make(scale=0.3, **kw):
    """A tiny GPT in eval mode; every parameter redrawn at `scale` (norms and biases too, so that
    each one shows in the logits), or GPT-2's init with scale=None. The same weights for any
    attention or dropout setting."""
    torch.manual_seed(0)
    model = GPT(config(**kw)).eval()
    for p in model.parameters() if scale else []:
        torch.nn.init.normal_(p, std=scale)
    return model


def ids(T=16, seed=1):
    torch.manual_seed(seed)
    return torch.randint(0, V, (3, T))


def reference_forward(model, idx):
    """idx (3, 24) -> logits (3, 24, V), a head (of 2, size 8) at a time, from the model's layers:
    pre-norm blocks, position p's rotary angle p * 10000^(-2j/8), GPT-2's tanh GELU or the exact
    one. Rotary by definition: each pair (x[j], x[j + 4]) as a complex number times e^(i angle)."""
    c, tr, pos = model.config, model.transformer, torch.arange(24)
    turn = torch.exp(1j * pos[:, None] * 10000.0 ** -torch.arange(0, 1, 0.25))
    x = tr.wte.weight[idx] + (tr.wpe.weight if c.pos_emb == "learned" else 0)
    for block in tr.h:
        qkv, heads = block.attn.c_attn(block.ln_1(x)).split(8, -1), []
        for q, k, v in qkv[::2], qkv[1::2]:
            if c.pos_emb == "rope":
                q, k = (
                    torch.view_as_real(torch.complex(*t.chunk(2, -1)) * turn).mT.flatten(-2)
                    for t in (q, k)
                )
            scores = (q @ k.mT / 8**0.5).masked_fill(pos > pos[:, None], -torch.inf)
            heads.append(scores.softmax(-1) @ v)
        x = x + block.attn.c_proj(torch.cat(heads, -1))
        h = block.mlp.c_fc(block.ln_2(x))
        x = x + block.mlp.c_proj(
            F.gelu(h, approximate="tanh" if c.activation == "gelu" else "none")
        )
    return model.lm_head(tr.ln_f(x))


@pytest.mark.parametrize(
    "kw",
    [dict(pos_emb=p, activation=a) for p in ("learned", "rope") for a in ("gelu", "gelu_exact")]
    + [dict(pos_emb="rope", tie_weights=False, bias=False)],
    ids=str,
)
def test_both_attention_paths_equal_the_pass_spelled_out_see_only_the_past_cache_and_drop_out(
    kw, monkeypatch
):
    x, t, calls, outs, seen = ids(24), ids(24, 2), [], [], []
    t[0, 5:], t[1, :2] = -1, -1  # left out of the loss
    fused = F.scaled_dot_product_attention
    monkeypatch.setattr(
        F, "scaled_dot_product_attention", lambda *a, **k: [calls.append(1)] and fused(*a, **k)
    )
    # The loss a chunk at once, or 7 rows a chunk; sdpa (the default) calls the fused kernel,
    # explicit spells out softmax(QK^T / sqrt(hs)).
    for attention, chunk in (("sdpa", 10**9), ("explicit", 7 * V)):
        m, calls[:] = make(attention=attention, **kw), []
        m.transformer.h[0].attn.attn_dropout.register_forward_hook(lambda *a: calls.append(0))
        logits, loss = m(x)
        outs.append(logits)
        assert loss is None and calls == ([1, 1] if attention == "sdpa" else [0])
        assert_close(logits, reference_forward(m, x), atol=2e-5, rtol=1e-5)
        monkeypatch.setattr("model.gpt.LOSS_CHUNK", chunk)
        losses = m(x, t)[1], F.cross_entropy(logits.mT, t, ignore_index=-1)
        assert_close(*losses)
        assert_close(*[torch.autograd.grad(loss, [*m.parameters()]) for loss in losses])
        for i in (1, 7, 11, 23):  # a changed token changes its own logits, none before it
            b = m((x + (torch.arange(24) == i)) % V)[0]
            assert (
                torch.equal(logits[:, :i], b[:, :i])
                and (logits[:, i] - b[:, i]).abs().amax() > 1e-3
            )
        # A prefill, single tokens, then chunks of several after cached ones, up to block_size.
        cache = KVCache(m.config, 3, "cpu", torch.float32)
        for b in (5, 6, 7, 13, 24):
            p = cache.pos
            assert_close(m(x[:, p:b], kv_cache=cache)[0], logits[:, p:b], atol=1e-5, rtol=0)
            assert cache.pos == b
        with pytest.raises(ValueError, match="25 positions, more than block_size 24"):
            m(x[:, :1], kv_cache=cache)
        drop, seen[:] = make(attention=attention, dropout=0.5, **kw), []
        assert torch.equal(drop(x)[0], logits)  # eval: no dropout
        for site in (drop.transformer.drop, drop.transformer.h[0].mlp.dropout):
            site.register_forward_hook(lambda *a: seen.append(a))
        drop.train()(x)  # so train and eval differ
        assert len(seen) == 2
        for _, (inp,), out in seen:  # about half of it zeroed, the rest scaled by 1/0.5
            assert 0.4 < (out == 0).float().mean() < 0.6
            assert_close(out, 2 * inp * (out != 0))
        attn = drop.transformer.h[0].attn
        attn.resid_dropout = torch.nn.Identity()  # the attention weights' own dropout, alone
        h = torch.randn(2, 8, 16)
        assert not torch.allclose(attn(h), attn.eval()(h))
        ref = MultiHeadAttention.from_fused(attn).eval()  # the write-ups' heads, its weights
        assert [d.p for d in ref.modules() if isinstance(d, torch.nn.Dropout)] == [0.5] * 3
        assert ref.heads[0].future.shape == (24, 24)
        assert_close(attn(h), ref(h), atol=1e-5, rtol=0)
    assert_close(*outs, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="25 positions"):
        m(ids(25))


def test_shapes_buffers_and_the_parameter_count():
    # GPT-2 small's: vocab_size, block_size, n_layer, n_head, n_embd, dropout, bias, pos_emb,
    # activation, tie_weights, attention
    assert GPTConfig() == GPTConfig(
        50257, 1024, 12, 12, 768, 0.0, True, "learned", "gelu", True, "sdpa"
    )
    with torch.device("meta"):  # shapes only: nothing to allocate or initialise
        # untied: + 50257 * 768 for the head; rope: - 1024 * 768 for wpe
        assert [
            GPT(GPTConfig(**kw)).num_params()
            for kw in ({}, dict(tie_weights=False), dict(pos_emb="rope"))
        ] == [124_439_808, 163_037_184, 123_653_376]
    b = make()
    n_bias = sum(p.numel() for n, p in b.named_parameters() if "bias" in n)
    assert make(bias=False).num_params() == b.num_params() - n_bias > 0
    m = make(pos_emb="rope")  # the masks and the rotary tables derive from the config: not saved
    buffers = dict(m.named_buffers()).keys()
    assert buffers == {"cos", "sin", "transformer.h.0.attn.future", "transformer.h.1.attn.future"}
    assert not buffers & m.state_dict().keys()
    (fresh := GPT(m.config).eval()).load_state_dict(m.state_dict())  # strict: none missing or extra
    assert torch.equal(fresh(ids())[0], m(ids())[0])
    assert rotate(torch.ones(2, 8).bfloat16(), m.cos[:2], m.sin[:2]).dtype == torch.bfloat16
    # position p's angle at frequency j of a head of 8: p * 10000^(-2j/8); cropped to a shorter
    # context, the tables and masks keep their first rows and the logits stay the same
    angles = torch.arange(m.config.block_size)[:, None] * 10000.0 ** -torch.arange(0, 1, 0.25)
    assert torch.allclose(torch.complex(m.cos, m.sin), torch.exp(1j * angles), atol=1e-6)
    logits = m(ids(8))[0]
    m.crop(8)
    assert m.cos.size(0) == m.sin.size(0) == m.transformer.h[1].attn.future.size(1) == 8
    assert torch.equal(m(ids(8))[0], logits) and m.config.block_size == 8


def test_init_is_gpt2s_and_the_head_is_tied_to_the_embedding():
    for kw in (dict(tie_weights=False), dict(pos_emb="rope")):
        m = make(None, n_layer=8, n_embd=64, n_head=4, vocab_size=500, **kw)
        for name, p in m.named_parameters():
            if "bias" in name or ".ln" in name:  # norms at one, biases at zero
                assert (p == (".ln" in name and "weight" in name)).all(), name
            else:  # N(0, 0.02); the projections into the residual stream 0.02 / sqrt(2 * n_layer)
                std = 0.02 / 4 ** ("c_proj" in name)
                assert abs(p.std() / std - 1) < 0.05 and abs(p.mean()) < std / 10, name
        x, y = torch.randint(0, 500, (2, 8, 24))  # seeded by make
        assert abs(m(x, y)[1].item() - 6.215) < 0.1  # ln 500: about uniform
        tied = m.lm_head.weight.data_ptr() == m.transformer.wte.weight.data_ptr()
        assert tied == ("tie_weights" not in kw)  # `is`: test_hf's test_load_gpt2_of_a_folder...


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


def test_shape_walk_and_python_m_model_print_each_modules_output_shape(capsys, tmp_path):
    from model import __main__ as cli

    m = GPT(GPTConfig(11, 8, 2, 2, 8))
    assert cli.shape_walk(m) == WALK  # one row of block_size tokens; block 0 in detail
    w = cli.shape_walk(m, batch_size=3, seq_len=5)
    assert "\ninput idx (3, 5) token ids\n" in w and "= 3 x (3, 2, 5, 4)\n" in w
    assert "\nlogits (3, 5, 11): " in w

    def walk(*argv):
        cli.main(argv)
        return capsys.readouterr().out

    small = walk("--config", "small")
    assert walk() == small  # the default
    assert small.startswith("GPT: 453,792 parameters, 4 layers, 4 heads of size 24")
    assert "\ninput idx (1, 64) token ids\n" in small  # its logits: test_commands
    assert "\nwte" in small and "wpe" not in small  # rope
    assert "\nlogits (2, 8, 65): " in walk("--batch-size", "2", "--seq-len", "8")
    assert "\nlogits (1, 64, 65): " in walk("--seq-len", "100")  # up to block_size
    (bpe := tmp_path / "bpe.toml").write_text(
        'base = "tiny"\ndataset = "shakespeare"\n'
    )  # no vocab_size: GPT-2's BPE
    out = walk("--config", str(bpe))
    assert "vocab 50257, block 32" in out and "\nlogits (1, 32, 50257): " in out
    with pytest.raises(SystemExit, match="^0$"):
        walk("--help")
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m model [-h]")
    assert cli.__doc__.strip() in out  # its lines as written, not re-wrapped


@pytest.mark.cuda
@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
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
