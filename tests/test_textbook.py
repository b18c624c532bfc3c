"""The write-ups' MultiHeadAttention (model/textbook.py); test_model.py holds the GPT's fused
attention to it.

Every variant (self or cross attention, causal or not, each mask and valid-length form) is checked
against softmax(Q K^T / sqrt(d)) V computed here head by head, and by changing a key: the outputs
that change are those of the queries that may see it.
"""

import ast

import pytest
import torch
from conftest import rows
from torch.testing import assert_close

from model.textbook import MultiHeadAttention

SELF = dict(num_heads=2, emb_size=8, head_size=4)


# MultiHeadAttention's arguments | Tq | Tk: a GPT block's, self attention, one key, d2l's widths
# 10, 20, 30, causal cross attention with heads of 6
CONFIGS = """\
num_heads=8 emb_size=512 head_size=64 causal=True max_seq_len=1024 dropout=0.1 | 20 | 20
num_heads=2 emb_size=8 head_size=4 | 5 | 5
num_heads=2 emb_size=8 head_size=4 | 5 | 1
num_heads=5 emb_size=100 head_size=20 query_size=10 key_size=20 value_size=30 \
dropout=0.5 bias=False | 4 | 6
num_heads=2 emb_size=16 head_size=6 causal=True max_seq_len=16 | 5 | 8"""


# The forms of mask: none, tril, (Tq,Tk), nothing, (B,1,1,Tk), (B,1,Tq,Tk), lens(B,), lens(B,Tq),
# mask+lens
@pytest.mark.parametrize("form", range(9))
@pytest.mark.parametrize("args, Tq, Tk", rows(CONFIGS))
def test_attention_is_softmax_qk_v_and_each_query_sees_only_what_it_may(args, Tq, Tk, form):
    kw = {name: ast.literal_eval(value) for name, value in (a.split("=") for a in args.split())}
    Tq, Tk = int(Tq), int(Tk)
    causal = "causal" in kw
    torch.manual_seed(0)
    mha = MultiHeadAttention(**kw).eval()
    # Each head's dropout and the output's at the given p (the hooks below need each head's).
    assert {m.p for m in mha.modules() if isinstance(m, torch.nn.Dropout)} == {kw.get("dropout", 0)}
    assert sum(p.dim() == 1 for p in mha.parameters()) == (3 * kw["num_heads"] + 1) * kw.get(
        "bias", True
    )
    q, k, v = (
        torch.randn(2, T, kw.get(f"{n}_size", kw["emb_size"]))
        for n, T in (("query", Tq), ("key", Tk), ("value", Tk))
    )
    # The write-ups' forms (1 = keep), each but none and tril leaving a query no key.
    rand, lens = torch.rand(2, 1, Tq, Tk) > 0.5, torch.tensor([(Tk + 1) // 2, 0])
    rand[1, 0, 1] = False
    mask = [
        None,
        torch.ones(Tq, Tk).tril(),
        rand[1, 0],
        torch.zeros(Tq, Tk),
        (torch.arange(Tk) < lens[:, None]).float()[:, None, None],
        rand,
        None,
        None,
        rand[1, 0].float(),
    ][form]
    lens = [*[None] * 6, lens, torch.arange(2 * Tq).view(2, Tq) % (Tk + 1), lens][form]
    # The spec: the keys the mask zeroes, and those at or past a valid length, score -1e9 with a
    # mask, -1e6 with lengths alone (a query that sees no key averages the values); the future -inf.
    hide = torch.zeros(2, Tq, Tk).bool()
    if mask is not None:
        hide |= (mask if mask.dim() == 2 else mask[:, 0]) == 0
    if lens is not None:
        hide |= torch.arange(Tk) >= lens.view(2, -1, 1)
    future = torch.ones(Tq, Tk).triu(1).bool() & causal
    outs, seen = [], []
    for h in mha.heads:
        scores = (h.query(q) @ h.key(k).mT / kw["head_size"] ** 0.5).masked_fill(
            hide, -1e6 if mask is None else -1e9
        )
        outs.append(scores.masked_fill(future, -torch.inf).softmax(-1) @ h.value(v))
        h.dropout.register_forward_hook(lambda _, inp, out: seen.append(inp[0]))
    y = mha(q, k, v, mask, valid_lens=lens)
    assert_close(y, mha.proj(torch.cat(outs, -1)), atol=1e-5, rtol=0)
    y.sum().backward()
    assert all(p.grad.isfinite().all() for p in mha.parameters())
    # Weight above 0 on each key a query sees; where it sees none, on each of the past's.
    sees = ~(hide | future)
    sees = torch.where(sees.any(-1, keepdim=True), sees, ~future)
    assert ((torch.stack(seen) > 0) == sees).all()  # (nh, B, Tq, Tk) against (B, Tq, Tk)
    for j in {0, Tk // 2, Tk - 1}:  # a key changed changes the outputs of those that see it
        e = (torch.arange(Tk) == j)[:, None]
        assert torch.equal((mha(q, k + e, v + e, mask, valid_lens=lens) != y).any(-1), sees[..., j])


def test_key_and_value_default_each_head_has_its_own_buffer_dropout_trains_and_refusals():
    # Self attention, mha(x), is held by test_model.py, where it equals the GPT's.
    mha = MultiHeadAttention(**SELF)
    x, ctx = torch.randn(2, 5, 8), torch.randn(2, 3, 8)
    assert torch.equal(mha(x, ctx), mha(x, ctx, ctx))
    for mask in (
        torch.ones(2, 5, 5) > 0,  # 3-D: neither write-up's shape
        torch.ones(5) > 0,
        torch.ones(5, 5).long(),  # neither bool nor float
        torch.tensor([3, 2]),  # the d2l call's lengths passed fourth: they go by keyword
    ):
        with pytest.raises(ValueError, match="mask: bool or 0/1 float"):
            mha(x, x, x, mask)
    for kw in (dict(causal=True), dict(max_seq_len=8)):
        with pytest.raises(ValueError, match="causal=True needs max_seq_len"):
            MultiHeadAttention(**SELF, **kw)
    causal = MultiHeadAttention(**SELF, causal=True, max_seq_len=32)
    a, b = (h.future for h in causal.heads)
    assert torch.equal(a, torch.ones(32, 32).triu(1) > 0) and torch.equal(a, b)
    assert a.data_ptr() != b.data_ptr()  # one buffer per head, not a shared one
    assert not any("future" in name for name in causal.state_dict())
    d2l = MultiHeadAttention(
        num_heads=5,
        emb_size=100,
        head_size=20,
        query_size=10,
        key_size=20,
        value_size=30,
        dropout=0.5,
    )
    # Training: the output's dropout at 0.5. The weights' is each head's own dropout, which the
    # test above finds at p and called on the weights.
    assert 0.3 < (d2l(*(torch.randn(2, 6, n) for n in (10, 20, 30))) == 0).float().mean() < 0.7


def test_a_visible_key_scoring_under_the_fill_loses_to_the_hidden_ones():
    """valid_lens alone hides with -1e6 (d2l), so a visible key scoring -2e6 gets no weight; a mask
    hides with -1e9, under it, as a Head alone does."""
    mha = MultiHeadAttention(num_heads=1, emb_size=4, head_size=4, bias=False).eval()
    head = mha.heads[0]
    for p in mha.parameters():  # the query, key and value projections and the output: identities
        torch.nn.init.eye_(p)
    q, k = 1000 * torch.ones(1, 1, 4), -1000 * torch.ones(1, 3, 4)  # each score -4e6 / 2 = -2e6
    v, one, keep = torch.randn(1, 3, 4), torch.tensor([1]), torch.eye(1, 3) > 0
    assert_close(mha(q, k, v, valid_lens=one), v[:, 1:].mean(1, keepdim=True))
    for y in (mha(q, k, v, keep), mha(q, k, v, keep, valid_lens=one), head(q, k, v, keep)):
        assert_close(y, v[:, :1])
    assert_close(head(q, k, v, keep & False), v.mean(1, keepdim=True))  # finite: no nan


@pytest.mark.cuda
def test_on_cuda_valid_lens_make_their_mask_on_the_inputs_device():
    torch.manual_seed(0)
    mha = MultiHeadAttention(num_heads=2, emb_size=16, head_size=8, causal=True, max_seq_len=16)
    x, lens = torch.randn(2, 10, 16), torch.tensor([[10] * 10, [6] * 10])
    cpu = mha.eval()(x, valid_lens=lens)
    gpu = mha.cuda()(x.cuda(), valid_lens=lens.cuda())
    assert_close(gpu.cpu(), cpu, atol=1e-5, rtol=0)
