"""The GPT of model/gpt.py: logits, loss, causality, the KV cache, buffers, init and its shape walk.

The logits are checked against `reference_forward`, a forward pass spelled out here from the
model's weights (rotary as complex numbers), and the fused attention against the write-ups'
ModuleList of heads (MultiHeadAttention.from_fused), whose own test is test_textbook.py.
"""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from conftest import in_process
from torch.testing import assert_close

from model.gpt import GPT, GPTConfig, KVCache, rotate
from model.textbook import MultiHeadAttention

V = 37


def make(scale=0.3, **kw):
    """A tiny GPT in eval mode; every parameter redrawn at `scale` (norms and biases too, so that
    each one shows in the logits), or GPT-2's init with scale=None. The same weights for any
    attention or dropout setting."""
    torch.manual_seed(0)
    model = GPT(replace(GPTConfig(V, 24, 2, 2, 16), **kw)).eval()
    for p in model.parameters() if scale else []:
        torch.nn.init.normal_(p, std=scale)
    return model


# Rotary's turn at position p and frequency j of a head of 8: e^(i angle), angle p * 10000^(-2j/8).
TURN = torch.exp(1j * torch.arange(24)[:, None] * 10000.0 ** -torch.arange(0, 1, 0.25))


def ids(T=16, seed=1):
    torch.manual_seed(seed)
    return torch.randint(0, V, (3, T))


def reference_forward(model, idx):
    """idx (3, 24) -> logits (3, 24, V), a head (of 2, size 8) at a time, from the model's layers:
    pre-norm blocks, position p's rotary angle p * 10000^(-2j/8), GPT-2's tanh GELU or the exact
    one. Rotary by definition: each pair (x[j], x[j + 4]) as a complex number times e^(i angle)."""
    c, tr, pos = model.config, model.transformer, torch.arange(24)
    x = tr.wte.weight[idx] + (tr.wpe.weight if c.pos_emb == "learned" else 0)
    for block in tr.h:
        qkv, heads = block.attn.c_attn(block.ln_1(x)).split(8, -1), []
        for q, k, v in qkv[::2], qkv[1::2]:
            if c.pos_emb == "rope":
                q, k = (
                    torch.view_as_real(torch.complex(*t.chunk(2, -1)) * TURN).mT.flatten(-2)
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
    x, t, seen = ids(24), ids(24, 2), []
    t[:2, 5:] = -1  # left out of the loss: two of the 7-row chunks hold no other target
    monkeypatch.setattr("model.gpt.LOSS_CHUNK", 7 * V)  # the loss 7 rows a chunk: 11 chunks
    # sdpa (the default) calls the fused kernel, explicit spells out softmax(QK^T / sqrt(hs)) and
    # drops its weights with attn_dropout: the count of dropouts called below tells them apart.
    for attention in ("sdpa", "explicit"):
        m = make(attention=attention, **kw)
        logits, loss = m(x)
        assert loss is None
        # each path within 5e-6 of the pass spelled out, so within 1e-5 of the other
        assert_close(logits, reference_forward(m, x), atol=5e-6, rtol=0)
        losses = m(x, t)[1], F.cross_entropy(logits.mT, t, ignore_index=-1)
        assert_close(*losses)
        assert_close(*[torch.autograd.grad(loss, [*m.parameters()]) for loss in losses])
        for i in (1, 7, 11, 23):  # a changed token changes its own logits, none before it
            d = (m((x + (torch.arange(24) == i)) % V)[0] - logits).abs().amax((0, 2))
            assert not d[:i].any() and d[i] > 1e-3
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
        for d in drop.modules():
            if isinstance(d, torch.nn.Dropout):
                d.register_forward_hook(lambda d, *a: seen.append(d.p))
        # In training, each dropout forward calls, at 0.5: the embeddings', each block's output
        # of attention and of MLP, and explicit's attention weights (sdpa drops them inside).
        drop.train()(x)
        assert seen == [0.5] * (7 if attention == "explicit" else 5)
        attn = drop.transformer.h[0].attn
        attn.resid_dropout.p = 0  # the attention weights' own dropout, alone
        h = torch.randn(2, 8, 16)
        assert not torch.allclose(attn(h), attn.eval()(h))
        ref = MultiHeadAttention.from_fused(attn).eval()  # the write-ups' heads, its weights
        assert ref.dropout.p == 0.5 and ref.heads[0].future.shape == (24, 24)
        assert_close(attn(h), ref(h), atol=1e-5, rtol=0)


def test_shapes_buffers_and_the_parameter_count():
    # GPT-2 small's: vocab_size, block_size, n_layer, n_head, n_embd, dropout, bias, pos_emb,
    # activation, tie_weights, attention
    assert GPTConfig() == GPTConfig(
        50257, 1024, 12, 12, 768, 0.0, True, "learned", "gelu", True, "sdpa"
    )
    with torch.device("meta"):  # shapes only: nothing to allocate or initialise
        # untied: + 50257 * 768 for the head; rope: - 1024 * 768 for wpe; bias=False: - 102,144,
        # 12 * 8,448 in the blocks' Linears and norms and 768 in ln_f
        assert [
            GPT(GPTConfig(**kw)).num_params()
            for kw in ({}, dict(tie_weights=False), dict(pos_emb="rope"), dict(bias=False))
        ] == [124_439_808, 163_037_184, 123_653_376, 124_337_664]
    m = make(pos_emb="rope")  # the masks and the rotary tables derive from the config: not saved
    buffers = dict(m.named_buffers()).keys()
    assert buffers == set("cos sin transformer.h.0.attn.future transformer.h.1.attn.future".split())
    assert not buffers & m.state_dict().keys()
    assert rotate(torch.ones(24, 8).bfloat16(), m.cos, m.sin).dtype == torch.bfloat16
    assert torch.allclose(torch.complex(m.cos, m.sin), TURN, atol=1e-6)  # the tables: the turns
    # Loaded strictly (none missing or extra), then cropped to a shorter context: the tables and
    # masks keep their first rows, and the logits are m's.
    (fresh := GPT(m.config).eval()).load_state_dict(m.state_dict())
    fresh.crop(8)
    assert len(fresh.cos) == len(fresh.sin) == fresh.transformer.h[1].attn.future.size(1) == 8
    assert torch.equal(fresh(ids(8))[0], m(ids(8))[0]) and fresh.config.block_size == 8


def test_init_is_gpt2s_and_the_head_is_tied_to_the_embedding():
    for kw in (dict(tie_weights=False), dict(pos_emb="rope")):
        m = make(None, n_layer=8, n_embd=64, n_head=4, vocab_size=500, **kw)
        for name, p in m.named_parameters():
            if "bias" in name or ".ln" in name:  # norms at one, biases at zero
                assert (p == (".ln" in name and "weight" in name)).all(), name
            else:  # N(0, 0.02); the projections into the residual stream 0.02 / sqrt(2 * n_layer)
                std = 0.02 / 4 ** ("c_proj" in name)
                assert abs(p.std() / std - 1) < 0.05 and abs(p.mean()) < std / 10, name
        # ids and targets seeded by make; a loss of ln 500: about uniform
        assert abs(m(*torch.randint(0, 500, (2, 8, 24)))[1].item() - 6.215) < 0.1
        tied = "tie_weights" not in kw  # `is`: test_hf's test_load_gpt2_of_a_folder...
        assert (m.lm_head.weight.data_ptr() == m.transformer.wte.weight.data_ptr()) == tied


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


SMALL = """\
GPT: 453,792 parameters, 4 layers, 4 heads of size 24, n_embd 96, vocab 65, block 64
input idx (1, 64) token ids
module                         type                 output shape               params
wte                            Embedding            (1, 64, 96)                 6,240
    h.0.ln_1                   LayerNorm            (1, 64, 96)                   192
      h.0.attn.c_attn          Linear               (1, 64, 288)               27,936
      split into q, k, v: (B, T, C) -> 3 x (B, nh, T, hs) = 3 x (1, 4, 64, 24)
      h.0.attn.c_proj          Linear               (1, 64, 96)                 9,312
    h.0.attn                   CausalSelfAttention  (1, 64, 96)                37,248
    h.0.ln_2                   LayerNorm            (1, 64, 96)                   192
      h.0.mlp.c_fc             Linear               (1, 64, 384)               37,248
      h.0.mlp.c_proj           Linear               (1, 64, 96)                36,960
    h.0.mlp                    MLP                  (1, 64, 96)                74,208
  h.0                          Block                (1, 64, 96)               111,840
  h.1                          Block                (1, 64, 96)               111,840
  h.2                          Block                (1, 64, 96)               111,840
  h.3                          Block                (1, 64, 96)               111,840
ln_f                           LayerNorm            (1, 64, 96)                   192
lm_head                        Linear               (1, 64, 65)                 6,240
logits (1, 64, 65): a score for each token of the vocabulary, at each position
"""


def test_shape_walk_and_python_m_model_print_each_modules_output_shape(tmp_path):
    from model import __main__ as cli

    # one row of block_size tokens; block 0 in detail
    assert cli.shape_walk(GPT(GPTConfig(11, 8, 2, 2, 8))) == WALK

    def walk(argv=""):  # python -m model ARGV's output
        return in_process(cli.main, *argv.split()).stdout

    # small, the default; --seq-len up to block_size. Rotary: no wpe.
    assert walk() == walk("--config small") == walk("--seq-len 100") == SMALL
    out = walk("--batch-size 2 --seq-len 8")  # 4 heads of 24
    assert "\ninput idx (2, 8) token ids\n" in out and "= 3 x (2, 4, 8, 24)\n" in out
    assert "\nlogits (2, 8, 65): " in out
    (bpe := tmp_path / "bpe.toml").write_text(
        'base = "tiny"\ndataset = "shakespeare"\n'
    )  # no vocab_size: GPT-2's BPE
    out = walk(f"--config {bpe}")
    assert "vocab 50257, block 32" in out and "\nlogits (1, 32, 50257): " in out
    usage = in_process(cli.main, "--help")
    assert usage.returncode == 0 and usage.stdout.startswith("usage: python -m model [-h]")
    assert cli.__doc__.strip() in usage.stdout  # its lines as written, not re-wrapped


@pytest.mark.cuda
@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_on_cuda_every_tensor_a_forward_makes_is_on_the_models_device(pos_emb):
    from model.__main__ import shape_walk

    m, x = make(pos_emb=pos_emb), ids()
    cpu, gpu = m(x)[0], m.cuda()
    assert_close(gpu(x.cuda())[0].cpu(), cpu, atol=1e-3, rtol=0)
    cache = KVCache(gpu.config, 3, "cuda", torch.float32)
    # a prefill of 8 tokens, then one at a time
    steps = [gpu(x[:, cache.pos : b].cuda(), kv_cache=cache)[0] for b in range(8, 17)]
    assert cache.k.is_cuda and cache.v.is_cuda
    assert_close(torch.cat(steps, 1).cpu(), cpu, atol=1e-3, rtol=0)
    assert shape_walk(make().cuda(), seq_len=4).endswith(
        "logits (1, 4, 37): a score for each token of the vocabulary, at each position"
    )
