"""sample.py: TextStream's text from tokens, unescape, and the command line on a tiny run.

The run's weights are random and large, so that greedy text varies from token to token and
equality with a reference loop proves something. Command lines are written as a shell has them.
"""

import ast
import io
import re
import shlex
import sys
from dataclasses import asdict, replace

import pytest
import torch
from conftest import in_process, rows
from test_config import refused  # the one line of a UserError

import configs
import sample
from data.tokenizer import CharTokenizer, GPT2Tokenizer
from model.checkpoint import load_checkpoint, model_from, save_checkpoint
from model.gpt import GPT, GPTConfig, generate

# tinyshakespeare's characters, in data.prepare's order (data_root's shakespeare_char has them)
CHARS = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
TOK, BPE = CharTokenizer(CHARS), GPT2Tokenizer()
CHAR = {"tokenizer": "char", "vocab_size": 65, "chars": CHARS}  # the run's manifest


def saved(path, manifest=CHAR, **shape):
    """A checkpoint of tiny's shape unless told, its weights large and random."""
    config = replace(GPTConfig(manifest["vocab_size"], 32, 2, 2, 16), **shape)
    torch.manual_seed(3)
    model = GPT(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * (0.5 if p.dim() > 1 else 0.05))
    save_checkpoint(
        {"model": model.state_dict(), "model_config": asdict(config), "manifest": manifest}, path
    )
    return path


@pytest.fixture(scope="module", name="run")
def char_run(tmp_path_factory):
    """A run folder: its best.pt (test_hf.py's too)."""
    return saved(tmp_path_factory.mktemp("run") / "best.pt").parent


def greedy(run, prompt, n):
    """What --temperature 0 adds to the prompt in n characters: generate()'s likeliest token at each
    step, which test_generate.py::test_generate_is_the_uncached_loop_while_the_context_fits_then_a_
    fresh_window holds to be a full forward pass's. An empty prompt starts from the newline."""
    idx = torch.tensor([TOK.encode(prompt or "\n")])
    tokens = generate(model_from(load_checkpoint(run)).eval(), idx, n, 0)
    return TOK.decode([int(t) for t in tokens])


def printed(prompts):
    """What sample.py prints of each prompt's samples (their whole texts): a header over each when
    there are several, and each ends its line."""
    several = len(prompts) * len(prompts[0]) > 1
    return "".join(
        several * f"--- prompt {j}/{len(prompts)}, sample {k}/{len(texts)} ---\n"
        + text
        + "\n" * (not text.endswith("\n"))
        for j, texts in enumerate(prompts, 1)
        for k, text in enumerate(texts, 1)
    )


def sample_py(argv, *more):
    """sample.py's output for the flags in argv (a shell's words) and more, run as its script."""
    return in_process(sample.main, *shlex.split(argv), *more).stdout


def sampled(run, argv, n=1):
    """The n characters each sample of prompt A added, once sample.py's output is checked to be
    them as it prints them (under a header each, for several)."""
    out = sample_py(f"--out-dir {run} --prompt A --max-new-tokens {n} {argv}")
    texts = [part[1 : n + 1] for part in out.split(" ---\n")["--num-samples" in argv :]]
    assert out == printed([["A" + t for t in texts]]) and {len(t) for t in texts} == {n}
    return texts


# stops => a text, or ids => the pieces that pushing its ids, then None, gives: GPT-2's BPE tokens'
# with "|" between them, else a character model's (a character each; it has no end-of-text: every
# id is text). A BPE token holding part of a character waits for the rest (an empty piece); at the
# end, what is left of one is a U+FFFD (2616...17312: "naïve 日本" cut inside 本). The stream is
# done before None where end-of-text (50256, between " Hello world" and " the") or a stop came. A
# stop string ends the text just after it, though it spans pushes or starts the text; the earliest
# of several stops wins.
STREAMS = r"""
[] => "naïve 日本 🤗!" => "na|ïve| ||日||本| ||🤗|!"
[] => [2616, 38776, 10545, 245, 98, 17312] => "na|ïve| ||日||\ufffd"
[] => [18435, 995, 50256, 262] => " Hello| world"
[] => "\n" => "\n"
["o w"] => "hello world. more" => "hello w"
["abc"] => "abcd" => "abc"
["lo wo"] => " hello world again" => " hello| wo"
["b\n"] => "ab\nc" => "ab\n"
["ld", "wor"] => " hello world again" => " hello| wor"
["wor", "ld"] => " hello world again" => " hello| wor"
["\n\n", "l"] => "ab\n\ncl" => "ab\n\n"
"""


@pytest.mark.parametrize("stops, ids, pieces", rows(STREAMS, " => "))
def test_a_text_streams_in_whole_characters_until_its_end_or_first_stop(stops, ids, pieces):
    stops, ids, pieces = map(ast.literal_eval, (stops, ids, pieces))
    tok, pieces = (BPE, pieces.split("|")) if "|" in pieces else (TOK, [*pieces])
    ids = tok.encode(ids) if isinstance(ids, str) else ids
    stream = sample.TextStream(tok, stops)
    got = [stream.push(i) for i in ids]
    assert stream.done == (stops != [] or BPE.eot_id in ids)
    got += map(stream.push, [None, 0])  # None ends it: nothing more
    assert got == pieces + [""] * (len(got) - len(pieces))
    assert stream.text == "".join(pieces) and stream.done


# flags (and --max-new-tokens N) => the prompts, as Python writes them. Top-k 1 draws the likeliest
# too; "--prompt -" reads stdin (To be,); no prompt starts from the newline of a char model; a
# prompt that ends its line gets no blank line after it.
GREEDY = r"""--init-from RUN --prompt KING --temperature 0 --device cpu => "KING"
--out-dir RUN --prompt ROMEO: --top-k 1 --top-p 1 --num-samples 1 --dtype float32 => "ROMEO:"
--out-dir RUN --prompt ROMEO: --prompt '' --num-samples 2 --temperature 0 => "ROMEO:", ""
--out-dir RUN --prompt - --prompt 'A\nB' --temperature 0 => "To be,\n", "A\nB"
--out-dir RUN --temperature 0 => ""
--out-dir RUN --prompt 'ROMEO:\n' --temperature 0 => "ROMEO:\n"
"""


@pytest.mark.parametrize("argv, prompts", rows(GREEDY, " => "))
@pytest.mark.parametrize("n", [0, 20])
def test_greedy_decoding_streams_each_prompt_and_its_likeliest_tokens(
    run, monkeypatch, argv, prompts, n
):
    prompts = ast.literal_eval(f"[{prompts}]")
    samples = 1 + ("--num-samples 2" in argv)
    expected = printed([[p + greedy(run, p, n)] * samples for p in prompts])
    argv = f"--max-new-tokens {n} {argv}".replace("RUN", str(run))
    writes = []
    monkeypatch.setattr(sys.stdout, "write", lambda s: writes.append(s) or len(s))
    for _ in range(2):  # no --seed: the seeds drawn change nothing
        writes.clear()
        monkeypatch.setattr(sys, "stdin", io.StringIO("To be,\n"))
        sample.main(shlex.split(argv))  # as it writes: not in_process's stdout
        assert "".join(writes) == expected
        if samples * len(prompts) == 1:  # one sample streams: the prompt, then a piece per token
            prompt = prompts[0]
            assert [w for w in writes if w] == [prompt] * bool(prompt) + [*expected[len(prompt) :]]
    assert len(set(expected)) > 4 or not n  # varied text, or equality would prove little


def test_what_help_says_holds_escapes_seeds_and_stop_strings(run, monkeypatch):
    assert re.match(
        "usage: sample.py \\[-h].*The same --seed and --num-samples give the same samples",
        in_process(sample.main, "--help").stdout,
        re.S,
    )
    assert sample.unescape(r"a\nb\tc\\n\q\r") == "a\nb\tc\\n\\q\\r"  # three escapes
    three = sampled(run, "--num-samples 3 --seed 1", 10)
    assert len(set(three)) == 3 == len(three)
    assert sampled(run, "--num-samples 3 --seed 1", 10) == three
    first = sampled(run, "--seed 7", 100)  # 3 x block_size past it: a character a token
    assert sampled(run, "--seed 7", 100) == first != sampled(run, "--seed 8", 100)
    # a stop string ends each sample just after it, and the decoding with the last
    text, steps = greedy(run, "A", 24), []
    cut = text[: text.index(text[6:8]) + 2]

    def counted(*args):
        steps.clear()
        for tokens in generate(*args):
            yield steps.append(tokens) or tokens

    monkeypatch.setattr(sample, "generate", counted)
    argv = f"--out-dir {run} --prompt A --temperature 0 --max-new-tokens 24 --stop"
    assert sample_py(argv, text[6:8]) == printed([["A" + cut]])
    assert len(steps) == len(cut) < 24  # the decoding stopped with the text
    # drawn, an escaped newline: each sample where its stop comes, the decoding with the last
    argv = "--num-samples 2 --temperature 2 --seed 6"
    cut = [text[: text.index("\n") + 1] for text in sampled(run, argv, 100)]
    assert len(cut[0]) != len(cut[1])
    out = sample_py(f"--out-dir {run} --prompt A --max-new-tokens 100 {argv} --stop '\\n'")
    assert out == printed([["A" + text for text in cut]]) and len(steps) == max(map(len, cut))


AT_LEAST = "--num-samples, --top-k: at least 1; --max-new-tokens, --temperature: at least 0"
ABOVE_0 = "--top-p: above 0, at most 1; --stop: some text"
# flags after --out-dir RUN | the start of their one line; cuda is hidden by conftest.py
REFUSED = f"""--device tpu | argument --device: invalid choice: 'tpu'
--dtype int8 | argument --dtype: invalid choice: 'int8'
--device cuda | --device cuda, but torch cannot use one
--device mps | --device mps, but torch cannot use one
--num-samples 0 | {AT_LEAST}
--top-k 0 | {AT_LEAST}
--max-new-tokens -1 | {AT_LEAST}
--temperature -0.5 | {AT_LEAST}
--top-p 0 | {ABOVE_0}
--top-p 1.5 | {ABOVE_0}
--stop '' | {ABOVE_0}
--prompt {"A" * 40}ü | prompt {"A" * 40!r}: 'ü': not in this model's 65 characters
--init-from ./no/such/run | --init-from ./no/such/run: no such file or folder"""


@pytest.mark.parametrize("argv, message", rows(REFUSED))
def test_a_value_it_cannot_use_is_one_line(run, capsys, monkeypatch, argv, message):
    monkeypatch.setattr(torch.mps, "is_available", lambda: False)
    argv = f"--out-dir {run} " * ("--init-from" not in argv) + argv
    assert refused(argv, lambda argv: sample.main(shlex.split(argv))).startswith(message)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("bf16_cpu", [False, True])
def test_the_dtype_threads_and_vocabulary_follow_the_flags_and_the_model(
    run, tmp_path, monkeypatch, bf16_cpu
):
    seen = []  # the weights, and the vocabulary past which nothing is drawn
    monkeypatch.setattr(
        sample,
        "generate",
        lambda model, *args: (
            seen.append((model.lm_head.weight, args[-1])) or generate(model, *args)
        ),
    )
    monkeypatch.setattr(configs, "cpu_has_bf16", lambda: bf16_cpu)
    padded = saved(tmp_path / "256.pt", n_embd=256, vocab_size=80)  # 65 ids, 80 rows
    for path, argv, dtype, threads in [
        (padded, "--device auto --dtype auto", "float32", 1),  # small: float32, one thread
        (saved(tmp_path / "272.pt", n_embd=272), "", "bfloat16" if bf16_cpu else "float32", 2),
        (padded, "--dtype bfloat16", "bfloat16", 1),  # asked for: taken
        (run, "--device cpu --dtype float16", "float16", 1),
    ]:
        torch.set_num_threads(2)
        sampled(path, argv + " --seed 1", 8)  # their text may differ
        weight, vocab = seen[-1]
        assert (weight.dtype, weight.device.type, vocab) == (getattr(torch, dtype), "cpu", 65)
        assert torch.get_num_threads() == threads
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # set: kept
    torch.set_num_threads(2)
    sampled(run, "")
    assert torch.get_num_threads() == 2
