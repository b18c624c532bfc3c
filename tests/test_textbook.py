"""The write-ups' MultiHeadAttention (model/textbook.py) at the write-ups' shapes and masks.

Every case is checked against softmax(Q K^T / sqrt(d)) V computed here, head by head, from the
module's weights, and, where causal, by changing a future token.
"""

import math

import pytest
import torch

from model.textbook import Head, MultiHeadAttention


def linear(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    return x @ layer.weight.T + (0 if layer.bias is None else layer.bias)


def by_hand(mha, query, key, value, hide=None, fill=-math.inf) -> torch.Tensor:
    """hide: bool, True where a query must not see a key, broadcastable to (B, Tq, Tk); fill: the
    score a hidden key gets."""
    outs = []
    for head in mha.heads:
        q, k, v = linear(query, head.query), linear(key, head.key), linear(value, head.value)
        scores = torch.einsum("bqd,bkd->bqk", q, k) / math.sqrt(q.size(-1))
        if hide is not None:
            scores = scores.masked_fill(hide, fill)
        outs.append(torch.einsum("bqk,bkd->bqd", scores.softmax(dim=-1), v))
    return linear(torch.cat(outs, dim=-1), mha.proj)


def mean_of_values(mha, value: torch.Tensor) -> torch.Tensor:
    """(B, Tk, value_size) -> (B, 1, emb_size): what uniform attention weights give."""
    heads = [linear(value, h.value).mean(1, keepdim=True) for h in mha.heads]
    return linear(torch.cat(heads, dim=-1), mha.proj)


def weights(mha, *args, **kwargs) -> torch.Tensor:
    """(nh, B, Tq, Tk): each head's softmax, caught on its way into the head's dropout."""
    seen = []
    hooks = [
        h.dropout.register_forward_hook(lambda mod, inp, out: seen.append(inp[0]))
        for h in mha.heads
    ]
    mha(*args, **kwargs)
    for hook in hooks:
        hook.remove()
    return torch.stack(seen)


def future(T: int) -> torch.Tensor:
    """(T, T) bool, True where key j is after query i."""
    return torch.tensor([[j > i for j in range(T)] for i in range(T)])


def assert_causal(f, x: torch.Tensor, t: int) -> None:
    y = x.clone()
    y[:, t + 1] += 1
    a, b = f(x), f(y)
    assert torch.equal(a[:, : t + 1], b[:, : t + 1])
    assert not torch.allclose(a[:, t + 1], b[:, t + 1])  # the change shows where it may


@pytest.mark.parametrize(
    "causal, user_mask",
    [(True, True), (False, True), (True, False)],
    ids=["buffer+tril", "tril-only", "buffer-only"],
)
def test_gpt_block_512_wide_8_heads_of_64(causal, user_mask):
    # MultiHeadAttention(num_heads=8, emb_size=512, head_size=64, max_seq_len=1024), x (2, 50, 512)
    torch.manual_seed(0)
    mha = MultiHeadAttention(
        num_heads=8,
        emb_size=512,
        head_size=64,
        causal=causal,
        max_seq_len=1024 if causal else None,
        dropout=0.1,
    ).eval()
    x = torch.randn(2, 50, 512)
    mask = torch.tril(torch.ones(50, 50)) if user_mask else None  # 1 = keep
    y = mha(x, mask=mask)
    assert y.shape == (2, 50, 512) and len(mha.heads) == 8
    torch.testing.assert_close(y, by_hand(mha, x, x, x, future(50)), atol=1e-5, rtol=0)
    assert_causal(lambda x: mha(x, mask=mask), x, t=20)
    if causal:
        assert mha.heads[0].future.shape == (1024, 1024)
    else:
        assert mha.heads[0].future is None


def test_three_input_widths_10_20_30_into_100_hidden_with_5_heads():
    # MultiHeadAttention(key_size, query_size, value_size, num_hiddens=100, num_heads=5)
    torch.manual_seed(0)
    mha = MultiHeadAttention(
        num_heads=5,
        emb_size=100,
        head_size=20,
        query_size=10,
        key_size=20,
        value_size=30,
        dropout=0.5,
        bias=False,
    ).eval()
    head = mha.heads[0]
    assert (head.query.in_features, head.key.in_features, head.value.in_features) == (10, 20, 30)
    assert all(p.dim() == 2 for p in mha.parameters())  # bias=False: no bias anywhere
    queries, keys, values = torch.randn(2, 4, 10), torch.randn(2, 6, 20), torch.randn(2, 6, 30)
    per_seq = torch.tensor([3, 2])  # (B,): the same for every query
    per_query = torch.tensor([[1, 2, 3, 4], [6, 5, 4, 3]])  # (B, Tq)
    for lens in (per_seq, per_query):
        per_q = lens[:, None].expand(2, 4) if lens.dim() == 1 else lens  # (B, Tq)
        hide = torch.arange(6) >= per_q[..., None]  # (B, Tq, Tk)
        y = mha(queries, keys, values, valid_lens=lens)
        assert y.shape == (2, 4, 100)
        torch.testing.assert_close(y, by_hand(mha, queries, keys, values, hide), atol=1e-5, rtol=0)
        # The last key of sequence 1 matters to exactly the queries that may see it.
        keys2, values2 = keys.clone(), values.clone()
        keys2[1, 5], values2[1, 5] = torch.randn(20), torch.randn(30)
        y2, sees = mha(queries, keys2, values2, valid_lens=lens), ~hide[1, :, 5]  # (Tq,)
        assert torch.equal(y2[1, ~sees], y[1, ~sees])
        assert torch.equal((y2[1] - y[1]).abs().amax(dim=-1) > 1e-4, sees)
    mha.train()
    zeros = (mha(queries, keys, values) == 0).float().mean()
    assert 0.3 < zeros < 0.7  # the output's dropout at 0.5
    assert not torch.equal(head(queries, keys, values), head(queries, keys, values))  # weights'


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool], ids=["0/1-float", "bool"])
@pytest.mark.parametrize("per_query", [False, True], ids=["(B,1,1,Tk)", "(B,1,Tq,Tk)"])
def test_forward_query_key_value_mask(per_query, dtype):
    # forward(query, key, value, mask), mask (B, 1, 1, Tk) or (B, 1, Tq, Tk), 0 = hide
    torch.manual_seed(0)
    mha = MultiHeadAttention(num_heads=4, emb_size=32, head_size=8, dropout=0.1).eval()
    query, memory = torch.randn(2, 5, 32), torch.randn(2, 7, 32)
    if per_query:
        mask = (torch.rand(2, 1, 5, 7) > 0.5).float()
        mask[..., 0] = 1  # every query keeps a key
    else:
        mask = (torch.arange(7) < torch.tensor([7, 4])[:, None]).float()[:, None, None, :]
    y = mha(query, memory, memory, mask.to(dtype))
    assert y.shape == (2, 5, 32)
    hide = mask[:, 0] == 0  # (B, Tq|1, Tk)
    torch.testing.assert_close(y, by_hand(mha, query, memory, memory, hide), atol=1e-5, rtol=0)
    assert not torch.allclose(y, mha(query, memory, memory))  # the mask did hide something


def test_a_2d_mask_applies_to_every_row_and_a_mask_with_lengths_hides_what_either_hides():
    torch.manual_seed(0)
    mha = MultiHeadAttention(num_heads=2, emb_size=8, head_size=4).eval()
    x = torch.randn(2, 5, 8)
    mask = torch.ones(5, 5, dtype=torch.bool)
    mask[:, 0] = False
    mask[2, 3] = False
    torch.testing.assert_close(mha(x, mask=mask), by_hand(mha, x, x, x, ~mask), atol=1e-6, rtol=0)
    both = mha(x, mask=mask, valid_lens=torch.tensor([3, 5]))
    keep = mask.repeat(2, 1, 1)
    keep[0, :, 3:] = False
    torch.testing.assert_close(both, by_hand(mha, x, x, x, ~keep), atol=1e-6, rtol=0)
    one_key = torch.randn(2, 1, 8)  # Tk = 1: a (Tq, Tk) mask of ones hides nothing
    torch.testing.assert_close(
        mha(x, one_key, mask=torch.ones(5, 1, dtype=torch.bool)), mha(x, one_key)
    )


def test_defaults_are_biases_and_no_dropout_and_sizes_of_emb_size():
    mha = MultiHeadAttention(num_heads=3, emb_size=8, head_size=4)
    assert [m.p for m in mha.modules() if isinstance(m, torch.nn.Dropout)] == [0.0] * 4
    assert sum(p.dim() == 1 for p in mha.parameters()) == 3 * 3 + 1  # q, k, v a head; proj
    head = mha.heads[0]
    assert [lin.in_features for lin in (head.query, head.key, head.value)] == [8, 8, 8]
    assert head.future is None and mha.proj.in_features == 12


def test_key_defaults_to_query_and_value_to_key():
    torch.manual_seed(0)
    mha = MultiHeadAttention(num_heads=2, emb_size=8, head_size=4).eval()
    x, ctx = torch.randn(2, 5, 8), torch.randn(2, 3, 8)
    assert torch.equal(mha(x), mha(x, x, x))
    assert torch.equal(mha(x, ctx), mha(x, ctx, ctx))


def test_causal_heads_each_have_their_own_triu_buffer():
    torch.manual_seed(0)
    # head_size 6 is not 16 / 4: heads concatenate to 24 and are projected back to 16.
    mha = MultiHeadAttention(
        num_heads=4, emb_size=16, head_size=6, causal=True, max_seq_len=32
    ).eval()
    masks = [h.future for h in mha.heads]
    assert all(torch.equal(m, torch.triu(torch.ones(32, 32), diagonal=1).bool()) for m in masks)
    assert len({m.data_ptr() for m in masks}) == 4  # one buffer per head, not a shared one
    assert not any("future" in name for name in mha.state_dict())
    x = torch.randn(3, 12, 16)
    y = mha(x)
    assert y.shape == (3, 12, 16) and mha.proj.in_features == 24
    torch.testing.assert_close(y, by_hand(mha, x, x, x, future(12)), atol=1e-6, rtol=0)
    assert_causal(mha, x, t=5)


def test_a_causal_head_hides_key_j_from_query_i_when_j_is_after_i_for_any_tq_and_tk():
    torch.manual_seed(0)
    mha = MultiHeadAttention(
        num_heads=2, emb_size=16, head_size=8, causal=True, max_seq_len=16
    ).eval()
    x, ctx = torch.randn(2, 5, 16), torch.randn(2, 8, 16)
    hide = torch.arange(8) > torch.arange(5)[:, None]  # (Tq, Tk)
    expected = by_hand(mha, x, ctx, ctx, hide)
    torch.testing.assert_close(mha(x, ctx, ctx), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "kw", [dict(causal=True), dict(max_seq_len=8)], ids=["causal-alone", "max_seq_len-alone"]
)
def test_causal_and_max_seq_len_come_together(kw):
    with pytest.raises(ValueError, match="causal=True needs max_seq_len"):
        MultiHeadAttention(num_heads=2, emb_size=8, head_size=4, **kw)


def test_a_query_with_valid_length_0_averages_the_values():
    # d2l's masked_softmax sets hidden scores to -1e6, not -inf: a query of valid length 0 gets
    # uniform weights, the mean of the values.
    torch.manual_seed(0)
    mha = MultiHeadAttention(
        num_heads=5, emb_size=100, head_size=20, query_size=10, key_size=20, value_size=30
    ).eval()
    queries, keys, values = torch.randn(2, 4, 10), torch.randn(2, 6, 20), torch.randn(2, 6, 30)
    for lens in (torch.tensor([3, 0]), torch.tensor([[1, 0, 3, 4], [6, 5, 0, 3]])):
        per_q = lens[:, None].expand(2, 4) if lens.dim() == 1 else lens  # (B, Tq)
        hide = torch.arange(6) >= per_q[..., None]  # (B, Tq, Tk)
        y = mha(queries, keys, values, valid_lens=lens)
        expected = by_hand(mha, queries, keys, values, hide, fill=-1e6)
        torch.testing.assert_close(y, expected, atol=1e-5, rtol=0)
        empty = per_q == 0  # (B, Tq)
        means = mean_of_values(mha, values).expand(-1, 4, -1)
        torch.testing.assert_close(y[empty], means[empty], atol=1e-5, rtol=0)
        w = weights(mha, queries, keys, values, valid_lens=lens)  # (nh, B, Tq, Tk)
        assert torch.all(w[:, empty] == 1 / 6)


def test_a_mask_hiding_every_key_averages_the_values():
    # scores.masked_fill(mask == 0, -1e9): a query whose mask row is all 0 gets uniform weights.
    torch.manual_seed(0)
    mha = MultiHeadAttention(num_heads=4, emb_size=32, head_size=8).eval()
    query, memory = torch.randn(2, 5, 32), torch.randn(2, 7, 32)
    per_seq = (torch.arange(7) < torch.tensor([4, 0])[:, None]).float()[:, None, None, :]
    per_query = (torch.rand(2, 1, 5, 7) > 0.5).float()
    per_query[..., 0] = 1
    per_query[1, 0, 3] = 0  # query 3 of sequence 1 sees nothing
    for mask in (per_seq, per_query, per_query.bool()):
        y = mha(query, memory, memory, mask)
        hide = mask[:, 0] == 0  # (B, Tq|1, Tk)
        expected = by_hand(mha, query, memory, memory, hide, fill=-1e9)
        torch.testing.assert_close(y, expected, atol=1e-5, rtol=0)
        empty = hide.all(-1).expand(2, 5)  # (B, Tq)
        means = mean_of_values(mha, memory).expand(-1, 5, -1)
        torch.testing.assert_close(y[empty], means[empty], atol=1e-5, rtol=0)
        assert torch.all(weights(mha, query, memory, memory, mask)[:, empty] == 1 / 7)


def test_a_visible_key_scoring_under_the_fill_loses_to_the_hidden_ones():
    """What the fill values mean: valid_lens alone hides with -1e6 (d2l), so a visible key scoring
    -2e6 gets no weight; a mask hides with -1e9, under it."""
    mha = MultiHeadAttention(num_heads=1, emb_size=4, head_size=4, bias=False).eval()
    with torch.no_grad():
        mha.heads[0].query.weight.copy_(1000 * torch.eye(4))
        mha.heads[0].key.weight.copy_(-1000 * torch.eye(4))
        mha.heads[0].value.weight.copy_(torch.eye(4))
        mha.proj.weight.copy_(torch.eye(4))
    q, k = torch.ones(1, 1, 4), torch.ones(1, 3, 4)  # every score -4e6 / sqrt(4) = -2e6
    v = torch.randn(1, 3, 4)
    hidden_mean = v[:, 1:].mean(1, keepdim=True)
    torch.testing.assert_close(mha(q, k, v, valid_lens=torch.tensor([1])), hidden_mean)
    keep = torch.tensor([[True, False, False]])  # (Tq, Tk)
    torch.testing.assert_close(mha(q, k, v, keep), v[:, :1])
    torch.testing.assert_close(mha(q, k, v, keep, valid_lens=torch.tensor([1])), v[:, :1])


def test_a_causal_module_whose_mask_hides_everything_averages_the_past():
    # The causal buffer fills -inf, after the mask's -1e9: a query that the mask leaves nothing
    # averages the values up to itself, and the future stays hidden.
    torch.manual_seed(0)
    mha = MultiHeadAttention(
        num_heads=2, emb_size=16, head_size=8, causal=True, max_seq_len=16
    ).eval()
    x, nothing = torch.randn(2, 6, 16), torch.zeros(6, 6)
    prefix_means = torch.cat([mean_of_values(mha, x[:, : t + 1]) for t in range(6)], dim=1)
    torch.testing.assert_close(mha(x, mask=nothing), prefix_means, atol=1e-5, rtol=0)
    assert_causal(lambda x: mha(x, mask=nothing), x, t=2)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_valid_lens_equal_a_padding_mask_and_hide_the_padding(causal):
    torch.manual_seed(0)
    mha = MultiHeadAttention(
        num_heads=2, emb_size=16, head_size=8, causal=causal, max_seq_len=16 if causal else None
    ).eval()
    x, lens = torch.randn(2, 10, 16), torch.tensor([10, 6])
    a = mha(x, valid_lens=lens)
    mask = (torch.arange(10) < lens[:, None])[:, None, None, :]  # (B, Tk) -> (B, 1, 1, Tk)
    torch.testing.assert_close(a, mha(x, mask=mask))
    y = x.clone()
    y[1, 6:] = torch.randn(4, 16)  # rewriting the padding changes nothing that is real
    torch.testing.assert_close(a[1, :6], mha(y, valid_lens=lens)[1, :6])
    torch.testing.assert_close(a[1, :6], mha(x[1:, :6])[0], atol=1e-5, rtol=0)


def test_cross_attention_shapes_and_context_masking():
    torch.manual_seed(0)
    mha = MultiHeadAttention(num_heads=2, emb_size=16, head_size=8).eval()
    x, ctx = torch.randn(2, 5, 16), torch.randn(2, 9, 16)
    y = mha(x, ctx, ctx)
    assert y.shape == (2, 5, 16)
    # Not causal: every query sees every context position, so the last one matters to the first.
    ctx2 = ctx.clone()
    ctx2[:, -1] += 1
    assert not torch.allclose(mha(x, ctx2, ctx2)[:, 0], y[:, 0])
    # A context position past its valid length does not matter at all.
    lens = torch.tensor([9, 6])
    ctx3 = ctx.clone()
    ctx3[1, 6:] = torch.randn(3, 16)
    torch.testing.assert_close(
        mha(x, ctx, ctx, valid_lens=lens), mha(x, ctx3, ctx3, valid_lens=lens)
    )
    w = weights(mha, x, ctx, ctx, valid_lens=lens)  # (nh, B, Tq, Tk)
    assert w.shape == (2, 2, 5, 9) and torch.all(w[:, 1, :, 6:] == 0)


def test_cross_attention_equals_softmax_qk_v_over_the_context():
    """Queries from x, keys and values from the context, every weight and bias random and large."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(num_heads=2, emb_size=16, head_size=8).eval()
    with torch.no_grad():
        for p in mha.parameters():
            p.normal_(0.0, 0.3)
    x, ctx, val = torch.randn(2, 5, 16), torch.randn(2, 9, 16), torch.randn(2, 9, 16)
    torch.testing.assert_close(mha(x, ctx, val), by_hand(mha, x, ctx, val), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("case", ["valid_lens", "mask"])
def test_a_cross_attention_query_with_no_key_averages_the_values_with_finite_gradients(case):
    torch.manual_seed(0)
    mha = MultiHeadAttention(num_heads=2, emb_size=16, head_size=8).eval()
    x, ctx = torch.randn(2, 5, 16), torch.randn(2, 9, 16)
    if case == "valid_lens":  # row 0 no key, row 1 the first 3
        y = mha(x, ctx, ctx, valid_lens=torch.tensor([0, 3]))
        hide = (torch.arange(9) >= torch.tensor([[0], [3]]))[:, None, :]  # (B, 1, Tc)
    else:  # row 0 no key, row 1 the odd ones
        keep = torch.arange(9) % torch.tensor([[1], [2]]) > 0  # (B, Tc)
        y, hide = mha(x, ctx, ctx, keep[:, None, None, :]), ~keep[:, None, :]
    means = mean_of_values(mha, ctx)[0].expand(5, -1)
    torch.testing.assert_close(y[0], means, atol=1e-5, rtol=0)
    torch.testing.assert_close(y[1], by_hand(mha, x, ctx, ctx, hide)[1], atol=1e-5, rtol=0)
    y[1].square().sum().backward()  # the real row only
    assert all(p.grad.isfinite().all() for p in mha.parameters())


def test_a_head_alone_is_softmax_qk_v_and_its_fill_defaults_to_minus_1e9():
    torch.manual_seed(0)
    head = Head(8, 6, 5, 4, None, 0.0, True)
    q, k, v = torch.randn(2, 3, 8), torch.randn(2, 7, 6), torch.randn(2, 7, 5)
    keep = torch.rand(2, 3, 7) > 0.5
    keep[1, 2] = False  # a query that sees nothing: uniform weights under the -1e9 fill
    scores = linear(q, head.query) @ linear(k, head.key).transpose(-2, -1) / 2  # sqrt(4)
    expected = scores.masked_fill(~keep, -1e9).softmax(-1) @ linear(v, head.value)
    torch.testing.assert_close(head(q, k, v, keep), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(
        head(q, k, v), scores.softmax(-1) @ linear(v, head.value), atol=1e-6, rtol=0
    )


@pytest.mark.parametrize(
    "mask",
    [
        torch.ones(2, 5, 5, dtype=torch.bool),  # 3-D: neither write-up's shape
        torch.ones(5, dtype=torch.bool),  # 1-D
        torch.ones(5, 5, dtype=torch.long),  # neither bool nor float
    ],
    ids=["3-D", "1-D", "int"],
)
def test_a_bad_mask_raises_value_error(mask):
    mha = MultiHeadAttention(num_heads=2, emb_size=8, head_size=4)
    with pytest.raises(ValueError, match="mask: bool or 0/1 float"):
        mha(torch.randn(2, 5, 8), mask=mask)


def test_lengths_passed_fourth_are_refused_as_a_mask():
    mha = MultiHeadAttention(num_heads=2, emb_size=8, head_size=4)
    x = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match="mask"):  # the write-up's d2l call: lengths by keyword
        mha(x, x, x, torch.tensor([3, 2]))


@pytest.mark.cuda
def test_on_cuda_valid_lens_make_their_mask_on_the_inputs_device():
    torch.manual_seed(0)
    mha = MultiHeadAttention(num_heads=2, emb_size=16, head_size=8, causal=True, max_seq_len=16)
    x, lens = torch.randn(2, 10, 16), torch.tensor([[10] * 10, [6] * 10])
    cpu = mha.eval()(x, valid_lens=lens)
    gpu = mha.cuda()(x.cuda(), valid_lens=lens.cuda())
    torch.testing.assert_close(gpu.cpu(), cpu, atol=1e-5, rtol=0)
