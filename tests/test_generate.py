"""Decoding (model/gpt.py): generate() against nanoGPT's uncached loop, and sample_next's draws.

`reference_generate` is nanoGPT's sampling loop, without a cache: it is the oracle while the
context fits block_size. Past it, generate's cache restarts from the last half of the context
(its docstring), which `reference_generate(..., restart=True)` spells out with fresh forwards.
"""

import pytest
import torch
from torch.testing import assert_close

from model.gpt import GPT, GPTConfig, generate, sample_next

V = 37
BLOCK = 16
LOGITS = torch.tensor([1.0, 2.0, 0.0, 1.5, -1.0])  # at temperature 1: 0.17, 0.46, 0.06, 0.28, 0.02


def tiny_model(block=BLOCK, vocab=V, **kw) -> GPT:
    """float64, untied, and weights large enough that the next-token distributions are far from
    uniform (sample_next still draws in float32)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab, block, 2, 2, 16, tie_weights=False, **kw)).double().eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return model


def prompts(B=2, T=4) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=gen(1))


def gen(seed=0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@torch.no_grad()
def reference_generate(model, idx, n, restart=False, **kw):
    """nanoGPT's loop: crop the context to block_size, forward it whole, sample from the last
    position's logits, append. -> (B, n). restart=True: generate's window instead, which grows up
    to block_size and, the step after it fills, restarts from the last half of the context (the
    new token included, at least one token)."""
    block = model.config.block_size
    window = min(idx.size(1), block)
    for _ in range(n):
        tok = sample_next(model(idx[:, -window:])[0][:, -1], **kw)
        idx = torch.cat((idx, tok[:, None]), dim=1)
        window = max(1, block // 2) if restart and window == block else min(window + 1, block)
    return idx[:, -n:]


def run(model, idx, n, **kw) -> torch.Tensor:
    """generate's tokens as (B, n)."""
    steps = list(generate(model, idx, n, **kw))
    assert len(steps) == n and all(s.shape == (idx.size(0),) for s in steps)
    return torch.stack(steps, dim=1)


@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=0), dict(temperature=1.0), dict(temperature=0.8, top_k=10, top_p=0.9)],
    ids=["greedy", "sampled", "top_k+top_p"],
)
@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize(
    "block, T", [(BLOCK, 4), (BLOCK, 1), (BLOCK, 21), (3, 2), (2, 2), (1, 1)], ids=str
)  # a prompt of one token, one longer than block_size; odd, even and one-token windows
def test_generate_is_the_uncached_loop_while_the_context_fits_then_a_fresh_window(
    sampling, pos_emb, block, T
):
    model, idx, n = tiny_model(block, pos_emb=pos_emb), prompts(2, T), BLOCK + 8
    got = run(model, idx, n, generator=gen(), **sampling)
    assert torch.equal(got, reference_generate(model, idx, n, True, generator=gen(), **sampling))
    if sampling["temperature"]:  # a random model's greedy tokens soon repeat one token
        assert len(set(got[0].tolist())) > 2 and not torch.equal(got[0], got[1])
        if pos_emb == "learned" and block > 1:  # nanoGPT's loop slides by one token instead
            want = reference_generate(model, idx, n, generator=gen(), **sampling)
            fits = max(1, block - T + 1)  # the last forward that sees the whole context
            assert torch.equal(got[:, :fits], want[:, :fits]) and not torch.equal(got, want)


def test_generate_is_a_function_of_model_prompt_and_seed_and_never_draws_the_padding():
    model = tiny_model(vocab=48)  # 37 tokens, 11 rows of padding
    with torch.no_grad():  # the padding the likeliest tokens by far
        model.lm_head.weight[V:] = model.transformer.ln_f.weight.sign() * 3
    idx, outs = prompts(3, 5), []
    assert (run(model, idx, 2 * BLOCK, generator=gen()) >= V).float().mean() > 0.5

    def draw(n, seed=1, rows=idx, **kw):
        return run(model, rows, n, generator=gen(seed), vocab_size=V, **kw)

    model.lm_head.register_forward_hook(lambda mod, inp, out: outs.append(out))
    a = draw(10 * BLOCK)  # far past block_size
    assert len(outs) == 10 * BLOCK and not any(
        o.requires_grad or not o.isfinite().all() for o in outs
    )
    assert torch.equal(a[:, :20], draw(20)) and not torch.equal(a[:, :20], draw(20, 2))
    greedy = draw(3 * BLOCK, temperature=0)  # each row as if alone
    for b in range(3):
        assert torch.equal(greedy[b], draw(3 * BLOCK, rows=idx[b : b + 1], temperature=0)[0])
    assert max(a.max(), greedy.max(), draw(20, top_k=3).max()) < V
    assert not list(generate(model, idx, 0))
    for training in (True, False):  # as it was
        run(model.train(training), idx, 2)
        assert all(m.training is training for m in model.modules())


@pytest.mark.parametrize(
    "temperature, top_k, top_p, kept",  # kept: the tokens that may be drawn
    [
        (1.0, None, None, "01234"),
        (0.5, None, None, "01234"),
        (2.0, None, None, "01234"),
        (1.0, 3, None, "013"),
        (1.0, 99, None, "01234"),
        (1.0, None, 0.7, "13"),  # 0.46 + 0.28 reach it
        (1.0, None, 0.97, "0123"),
        (1.0, None, 1.0, "01234"),
        (1.0, None, 0.0, "1"),  # the likeliest always stays
        (0.5, None, 0.85, "13"),  # top_p after the temperature: 0.66 + 0.24
        (1.0, 2, 0.97, "13"),
        (1.0, 3, 0.7, "13"),
    ],
)
def test_draws_follow_the_softmax_over_temperature_of_the_top_k_and_top_p(
    temperature, top_k, top_p, kept
):
    rows = LOGITS.half().repeat(20000, 1)  # float16 logits, drawn from in float32
    probs = (LOGITS / temperature).softmax(-1) * torch.tensor([str(i) in kept for i in range(5)])
    g, same = gen(), gen()
    for _ in range(2):  # the uniforms multinomial takes, but where rounding moves a boundary
        draws = sample_next(rows, temperature, top_k, top_p, generator=g)
        assert (
            draws != torch.multinomial(probs.repeat(20000, 1), 1, generator=same)[:, 0]
        ).sum() < 20
    assert set(map(str, draws.tolist())) == set(kept) and draws.dtype == torch.long
    freq = torch.bincount(draws, minlength=5) / 20000  # 5 standard errors at p = 0.5
    assert_close(freq, probs / probs.sum(), atol=0.02, rtol=0)


def test_top_p_reached_exactly_leaves_out_the_next_token_and_top_k_takes_each_rows_own():
    rows = LOGITS.repeat(4000, 1)
    probs = (rows[:1] - 2.0).sort(descending=True).values.softmax(-1)  # as sample_next rounds
    top_p = (probs.cumsum(-1) - probs)[0, 2].item()  # the two likeliest reach it exactly
    assert set(sample_next(rows, 1.0, top_p=top_p, generator=gen()).tolist()) == {1, 3}
    nudged = sample_next(rows, 1.0, top_p=top_p * (1 + 1e-6), generator=gen())
    assert set(nudged.tolist()) == {1, 3, 0}
    assert torch.equal(
        sample_next(rows, generator=gen(5)), sample_next(rows, 1.0, generator=gen(5))
    )
    rows = torch.randn(300, V, generator=gen(1))  # each row its own k likeliest
    picks = sample_next(rows, 1.0, top_k=4, generator=gen())
    assert torch.isin(picks[:, None], rows.topk(4).indices).any(-1).all()


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [
        (0, None, None),
        (0, 1, 0.5),
        (1e-300, None, None),
        (1e-40, None, None),
        (1e-300, 5, 1e-300),
        (0.8, None, 1e-300),
        (0.8, None, 1e-6),
        (0.8, None, 0.0),
        (1e-300, 1, None),
    ],
)
def test_temperature_0_or_a_tiny_temperature_or_top_p_gives_the_argmax_and_no_nan(
    temperature, top_k, top_p
):
    logits = torch.randn(64, V, generator=gen()) * 3
    logits[0, -1] = float("-inf")  # a token some filter already left out
    logits[1, 5] = 3e38  # a huge logit: it still wins, and nothing overflows to nan
    drawn = sample_next(logits, temperature, top_k, top_p, generator=gen())
    assert torch.equal(drawn, logits.argmax(-1))


@pytest.mark.compiles
def test_compiled_decoding_draws_the_same_tokens_as_eager():
    from torch._dynamo.utils import counters

    from model.compiled import compiled

    model, idx, n = tiny_model().float(), prompts(2, 5), 2 * BLOCK
    eager = run(model, idx, n, generator=gen(), top_k=20)  # past block_size: prompts of several
    traced = counters["stats"]["unique_graphs"]  # lengths go through the compiled forward
    assert torch.equal(run(compiled(model), idx, n, generator=gen(), top_k=20), eager)
    assert counters["stats"]["unique_graphs"] > traced and len(set(eager[0].tolist())) > 2


@pytest.mark.cuda
def test_on_cuda_generate_decodes_the_cpus_greedy_tokens():
    model = tiny_model()
    idx = prompts()
    cpu = run(model, idx, 3 * BLOCK, temperature=0)
    assert torch.equal(run(model.cuda(), idx.cuda(), 3 * BLOCK, temperature=0).cpu(), cpu)
