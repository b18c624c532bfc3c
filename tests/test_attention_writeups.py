"""The textbook MultiHeadAttention as each write-up uses it, at the write-up's shapes.

Every case is checked against softmax(Q K^T / sqrt(d)) V computed here, head by head, from the
module's weights, and, where causal, by changing a future token.
"""

import math

import pytest
import torch

from model import MultiHeadAttention


def linear(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    return x @ layer.weight.T + (0 if layer.bias is None else layer.bias)


def by_hand(mha: MultiHeadAttention, query, key, value, hide: torch.Tensor | None,
            fill: float = float("-inf")) -> torch.Tensor:
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


def mean_of_values(mha: MultiHeadAttention, value: torch.Tensor) -> torch.Tensor:
    """(B, Tk, value_size) -> (B, 1, emb_size): every head's values averaged, what uniform weights give."""
    return linear(torch.cat([linear(value, h.value).mean(1, keepdim=True) for h in mha.heads], dim=-1), mha.proj)


def weights(mha: MultiHeadAttention, *args, **kwargs) -> torch.Tensor:
    """(nh, B, Tq, Tk): each head's softmax, caught on its way into the head's dropout."""
    seen = []
    hooks = [h.dropout.register_forward_hook(lambda mod, inp, out: seen.append(inp[0])) for h in mha.heads]
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


@pytest.mark.parametrize("causal, user_mask", [(True, True), (False, True), (True, False)],
                         ids=["buffer+tril", "tril-only", "buffer-only"])
def test_gpt_block_512_wide_8_heads_of_64(causal, user_mask):
    # MultiHeadAttention(num_heads=8, emb_size=512, head_size=64, max_seq_len=1024), x (2, 50, 512)
    torch.manual_seed(0)
    mha = MultiHeadAttention(num_heads=8, emb_size=512, head_size=64, causal=causal,
                             max_seq_len=1024 if causal else None, dropout=0.1).eval()
    x = torch.randn(2, 50, 512)
    mask = torch.tril(torch.ones(50, 50)) if user_mask else None  # 1 = keep
    y = mha(x, mask=mask)
    assert y.shape == (2, 50, 512)
    torch.testing.assert_close(y, by_hand(mha, x, x, x, future(50)), atol=1e-5, rtol=0)
    assert_causal(lambda x: mha(x, mask=mask), x, t=20)
    if causal:
        assert mha.heads[0].causal_mask.shape == (1024, 1024)


def test_three_inputs_of_widths_10_20_30_into_100_hidden_with_5_heads():
    # MultiHeadAttention(key_size, query_size, value_size, num_hiddens=100, num_heads=5, dropout=0.5)
    torch.manual_seed(0)
    mha = MultiHeadAttention(num_heads=5, emb_size=100, head_size=20, query_size=10, key_size=20,
                             value_size=30, dropout=0.5, bias=False).eval()
    queries, keys, values = torch.randn(2, 4, 10), torch.randn(2, 6, 20), torch.randn(2, 6, 30)
    per_seq = torch.tensor([3, 2])  # (B,): the same for every query
    per_query = torch.tensor([[1, 2, 3, 4], [6, 5, 4, 3]])  # (B, Tq)
    for lens in (per_seq, per_query):
        per_q = lens[:, None].expand(2, 4) if lens.dim() == 1 else lens  # (B, Tq): what each query sees
        hide = torch.tensor([[[j >= per_q[b, i] for j in range(6)] for i in range(4)] for b in range(2)])
        y = mha(queries, keys, values, valid_lens=lens)
        assert y.shape == (2, 4, 100)
        torch.testing.assert_close(y, by_hand(mha, queries, keys, values, hide), atol=1e-5, rtol=0)
        # The last key of sequence 1 matters to exactly the queries that may see it.
        keys2, values2 = keys.clone(), values.clone()
        keys2[1, 5], values2[1, 5] = torch.randn(20), torch.randn(30)
        y2, sees = mha(queries, keys2, values2, valid_lens=lens), ~hide[1, :, 5]  # (Tq,)
        assert torch.equal(y2[1, ~sees], y[1, ~sees])
        assert (y2[1] - y[1]).abs().amax(dim=-1).gt(1e-4).eq(sees).all()
    with pytest.raises(ValueError, match="valid_lens"):  # the write-up passes lengths fourth
        mha(queries, keys, values, per_seq)
    mha.train()
    assert 0.3 < (mha(queries, keys, values) == 0).float().mean() < 0.7  # output dropout at 0.5
    head = mha.heads[0]
    assert not torch.equal(head(queries, keys, values, None), head(queries, keys, values, None))  # on the weights


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
        mask = (torch.arange(7) < torch.tensor([7, 4])[:, None]).float()[:, None, None, :]  # (B, 1, 1, Tk)
    y = mha(query, memory, memory, mask.to(dtype))
    assert y.shape == (2, 5, 32)
    hide = mask[:, 0] == 0  # (B, Tq|1, Tk)
    torch.testing.assert_close(y, by_hand(mha, query, memory, memory, hide), atol=1e-5, rtol=0)
    assert not torch.allclose(y, mha(query, memory, memory))  # the mask did hide something


def test_single_causal_heads_each_with_its_own_triu_buffer():
    torch.manual_seed(0)
    # head_size 6 is not 16 / 4: heads concatenate to 24 and are projected back to 16.
    mha = MultiHeadAttention(num_heads=4, emb_size=16, head_size=6, causal=True, max_seq_len=32).eval()
    masks = [h.causal_mask for h in mha.heads]
    assert all(torch.equal(m, torch.triu(torch.ones(32, 32), diagonal=1).bool()) for m in masks)
    assert len({m.data_ptr() for m in masks}) == 4  # one buffer per head, not a shared one
    assert not any("causal_mask" in name for name in mha.state_dict())
    x = torch.randn(3, 12, 16)
    y = mha(x)
    assert y.shape == (3, 12, 16) and mha.proj.in_features == 24
    torch.testing.assert_close(y, by_hand(mha, x, x, x, future(12)), atol=1e-6, rtol=0)
    assert_causal(mha, x, t=5)
    with pytest.raises(ValueError, match="max_seq_len"):
        MultiHeadAttention(num_heads=4, emb_size=16, head_size=6, causal=True)


def test_valid_length_0_averages_the_values_as_d2ls_masked_softmax():
    # d2l's masked_softmax sets hidden scores to -1e6, not -inf: a query of valid length 0 gets
    # uniform weights, the mean of the values.
    torch.manual_seed(0)
    mha = MultiHeadAttention(num_heads=5, emb_size=100, head_size=20, query_size=10, key_size=20,
                             value_size=30, bias=False).eval()
    queries, keys, values = torch.randn(2, 4, 10), torch.randn(2, 6, 20), torch.randn(2, 6, 30)
    for lens in (torch.tensor([3, 0]), torch.tensor([[1, 0, 3, 4], [6, 5, 0, 3]])):
        per_q = lens[:, None].expand(2, 4) if lens.dim() == 1 else lens  # (B, Tq)
        hide = torch.arange(6) >= per_q[..., None]  # (B, Tq, Tk)
        y = mha(queries, keys, values, valid_lens=lens)
        torch.testing.assert_close(y, by_hand(mha, queries, keys, values, hide, fill=-1e6), atol=1e-5, rtol=0)
        empty = per_q == 0  # (B, Tq)
        torch.testing.assert_close(y[empty], mean_of_values(mha, values).expand(-1, 4, -1)[empty], atol=1e-5, rtol=0)
        w = weights(mha, queries, keys, values, valid_lens=lens)  # (nh, B, Tq, Tk)
        assert torch.all(w[:, empty] == 1 / 6)


def test_a_mask_hiding_every_key_averages_the_values_as_masked_fill_minus_1e9():
    # forward(query, key, value, mask): scores.masked_fill(mask == 0, -1e9), so a query whose mask
    # row is all 0 gets uniform weights, the mean of the values.
    torch.manual_seed(0)
    mha = MultiHeadAttention(num_heads=4, emb_size=32, head_size=8).eval()
    query, memory = torch.randn(2, 5, 32), torch.randn(2, 7, 32)
    per_seq = (torch.arange(7) < torch.tensor([4, 0])[:, None]).float()[:, None, None, :]  # (B, 1, 1, Tk)
    per_query = (torch.rand(2, 1, 5, 7) > 0.5).float()
    per_query[..., 0] = 1
    per_query[1, 0, 3] = 0  # query 3 of sequence 1 sees nothing
    for mask in (per_seq, per_query, per_query.bool()):
        y = mha(query, memory, memory, mask)
        hide = mask[:, 0] == 0  # (B, Tq|1, Tk)
        torch.testing.assert_close(y, by_hand(mha, query, memory, memory, hide, fill=-1e9), atol=1e-5, rtol=0)
        empty = hide.all(-1).expand(2, 5)  # (B, Tq)
        torch.testing.assert_close(y[empty], mean_of_values(mha, memory).expand(-1, 5, -1)[empty], atol=1e-5, rtol=0)
        assert torch.all(weights(mha, query, memory, memory, mask)[:, empty] == 1 / 7)
    # With lengths too, every hidden key gets the mask's -1e9: still the mean of all the values.
    y = mha(query, memory, memory, per_seq, valid_lens=torch.tensor([0, 7]))
    torch.testing.assert_close(y, mean_of_values(mha, memory).expand(-1, 5, -1), atol=1e-5, rtol=0)


def test_a_causal_module_whose_mask_hides_everything_averages_the_past():
    # The causal buffer fills -inf, after the mask's -1e9: a query that the mask leaves nothing
    # averages the values up to itself, and the future stays hidden.
    torch.manual_seed(0)
    mha = MultiHeadAttention(num_heads=2, emb_size=16, head_size=8, causal=True, max_seq_len=16).eval()
    x, nothing = torch.randn(2, 6, 16), torch.zeros(6, 6)
    prefix_means = torch.cat([mean_of_values(mha, x[:, : t + 1]) for t in range(6)], dim=1)  # (B, T, emb)
    torch.testing.assert_close(mha(x, mask=nothing), prefix_means, atol=1e-5, rtol=0)
    assert_causal(lambda x: mha(x, mask=nothing), x, t=2)


# Cross-attention and valid lengths, which the GPT's fused attention does not take: these cases
# moved here from tests/test_model.py when CausalSelfAttention dropped them.


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_valid_lens_equal_a_padding_mask_and_hide_the_padding(causal):
    torch.manual_seed(0)
    mha = MultiHeadAttention(num_heads=2, emb_size=16, head_size=8, causal=causal,
                             max_seq_len=16 if causal else None).eval()
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
    torch.testing.assert_close(mha(x, ctx, ctx, valid_lens=lens), mha(x, ctx3, ctx3, valid_lens=lens))
    w = weights(mha, x, ctx, ctx, valid_lens=lens)  # (nh, B, Tq, Tk)
    assert w.shape == (2, 2, 5, 9) and torch.all(w[:, 1, :, 6:] == 0)


def test_cross_attention_equals_softmax_qk_v_over_the_context():
    """Queries from x, keys and values from the context, every weight and bias random and large."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(num_heads=2, emb_size=16, head_size=8).eval()
    with torch.no_grad():
        for p in mha.parameters():
            p.normal_(0.0, 0.3)
    x, ctx = torch.randn(2, 5, 16), torch.randn(2, 9, 16)
    torch.testing.assert_close(mha(x, ctx, ctx), by_hand(mha, x, ctx, ctx, None), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("case", ["valid_lens", "mask"])
def test_a_cross_attention_query_with_no_key_to_see_averages_the_values_with_finite_gradients(case):
    # Row 0's context has nothing real: its queries average the values, as the write-ups' fill
    # gives, and a loss over the other row has finite gradients.
    torch.manual_seed(0)
    mha = MultiHeadAttention(num_heads=2, emb_size=16, head_size=8).eval()
    x, ctx = torch.randn(2, 5, 16), torch.randn(2, 9, 16)
    keep = torch.arange(9) % torch.tensor([[1], [2]]) > 0  # (B, Tc): row 0 no key, row 1 the odd ones
    lens = torch.tensor([0, 3])
    if case == "valid_lens":
        y, hide = mha(x, ctx, ctx, valid_lens=lens), (torch.arange(9) >= lens[:, None])[:, None, :]  # (B, 1, Tc)
    else:
        y, hide = mha(x, ctx, ctx, keep[:, None, None, :]), ~keep[:, None, :]  # (B, Tc) -> (B, 1, 1, Tc), (B, 1, Tc)
    torch.testing.assert_close(y[0], mean_of_values(mha, ctx)[0].expand(5, -1), atol=1e-5, rtol=0)
    torch.testing.assert_close(y[1], by_hand(mha, x, ctx, ctx, hide)[1], atol=1e-5, rtol=0)
    y[1].square().sum().backward()  # the real row only
    assert all(p.grad.isfinite().all() for p in mha.parameters())
