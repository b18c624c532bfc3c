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


def by_hand(mha: MultiHeadAttention, query, key, value, hide: torch.Tensor | None) -> torch.Tensor:
    """hide: bool, True where a query must not see a key, broadcastable to (B, Tq, Tk)."""
    outs = []
    for head in mha.heads:
        q, k, v = linear(query, head.query), linear(key, head.key), linear(value, head.value)
        scores = torch.einsum("bqd,bkd->bqk", q, k) / math.sqrt(q.size(-1))
        if hide is not None:
            scores = scores.masked_fill(hide, float("-inf"))
        outs.append(torch.einsum("bqk,bkd->bqd", scores.softmax(dim=-1), v))
    return linear(torch.cat(outs, dim=-1), mha.proj)


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
