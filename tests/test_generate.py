"""Decoding (model/gpt.py): generate() against nanoGPT's uncached loop, and sample_next's draws.

`reference_generate` is nanoGPT's sampling loop, without a cache: it is the oracle while the
context fits block_size. Past it, generate's cache restarts from the last half of the context
(its docstring), which `reference_generate(..., restart=True)` spells out with fresh forwards.
"""

import ast

import pytest
import torch
from conftest import rows

from model.gpt import GPT, GPTConfig, generate, sample_next

V = 37
BLOCK = 16
LOGITS = torch.tensor([1.0, 2.0, 0.0, 1.5, -1.0])  # at temperature 1: 0.17, 0.46, 0.06, 0.28, 0.02


def tiny_model(block=BLOCK, vocab=V, **kw):
    """float64, untied, and weights large enough that the next-token distributions are far from
    uniform (sample_next still draws in float32)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab, block, 2, 2, 16, tie_weights=False, **kw)).double().eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return model


def prompts(B=2, T=4):
    return torch.randint(0, V, (B, T), generator=gen(1))


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


@torch.no_grad()
def reference_generate(model, idx, sampling, restart=False):
    """nanoGPT's loop: crop the context to block_size, forward it whole, sample from the last
    position's logits, append. -> (B, 24). restart=True: generate's window instead, which grows up
    to block_size and, the step after it fills, restarts from the last half of the context (the
    new token included, at least one token)."""
    block = model.config.block_size
    window, g = min(idx.size(1), block), gen()
    for _ in range(24):
        tok = sample_next(model(idx[:, -window:])[0][:, -1], *sampling, generator=g)
        idx = torch.cat((idx, tok[:, None]), 1)
        window = max(1, block // 2) if restart and window == block else min(window + 1, block)
    return idx[:, -24:]


def run(model, idx, n, *sampling, seed=0, **kw):
    """generate's tokens as (B, n), drawn with gen(seed)."""
    out = torch.stack([*generate(model, idx, n, *sampling, generator=gen(seed), **kw)], 1)
    assert out.shape == (len(idx), n)  # n steps of (B,)
    return out


def tuples(text):
    """The tuples of a text of them written without their parentheses, ";" between them."""
    return [ast.literal_eval(f"({t},)") for t in text.split("; ")]


# greedy, sampled, top_k and top_p: temperature, top_k, top_p
@pytest.mark.parametrize("sampling", tuples("0; 1.0; 0.8, 10, 0.9"))
@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize(
    "block, T", tuples(f"{BLOCK}, 4; {BLOCK}, 1; {BLOCK}, 21; 3, 2; 2, 2; 1, 1")
)  # a prompt of one token, one longer than block_size; odd, even and one-token windows
def test_generate_is_the_uncached_loop_while_the_context_fits_then_a_fresh_window(
    sampling, pos_emb, block, T
):
    model, idx = tiny_model(block, pos_emb=pos_emb), prompts(2, T)
    got = run(model, idx, 24, *sampling)  # past BLOCK
    assert torch.equal(got, reference_generate(model, idx, sampling, True))
    if sampling[0]:  # a random model's greedy tokens soon repeat one token
        assert len(got[0].unique()) > 2 and not torch.equal(got[0], got[1])
        if pos_emb == "learned" and block > 1:  # nanoGPT's loop slides by one token instead
            want = reference_generate(model, idx, sampling)
            fits = max(1, block - T + 1)  # the last forward that sees the whole context
            assert torch.equal(got[:, :fits], want[:, :fits]) and not torch.equal(got, want)


def test_generate_is_a_function_of_model_prompt_and_seed_and_never_draws_the_padding():
    model, idx, outs = tiny_model(vocab=48), prompts(3, 5), []  # 37 tokens, 11 rows of padding
    model.lm_head.weight.data[V:] = model.transformer.ln_f.weight.sign() * 3  # likeliest by far
    assert (run(model, idx, 2 * BLOCK) >= V).sum() > 48  # half of 3 x 32

    def draw(n, rows=idx, **kw):
        return run(model, rows, n, vocab_size=V, **kw)

    model.lm_head.register_forward_hook(lambda *a: outs.append(a[2]))
    a = draw(10 * BLOCK)  # far past block_size
    assert len(outs) == 10 * BLOCK and not any(
        o.requires_grad or not o.isfinite().all() for o in outs
    )
    assert torch.equal(a[:, :20], draw(20)) and not torch.equal(a[:, :20], draw(20, seed=2))
    greedy = draw(3 * BLOCK, temperature=0)  # each row as if alone
    assert torch.equal(
        greedy, torch.cat([draw(3 * BLOCK, rows=row[None], temperature=0) for row in idx])
    )
    assert max(a.max(), greedy.max(), draw(20, top_k=3).max()) < V
    assert not list(generate(model, idx, 0))
    for training in (True, False):  # as it was
        run(model.train(training), idx, 2)
        assert all(m.training is training for m in model.modules())


# the tokens that may be drawn | temperature, top_k, top_p. At temperature 1 the probabilities are
# 0.17, 0.46, 0.06, 0.28, 0.02: top_p 0.7 is reached by 0.46 + 0.28; top_p 0 keeps the likeliest;
# at temperature 0.5, top_p 0.85 is reached by 0.66 + 0.24 (top_p after the temperature).
DRAWS = """01234 | 1.0
01234 | 0.5
01234 | 2.0
013 | 1.0, 3
01234 | 1.0, 99
13 | 1.0, None, 0.7
0123 | 1.0, None, 0.97
01234 | 1.0, None, 1.0
1 | 1.0, None, 0.0
13 | 0.5, None, 0.85
13 | 1.0, 2, 0.97
13 | 1.0, 3, 0.7"""


@pytest.mark.parametrize("kept, sampling", rows(DRAWS))
def test_draws_follow_the_softmax_over_temperature_of_the_top_k_and_top_p(kept, sampling):
    [sampling] = tuples(sampling)
    probs = (LOGITS / sampling[0]).softmax(-1) * torch.tensor([c in kept for c in "01234"])
    g, same = gen(), gen()
    for _ in range(2):  # the uniforms multinomial takes, but where rounding moves a boundary
        draws = sample_next(LOGITS.half().repeat(20000, 1), *sampling, generator=g)  # in float32
        assert (draws != probs.repeat(20000, 1).multinomial(1, generator=same)[:, 0]).sum() < 20
    # The frequencies follow: those of multinomial's own draws, but for under 20 of 20000.
    assert set(map(str, draws.tolist())) == set(kept) and draws.dtype == torch.long


def test_top_p_reached_exactly_leaves_out_the_next_token_and_top_k_takes_each_rows_own():
    probs = (LOGITS - 2.0).sort(descending=True).values.softmax(-1)  # as sample_next rounds
    top_p = (probs.cumsum(-1) - probs)[2].item()  # the two likeliest reach it exactly
    # At the default temperature, which must be 1.0: any other moves the sums off the boundary.
    for p, kept in (top_p, {1, 3}), (top_p * (1 + 1e-6), {1, 3, 0}):
        assert set(sample_next(LOGITS.repeat(4000, 1), top_p=p, generator=gen()).tolist()) == kept
    rows = torch.randn(300, V, generator=gen(1))  # each row its own k likeliest
    picks = sample_next(rows, top_k=4, generator=gen())[:, None]
    assert (picks == rows.topk(4).indices).any(-1).all()


@pytest.mark.parametrize(  # temperature, top_k, top_p
    "sampling",
    tuples(
        "0; 0, 1, 0.5; 1e-300; 1e-40; 1e-300, 5, 1e-300; 0.8, None, 1e-300; 0.8, None, 1e-6; "
        "0.8, None, 0.0; 1e-300, 1"
    ),
)
def test_temperature_0_or_a_tiny_temperature_or_top_p_gives_the_argmax_and_no_nan(sampling):
    logits = torch.randn(64, V, generator=gen()) * 3
    logits[0, -1] = -torch.inf  # a token some filter already left out
    logits[1, 5] = 3e38  # a huge logit: it still wins, and nothing overflows to nan
    assert torch.equal(sample_next(logits, *sampling, generator=gen()), logits.argmax(-1))


@pytest.mark.slow  # it compiles
def test_compiled_decoding_draws_the_same_tokens_as_eager():
    from torch._dynamo.utils import counters

    from model.compiled import compiled

    model, idx, n = tiny_model().float(), prompts(2, 5), 2 * BLOCK
    eager = run(model, idx, n, top_k=20)  # past block_size: prompts of several
    traced = counters["stats"]["unique_graphs"]  # lengths go through the compiled forward
    assert torch.equal(run(compiled(model), idx, n, top_k=20), eager)
    assert counters["stats"]["unique_graphs"] > traced and len(eager[0].unique()) > 2


@pytest.mark.cuda
def test_on_cuda_generate_decodes_the_cpus_greedy_tokens():
    model, idx = tiny_model(), prompts()
    cpu = run(model, idx, 3 * BLOCK, 0)  # greedy
    assert torch.equal(run(model.cuda(), idx.cuda(), 3 * BLOCK, 0).cpu(), cpu)
