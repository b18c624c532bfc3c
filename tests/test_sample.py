"""Decoding: cache == recompute and == a fresh window past block_size, sampling filters and
temperature, stop strings, batching, seeds (sample.py's command line: test_sample_cli.py)."""

import os
import subprocess
import sys

import pytest
import torch

import sample
from data.files import write_json
from data.tokenizer import CharTokenizer, get_tokenizer
from model import GPT, GPTConfig, generate, sample_next
from model.checkpoint import save_checkpoint

CHARS = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
TOK = CharTokenizer(list(CHARS))
BLOCK = 16
# One thread: these models are tiny, and on a busy machine intra-op threads spin-wait for each
# other on every small op.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def tiny_model(seed: int = 0, vocab: int = len(CHARS), block: int = BLOCK, **kw) -> GPT:
    """float64 so cache vs recompute vs batched differ by ~1e-15: no argmax ties flip."""
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=vocab, block_size=block, n_layer=2, n_head=2, n_embd=16, **kw)
    model = GPT(cfg).double().eval()
    with torch.no_grad():  # sharper than the 0.02 init, so greedy text is not one repeated token
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    return model


def make_run(tmp_path, vocab: int = len(CHARS), chars: str = CHARS, seed: int = 0):
    model = tiny_model(seed, vocab).float()
    run = tmp_path / "run"
    save_checkpoint(run, {"model": model.state_dict(), "model_config": model.config.to_dict()})
    write_json(run / "manifest.json", {"name": "t", "tokenizer": "char", "vocab_size": len(chars),
                                       "chars": chars, "eot_id": None})
    return run


def greedy(model, rows, n, use_cache=True):
    idx, pad = sample.left_pad(rows, "cpu")
    steps = generate(model, idx, n, temperature=0, padding_mask=pad, use_cache=use_cache)
    return torch.stack(list(steps), dim=1).tolist()


# ------------------------------------------------------------------ decoding


@pytest.mark.parametrize("arch", [{}, dict(pos_emb="rope", norm="rmsnorm", qk_norm=True)], ids=["gpt2", "rope"])
@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, top_k=20, top_p=0.9)],
                         ids=["greedy", "seeded-top-k-top-p"])
def test_the_fast_path_draws_the_reference_loops_tokens_within_block_size(monkeypatch, arch, sampling):
    """The KV cache, one step at a time and DECODE_CHUNK steps a call (compile=True's path, run
    eagerly here), gives the uncached reference loop's tokens: greedy, and sampled with one seed."""
    from model import kv_cache

    monkeypatch.setattr(kv_cache, "compiled_decode_steps", lambda: kv_cache.decode_steps)
    model = tiny_model(**arch)
    rows = [TOK.encode("ROMEO:"), TOK.encode("Ay")]  # unequal lengths: left padding on both paths
    idx, pad = sample.left_pad(rows, "cpu")
    n = BLOCK - 6 + 1  # the last token is predicted from exactly block_size positions

    def run(**kw):
        gen = torch.Generator().manual_seed(0)
        return torch.stack(list(generate(model, idx, n, padding_mask=pad, generator=gen, **sampling, **kw)), 1).tolist()

    reference = run(use_cache=False)
    assert run() == reference and run(compile=True) == reference
    assert len(set(reference[0])) > 1  # a non-trivial sequence, or equality would prove little


def test_decoding_far_past_block_size_works_and_stays_finite():
    model = tiny_model()
    finite = []
    model.lm_head.register_forward_hook(lambda m, i, out: finite.append(bool(torch.isfinite(out).all())))
    rows = [TOK.encode("ROMEO:"), TOK.encode("A")]
    gen = torch.Generator().manual_seed(0)
    texts = sample.generate_texts(model, TOK, rows, 5 * BLOCK, temperature=1.0, generator=gen)
    assert [len(t) for t in texts] == [5 * BLOCK] * 2  # one char per token, none lost at the slides
    assert finite and all(finite)
    # greedy, cached and not, past the window: both run and agree while the windows coincide
    assert greedy(model, rows[:1], 5 * BLOCK)[0][: BLOCK - 6] == greedy(model, rows[:1], BLOCK - 6, use_cache=False)[0]


@pytest.mark.parametrize("arch", [{}, dict(pos_emb="rope")], ids=["gpt2", "rope"])
@pytest.mark.parametrize("prompt, block", [("ROMEO:", BLOCK), ("First Citizen:\nWe", BLOCK), ("ROMEO:", 3), ("RO", 2)],
                         ids=["short", "longer than block_size", "block_size 3", "block_size 2"])
def test_cached_decoding_past_block_size_equals_a_fresh_forward_over_its_window(arch, prompt, block):
    """Once a row's context fills block_size, its cache restarts from its last block_size // 2
    tokens and grows again: every token must be the argmax of a fresh forward over that window."""
    model = tiny_model(block=block, **arch)
    tokens, n = TOK.encode(prompt), 3 * BLOCK
    window, expected = min(len(tokens), block), []
    for _ in range(n):
        expected.append(int(model(torch.tensor([tokens[-window:]]))[0][0, -1].argmax()))
        tokens.append(expected[-1])
        window = max(1, block // 2) if window >= block else window + 1
    assert greedy(model, [TOK.encode(prompt)], n)[0] == expected
    assert len(set(expected)) > 2  # not one repeated token


@pytest.mark.compiles
def test_compiled_decode_step_equals_eager_past_block_size():
    model = tiny_model()
    rows = [TOK.encode("ROMEO:"), TOK.encode("A")]  # left padding, and slides past block_size
    idx, pad = sample.left_pad(rows, "cpu")

    def run(compile):
        gen = torch.Generator().manual_seed(0)
        steps = generate(model, idx, 3 * BLOCK, temperature=1.0, top_k=20, padding_mask=pad, generator=gen,
                         compile=compile)
        return torch.stack(list(steps), dim=1).tolist()

    from torch._dynamo.utils import counters

    eager = run(False)
    traced = counters["stats"]["unique_graphs"]
    assert run(True) == eager
    assert counters["stats"]["unique_graphs"] > traced  # the step really went through torch.compile
    assert len(set(eager[0])) > 1
    # Past dynamo's recompile limit (8 graphs; 1 here) a new shape decodes eagerly, not fails
    idx, pad = sample.left_pad(rows + [TOK.encode("JULIET:")], "cpu")
    with torch._dynamo.config.patch(recompile_limit=1):
        assert run(True) == run(False)


def test_sampling_draws_each_token_with_its_probability():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3, 0.0])
    gen = torch.Generator().manual_seed(0)
    draws = sample_next(probs.log().repeat(20000, 1), 1.0, generator=gen)
    freq = torch.bincount(draws, minlength=5) / 20000
    torch.testing.assert_close(freq, probs, atol=0.01, rtol=0)  # ~3 standard errors at p = 0.5


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_sampling_at_a_temperature_draws_with_softmax_of_logits_over_t(temperature):
    logits = torch.tensor([1.0, 2.0, 0.0, 1.5])
    gen = torch.Generator().manual_seed(0)
    freq = torch.bincount(sample_next(logits.repeat(40000, 1), temperature, generator=gen), minlength=4) / 40000
    expected = (logits / temperature).softmax(-1)
    torch.testing.assert_close(freq, expected, atol=0.01, rtol=0)  # 4 standard errors at p = 0.5
    assert (expected - logits.softmax(-1)).abs().max() > 0.1  # not what temperature 1 would draw
    rows = logits.repeat(1000, 1)  # the default temperature is 1
    assert torch.equal(sample_next(rows, generator=torch.Generator().manual_seed(0)),
                       sample_next(rows, 1.0, generator=torch.Generator().manual_seed(0)))


def test_top_k_keeps_only_the_k_likeliest():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9, -1.0, 2.8, 0.5]]).repeat(4000, 1)
    gen = torch.Generator().manual_seed(0)
    drawn = set(sample_next(logits, temperature=1.0, top_k=3, generator=gen).tolist())
    assert drawn == {1, 3, 5}
    assert set(sample_next(logits, temperature=0).tolist()) == {1}  # temperature 0 is argmax
    one_row = {sample_next(logits[:1], 1.0, top_k=3, generator=gen).item() for _ in range(300)}
    assert one_row == {1, 3, 5}  # fewer rows than k


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log().repeat(4000, 1)
    gen = torch.Generator().manual_seed(0)
    assert set(sample_next(logits, 1.0, top_p=0.75, generator=gen).tolist()) == {1, 3}  # 0.5 + 0.3
    assert set(sample_next(logits, 1.0, top_p=0.85, generator=gen).tolist()) == {1, 3, 2}
    assert set(sample_next(logits, 1.0, top_p=0.1, generator=gen).tolist()) == {1}  # the top one always stays
    assert set(sample_next(logits, 1.0, top_k=3, top_p=0.75, generator=gen).tolist()) == {1, 3}


@pytest.mark.parametrize("temperature, top_k, top_p", [(1e-300, None, None), (1e-40, None, None), (1e-300, 5, 1e-300),
                                                       (0.8, None, 1e-300), (0.8, None, 1e-6), (1e-300, 1, None)])
def test_a_tiny_temperature_or_top_p_keeps_the_likeliest_token_and_no_nan(monkeypatch, temperature, top_k, top_p):
    logits = torch.randn(64, len(CHARS), generator=torch.Generator().manual_seed(0)) * 3
    logits[0, -1] = float("-inf")  # an id some filter already dropped
    softmax, probs = torch.Tensor.softmax, []
    monkeypatch.setattr(torch.Tensor, "softmax", lambda t, *a, **k: probs.append(softmax(t, *a, **k)) or probs[-1])
    drawn = sample_next(logits, temperature, top_k, top_p, generator=torch.Generator().manual_seed(0))
    assert torch.equal(drawn, logits.argmax(-1)) and probs and not any(p.isnan().any() for p in probs)


def test_batched_unequal_prompts_equal_one_by_one_greedy():
    model = tiny_model()
    prompts = ["ROMEO:", "A", "First Cit", ""]
    rows = [TOK.encode(p) if p else TOK.encode("\n") for p in prompts]
    n = BLOCK - max(map(len, rows))
    batched = sample.generate_texts(model, TOK, rows, n, temperature=0)
    alone = [sample.generate_texts(model, TOK, [r], n, temperature=0)[0] for r in rows]
    assert batched == alone
    assert len(set(batched)) > 1


def test_batched_equals_one_by_one_past_block_size():
    model = tiny_model()
    rows = [TOK.encode(p) for p in ["ROMEO:", "A", "First Citizen:\nWe"]]  # the last is > block_size
    n = 4 * BLOCK
    batched = sample.generate_texts(model, TOK, rows, n, temperature=0)
    assert batched == [sample.generate_texts(model, TOK, [r], n, temperature=0)[0] for r in rows]


def test_same_seed_same_text_and_other_seed_other_text():
    model = tiny_model()
    rows = [TOK.encode("ROMEO:")] * 2

    def run(seed):
        return sample.generate_texts(model, TOK, rows, 40, temperature=1.0, top_k=20,
                                     generator=torch.Generator().manual_seed(seed))

    assert run(1) == run(1)
    assert run(1) != run(2)


# ------------------------------------------------------------------ text streams


def test_stop_string_ends_the_sample_and_keeps_it():
    s = sample.TextStream(TOK, stops=["o w", "zz"])
    pieces = [s.push(i) for i in TOK.encode("hello world. more")]
    assert s.done and s.text == "hello w" and "".join(pieces) == "hello w"
    s = sample.TextStream(TOK, stops=["\n\n", "l"])
    assert "".join(s.push(i) for i in TOK.encode("ab\n\ncl")) == "ab\n\n"
    bpe = get_tokenizer("gpt2")
    s = sample.TextStream(bpe, stops=["ld", "wor"])  # both inside one token: the earliest end wins
    assert "".join(s.push(i) for i in bpe.encode(" hello world again")) == " hello wor" == s.text


def test_stop_strings_in_generate_texts_trim_each_row():
    model = tiny_model()
    rows = [TOK.encode("ROMEO:"), TOK.encode("A")]
    full = sample.generate_texts(model, TOK, rows, 12, temperature=0)
    stop = full[0][3:5]
    stopped = sample.generate_texts(model, TOK, rows, 12, temperature=0, stops=[stop])
    for f, s in zip(full, stopped):
        assert s == (f[: f.index(stop) + len(stop)] if stop in f else f)


def test_streamed_pieces_add_up_to_each_rows_text_and_a_stop_in_every_row_ends_decoding():
    model = tiny_model()
    rows = [TOK.encode("ROMEO:"), TOK.encode("A")]
    pieces: dict[int, list[str]] = {0: [], 1: []}
    texts = sample.generate_texts(model, TOK, rows, 12, temperature=0, on_text=lambda b, p: pieces[b].append(p))
    assert ["".join(pieces[b]) for b in (0, 1)] == texts and texts[0] != texts[1]
    firsts = [text[0] for text in texts]  # as stop strings, each row's first character ends it at once
    assert sample.generate_texts(model, TOK, rows, 12, temperature=0, stops=firsts) == firsts


def test_bpe_stream_joins_multibyte_characters_split_across_tokens():
    tok = get_tokenizer("gpt2")
    text = "naïve 日本 🤗!"
    ids = tok.encode(text)
    assert any(not _valid_utf8(tok.decode_bytes([i])) for i in ids)  # the case under test occurs
    s = sample.TextStream(tok)
    pieces = [s.push(i) for i in ids] + [s.push(tok.eot_id), s.push(ids[0])]
    assert "".join(pieces) == text and s.text == text and s.done
    assert not any("\ufffd" in p for p in pieces)


def _valid_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_unescape():
    assert sample.unescape(r"a\nb\tc\\n\q") == "a\nb\tc\\n\\q"


def test_text_stream_edges():
    bpe = get_tokenizer("gpt2")
    s = sample.TextStream(bpe)
    cut = bpe.encode("é")[0]  # one token, two bytes: stopped after a token holding only the first byte
    half = [i for i in range(256) if bpe.decode_bytes([i]) == "é".encode()[:1]]
    assert s.push(half[0]) == "" and s.finish() == "\ufffd" and s.finish() == "" and s.text == "\ufffd"
    assert bpe.decode([cut]) == "é"
    s = sample.TextStream(TOK, stops=["ab"])  # a stop string at the very start of the text
    assert "".join(s.push(i) for i in TOK.encode("abc")) == "ab" and s.done
    s = sample.TextStream(TOK, stops=["a", "cab"])  # "cab" spans pieces; the longest decides how far back to look
    assert [s.push(i) for i in TOK.encode("xc")] == ["x", "c"] and not s.done
    s = sample.TextStream(bpe, stops=["an"])
    assert [s.push(i) for i in bpe.encode(" banana")] == [" ban"]  # one token: cut at the first "an", not the last


def test_cache_slots_round_up_to_eighths_of_block_size_when_compiled():
    from model.kv_cache import cache_slots

    assert [cache_slots(64, n, False) for n in (1, 10, 64, 100)] == [1, 10, 64, 64]
    assert [cache_slots(64, n, True) for n in (1, 8, 9, 10, 100)] == [8, 8, 16, 16, 64]
    assert [cache_slots(4, n, True) for n in (1, 3)] == [1, 3]  # block_size < 8: steps of one slot


def test_chunked_decoding_equals_one_step_at_a_time(monkeypatch):
    """compile=True decodes DECODE_CHUNK tokens per call; run that path eagerly (as the compiled
    function would, minus the compiler) and it must give the one-step tokens, past block_size too."""
    import model.kv_cache

    chunks = []

    def eager_steps(gpt, idx, slots, *args):
        chunks.append(slots.size(0))
        return model.kv_cache.decode_steps(gpt, idx, slots, *args)

    monkeypatch.setattr(model.kv_cache, "compiled_decode_steps", lambda: eager_steps)
    tiny = tiny_model()
    rows = [TOK.encode("ROMEO:"), TOK.encode("A")]
    idx, pad = sample.left_pad(rows, "cpu")
    for temperature in (0, 1.0):
        runs = [torch.stack(list(generate(tiny, idx, 3 * BLOCK, temperature=temperature, padding_mask=pad,
                                          generator=torch.Generator().manual_seed(0), compile=c)), 1).tolist()
                for c in (False, True)]
        assert runs[0] == runs[1]
    assert set(chunks) == {model.kv_cache.DECODE_CHUNK}  # only whole chunks go through it; slides go one step at a time


def test_cli_end_to_end_subprocess(tmp_path):
    run = make_run(tmp_path)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("ROMEO:\n\nJULIET:\\n\n")
    cmd = [sys.executable, "sample.py", "--ckpt", str(run / "ckpt.pt"), "--prompt-file", str(prompts),
           "--max-new-tokens", "10", "--temperature", "0", "--num-samples", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=ENV)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("--- prompt") == 4 and "JULIET:\n" in r.stdout
    r = subprocess.run([sys.executable, "sample.py", "--ckpt", str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=120, env=ENV)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ") and "python train.py --config small" in r.stderr

def test_generation_ends_once_every_row_has_produced_eos_and_a_finished_row_repeats_it():
    model = tiny_model()
    prompts = torch.tensor([[1, 2, 3], [7, 5, 9]])
    free = torch.stack(list(generate(model, prompts, 24, temperature=0)))  # (24, 2), no eos
    eos, k = int(free[5, 0]), int((free[:, 0] == free[5, 0]).nonzero()[0])  # row 0's token at step 5, first seen at k
    alone = torch.stack(list(generate(model, prompts[:1], 24, temperature=0, eos_id=eos)))
    assert alone.tolist() == free[: k + 1, :1].tolist()  # ends at once, with the eos
    both = torch.stack(list(generate(model, prompts, 24, temperature=0, eos_id=eos)))
    assert (both[k:, 0] == eos).all() and both[: k + 1, 0].tolist() == free[: k + 1, 0].tolist()
    ends = (free[:, 1] == eos).nonzero()
    assert len(both) == (int(ends[0]) + 1 if len(ends) and int(ends[0]) >= k else 24)  # when row 1 is done too


def test_a_recompile_limit_falls_back_to_eager_steps_with_the_same_tokens(monkeypatch):
    """Past dynamo's recompile limit (a 9th shape in a process) the compiled call raises; decoding
    goes on one eager step at a time and draws the same tokens."""
    import model.kv_cache

    calls = []

    def over_the_limit():
        def step(*args):
            calls.append(1)
            raise torch._dynamo.exc.FailOnRecompileLimitHit("recompile limit")
        return step

    monkeypatch.setattr(model.kv_cache, "compiled_decode_steps", over_the_limit)
    m, x = tiny_model(), torch.tensor([[1, 2, 3], [4, 5, 6]])
    for temperature in (0, 0.8):
        kw = dict(temperature=temperature, generator=torch.Generator().manual_seed(3))
        eager = torch.stack(list(generate(m, x, 20, **kw)))
        kw["generator"] = torch.Generator().manual_seed(3)
        assert torch.equal(torch.stack(list(generate(m, x, 20, compile=True, **kw))), eager)
    assert len(calls) == 2  # once a generate(): then eager to its end
