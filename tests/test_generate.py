"""Decoding (model/gpt.py): generate() against nanoGPT's uncached loop, and sample_next's draws.

`reference_generate` is nanoGPT's sampling loop, without a cache: it is the oracle while the
context fits block_size. Past it, generate's cache restarts from the last half of the context
(its docstring), and `window_generate` spells that window out with fresh forwards.
"""

import pytest
import torch

from model.gpt import GPT, GPTConfig, generate, sample_next

V = 37
BLOCK = 16


def tiny_model(seed=0, block=BLOCK, vocab=V, **kw) -> GPT:
    """float64, untied, and weights large enough that the next-token distributions are far from
    uniform (sample_next still draws in float32)."""
    torch.manual_seed(seed)
    cfg = GPTConfig(
        vocab_size=vocab, block_size=block, n_layer=2, n_head=2, n_embd=16, tie_weights=False, **kw
    )
    model = GPT(cfg).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model


def prompts(B=2, T=4, seed=1) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def gen(seed=0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@torch.no_grad()
def reference_generate(model, idx, n, temperature=1.0, top_k=None, top_p=None, generator=None):
    """nanoGPT's loop: crop the context to block_size, forward it whole, sample from the last
    position's logits, append. -> (B, n)."""
    for _ in range(n):
        logits, _ = model(idx[:, -model.config.block_size :])
        tok = sample_next(logits[:, -1, :], temperature, top_k, top_p, generator)
        idx = torch.cat((idx, tok[:, None]), dim=1)
    return idx[:, -n:]


@torch.no_grad()
def window_generate(model, idx, n, temperature=1.0, top_k=None, top_p=None, generator=None):
    """Fresh forwards over generate's window: the context grows up to block_size; the step after
    it fills, the window restarts from the last half of the context (the new token included, at
    least one token) and grows again. -> (B, n)."""
    block = model.config.block_size
    window = min(idx.size(1), block)
    for _ in range(n):
        logits, _ = model(idx[:, -window:])
        tok = sample_next(logits[:, -1, :], temperature, top_k, top_p, generator)
        idx = torch.cat((idx, tok[:, None]), dim=1)
        window = max(1, block // 2) if window == block else window + 1
    return idx[:, -n:]


def run(model, idx, n, **kw) -> torch.Tensor:
    """generate's tokens as (B, n)."""
    steps = list(generate(model, idx, n, **kw))
    assert len(steps) == n and all(s.shape == (idx.size(0),) for s in steps)
    return torch.stack(steps, dim=1)


SAMPLINGS = pytest.mark.parametrize(
    "sampling",
    [dict(temperature=0), dict(temperature=1.0), dict(temperature=0.8, top_k=10, top_p=0.9)],
    ids=["greedy", "sampled", "top_k+top_p"],
)


@SAMPLINGS
@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_generate_draws_the_uncached_loops_tokens_while_the_context_fits(sampling, pos_emb):
    model = tiny_model(pos_emb=pos_emb)
    idx = prompts(B=3, T=4)
    n = BLOCK - 4 + 1  # the last forward sees exactly block_size tokens
    got = run(model, idx, n, generator=gen(), **sampling)
    assert torch.equal(got, reference_generate(model, idx, n, generator=gen(), **sampling))
    if sampling["temperature"]:  # a random model's greedy tokens soon repeat one token
        assert len(set(got[0].tolist())) > 2 and not torch.equal(got[0], got[1])


def test_batched_rows_decode_as_each_row_alone_when_greedy():
    model = tiny_model()
    idx = prompts(B=3, T=5)
    batched = run(model, idx, 3 * BLOCK, temperature=0)
    for b in range(3):
        assert torch.equal(batched[b], run(model, idx[b : b + 1], 3 * BLOCK, temperature=0)[0])


def test_a_prompt_of_one_token_and_zero_new_tokens():
    model = tiny_model()
    idx = prompts(B=2, T=1)
    assert list(generate(model, idx, 0)) == []
    got = run(model, idx, 5, generator=gen(3))
    assert torch.equal(got, reference_generate(model, idx, 5, generator=gen(3)))


@SAMPLINGS
@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize(
    "block, T", [(BLOCK, 4), (BLOCK, 21), (3, 2), (2, 2), (1, 1)], ids=str
)  # a prompt longer than block_size; odd, even and one-token windows
def test_past_block_size_each_token_comes_from_a_fresh_forward_over_its_window(
    sampling, pos_emb, block, T
):
    model = tiny_model(block=block, pos_emb=pos_emb)
    idx, n = prompts(B=2, T=T), 3 * BLOCK
    got = run(model, idx, n, generator=gen(), **sampling)
    assert torch.equal(got, window_generate(model, idx, n, generator=gen(), **sampling))
    if sampling["temperature"]:
        assert len(set(got[0].tolist())) > 2


def test_the_first_token_past_the_window_differs_from_the_uncached_loops():
    """Where nanoGPT slides by one token, generate restarts from half the context: the tokens
    after the slide come from another window (this is what the window test pins down)."""
    model = tiny_model()
    idx = prompts(B=2, T=4)
    n = 3 * BLOCK
    got = run(model, idx, n, generator=gen())
    want = reference_generate(model, idx, n, generator=gen())
    assert torch.equal(got[:, : BLOCK - 3], want[:, : BLOCK - 3]) and not torch.equal(got, want)


def test_generate_stays_finite_far_past_block_size():
    model = tiny_model(pos_emb="rope")
    finite = []
    model.lm_head.register_forward_hook(
        lambda mod, inp, out: finite.append(bool(torch.isfinite(out).all()))
    )
    got = run(model, prompts(B=2, T=3), 10 * BLOCK, generator=gen())
    assert len(finite) == 10 * BLOCK and all(finite)
    assert got.min() >= 0 and got.max() < V


@pytest.mark.parametrize("training", [True, False])
def test_generate_leaves_model_training_as_it_was(training):
    model = tiny_model().train(training)
    run(model, prompts(), BLOCK, temperature=0)
    assert model.training is training
    assert all(m.training is training for m in model.modules())


def test_generate_never_draws_a_padded_logit_past_vocab_size():
    model = tiny_model(vocab=48)  # 37 real tokens, 11 rows of padding
    with torch.no_grad():  # make the padding the likeliest tokens by far
        model.lm_head.weight[V:] = model.transformer.ln_f.weight.sign() * 3
    idx = prompts()
    free = run(model, idx, 2 * BLOCK, generator=gen())
    assert (free >= V).float().mean() > 0.5  # without vocab_size the padding is drawn
    for sampling in (dict(temperature=0), dict(temperature=1.0), dict(top_k=3)):
        got = run(model, idx, 2 * BLOCK, vocab_size=V, generator=gen(), **sampling)
        assert got.max() < V


def test_generate_runs_without_grad_and_the_same_seed_gives_the_same_tokens():
    model = tiny_model()
    idx = prompts()
    grads = []
    model.lm_head.register_forward_hook(lambda mod, inp, out: grads.append(out.requires_grad))
    a = run(model, idx, 20, generator=gen(1))
    assert grads and not any(grads)
    assert torch.equal(a, run(model, idx, 20, generator=gen(1)))
    assert not torch.equal(a, run(model, idx, 20, generator=gen(2)))


# ------------------------------------------------------------------ sample_next


def test_temperature_0_is_the_argmax():
    logits = torch.randn(64, V, generator=gen())
    assert torch.equal(sample_next(logits, 0), logits.argmax(-1))
    assert torch.equal(sample_next(logits, 0, top_k=1, top_p=0.5), logits.argmax(-1))


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_draws_follow_softmax_of_logits_over_temperature(temperature):
    logits = torch.tensor([1.0, 2.0, 0.0, 1.5, -1.0])
    rows = logits.repeat(20000, 1)
    draws = sample_next(rows, temperature, generator=gen(0))
    # the same generator state through torch.multinomial: the same uniforms, so the same draws
    # but where float rounding moves a boundary under one
    probs = (logits / temperature).softmax(-1)
    same = torch.multinomial(probs.repeat(20000, 1), 1, generator=gen(0))[:, 0]
    assert (draws != same).float().mean() < 1e-3
    freq = torch.bincount(draws, minlength=5) / 20000
    torch.testing.assert_close(freq, probs, atol=0.02, rtol=0)  # 5 standard errors at p = 0.5
    if temperature != 1.0:  # not what temperature 1 would draw
        assert (probs - logits.softmax(-1)).abs().amax() > 0.1
    g = gen(0)  # a second draw: sample_next takes from the generator what multinomial takes
    sample_next(rows, temperature, generator=g)
    second = sample_next(rows, temperature, generator=g)
    g = gen(0)
    torch.multinomial(probs.repeat(20000, 1), 1, generator=g)
    assert (second != torch.multinomial(probs.repeat(20000, 1), 1, generator=g)[:, 0]).sum() < 20
    assert torch.equal(
        sample_next(rows[:100], generator=gen(5)), sample_next(rows[:100], 1.0, generator=gen(5))
    )  # the default temperature is 1


def test_top_k_keeps_only_the_k_likeliest():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9, -1.0, 2.8, 0.5]]).repeat(4000, 1)
    drawn = set(sample_next(logits, 1.0, top_k=3, generator=gen()).tolist())
    assert drawn == {1, 3, 5}
    assert set(sample_next(logits, 1.0, top_k=1, generator=gen()).tolist()) == {1}
    assert set(sample_next(logits, 1.0, top_k=7, generator=gen()).tolist()) == set(range(7))
    assert set(sample_next(logits, 1.0, top_k=99, generator=gen()).tolist()) == set(range(7))
    rows = torch.randn(300, V, generator=gen(1))  # each row its own k likeliest
    picks = sample_next(rows, 1.0, top_k=4, generator=gen())
    assert torch.isin(picks[:, None], rows.topk(4).indices).any(-1).all()


def test_top_p_keeps_the_fewest_whose_probability_reaches_p():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log().repeat(4000, 1)

    def drawn(**kw):
        return set(sample_next(logits, 1.0, generator=gen(), **kw).tolist())

    assert drawn(top_p=0.75) == {1, 3}  # 0.5 + 0.3
    assert drawn(top_p=0.85) == {1, 3, 2}
    assert drawn(top_p=0.97) == {0, 1, 2, 3}
    assert drawn(top_p=0.4) == {1}  # the likeliest always stays
    assert drawn(top_p=0.0) == {1}
    assert drawn(top_p=1.0) == {0, 1, 2, 3}
    assert drawn(top_k=2, top_p=0.97) == {1, 3}
    assert drawn(top_k=3, top_p=0.75) == {1, 3}


def test_top_p_exactly_reached_leaves_out_the_next_token():
    """'Reaches' means >=: at top_p equal to the two likeliest's probability, the third is out."""
    logits = torch.tensor([[0.3, 2.0, 1.0, 1.5]])
    sorted_probs = (logits - logits.amax()).sort(descending=True).values.softmax(-1)
    before = sorted_probs.cumsum(-1) - sorted_probs  # what the likelier tokens add up to
    top_p = before[0, 2].item()  # the two likeliest reach it exactly
    rows = logits.repeat(4000, 1)
    assert set(sample_next(rows, 1.0, top_p=top_p, generator=gen()).tolist()) == {1, 3}
    nudged = sample_next(rows, 1.0, top_p=top_p * (1 + 1e-6), generator=gen())
    assert set(nudged.tolist()) == {1, 3, 2}


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [
        (1e-300, None, None),
        (1e-40, None, None),
        (1e-300, 5, 1e-300),
        (0.8, None, 1e-300),
        (0.8, None, 1e-6),
        (0.8, None, 0.0),
        (1e-300, 1, None),
    ],
)
def test_a_tiny_temperature_or_top_p_gives_the_argmax_and_no_nan(temperature, top_k, top_p):
    logits = torch.randn(64, V, generator=gen()) * 3
    logits[0, -1] = float("-inf")  # a token some filter already left out
    logits[1, 5] = 3e38  # a huge logit: it still wins, and nothing overflows to nan
    drawn = sample_next(logits, temperature, top_k, top_p, generator=gen())
    assert torch.equal(drawn, logits.argmax(-1))


def test_sample_next_takes_float16_logits_and_returns_one_id_a_row():
    logits = torch.randn(5, V, generator=gen()).half()
    ids = sample_next(logits, 1.0, top_k=5, top_p=0.9, generator=gen())
    assert ids.shape == (5,) and ids.dtype == torch.long
    assert torch.isin(ids[:, None], logits.float().topk(5).indices).any(-1).all()


@pytest.mark.compiles
def test_compiled_decoding_draws_the_same_tokens_as_eager():
    from model.compiled import compiled

    model = tiny_model().float()
    idx = prompts(B=2, T=5)
    n = 3 * BLOCK  # past block_size: prompts of several lengths go through the compiled forward
    kw = dict(temperature=1.0, top_k=20)
    eager = run(model, idx, n, generator=gen(), **kw)
    from torch._dynamo.utils import counters

    traced = counters["stats"]["unique_graphs"]
    assert torch.equal(run(compiled(model), idx, n, generator=gen(), **kw), eager)
    assert counters["stats"]["unique_graphs"] > traced  # the forward went through torch.compile
    assert len(set(eager[0].tolist())) > 2


@pytest.mark.cuda
def test_on_cuda_generate_decodes_the_cpus_greedy_tokens():
    model = tiny_model()
    idx = prompts()
    cpu = run(model, idx, 3 * BLOCK, temperature=0)
    assert torch.equal(run(model.cuda(), idx.cuda(), 3 * BLOCK, temperature=0).cpu(), cpu)
