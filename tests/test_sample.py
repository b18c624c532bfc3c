"""sample.py: TextStream's text from tokens, unescape, and the command line on a tiny trained run.

The run is trained once by train.train, then its weights are made sharper (random, larger), so
that greedy text varies from token to token and equality with a reference loop proves something.
"""

import io
import sys
from dataclasses import asdict

import pytest
import torch
from conftest import ROOT, hf_tiny, script, tiny

import configs
import sample
import train
from configs import UserError
from data.tokenizer import CharTokenizer, GPT2Tokenizer
from model.checkpoint import load_checkpoint, model_from, save_checkpoint
from model.gpt import GPT, GPTConfig, generate

CHARS = "".join(sorted(set((ROOT / "data/corpora/tinyshakespeare/input.txt").read_text())))
TOK = CharTokenizer(CHARS)


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_root):
    """A tiny run trained by train.train, its best.pt given sharp random weights."""
    folder = tmp_path_factory.mktemp("sample")
    train.train(tiny(folder, data_root, threads=1))
    run = folder / "run"
    checkpoint = load_checkpoint(run)
    model = model_from(checkpoint)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.5)
    checkpoint["model"] = model.state_dict()
    save_checkpoint(checkpoint, run / "best.pt")  # a file of its own: ckpt.pt keeps the trained
    return run


def our_model(run) -> GPT:
    return model_from(load_checkpoint(run)).eval()


@torch.no_grad()
def greedy(model, ids: list[int], n: int, vocab: int) -> list[int]:
    """The likeliest token at each step, by a full forward pass over the context (no cache)."""
    ids = list(ids)
    for _ in range(n):
        logits, _ = model(torch.tensor([ids[-model.config.block_size :]]))
        ids.append(int(logits[0, -1, :vocab].argmax()))
    return ids


def greedy_text(run, prompt: str, n: int) -> str:
    """What --temperature 0 adds to the prompt in n tokens of the run's char model."""
    ids = TOK.encode(prompt) if prompt else [TOK.start_id]
    return TOK.decode(greedy(our_model(run), ids, n, len(CHARS))[len(ids) :])


def ends_line(text: str) -> str:
    return text if text.endswith("\n") else text + "\n"


def one_sample(out: str, prompt: str, n: int) -> str:
    """The n characters a char model's one sample added to its prompt, once out is checked to be
    the prompt, those and a line end."""
    text = out[len(prompt) : len(prompt) + n]
    assert out == ends_line(prompt + text) and len(text) == n
    return text


def several(out: str, prompt: str, n: int, count: int) -> list[str]:
    """The texts of count samples of one prompt, each checked to be under its header."""
    parts = out.split("--- prompt 1/1, sample ")
    headers, texts = zip(*(p.split(" ---\n", 1) for p in parts[1:]))
    assert parts[0] == "" and headers == tuple(f"{k}/{count}" for k in range(1, count + 1))
    return [one_sample(text, prompt, n) for text in texts]


def cut(text: str, stop: str) -> str:
    return text[: text.index(stop) + len(stop)] if stop in text else text


def sample_out(capsys, run, *argv) -> str:
    sample.main(["--out-dir", str(run), *map(str, argv)])
    return capsys.readouterr().out


# ------------------------------------------------------------------ TextStream


def test_text_stream_pieces_add_up_to_the_text_and_none_ends_it():
    text = "ROMEO:\nO, speak!"
    stream = sample.TextStream(TOK, [])
    pieces = [stream.push(i) for i in TOK.encode(text)]
    assert pieces == list(text) and stream.text == text and not stream.done
    assert stream.push(None) == "" and stream.done
    assert stream.push(TOK.encode("A")[0]) == "" and stream.text == text  # done: nothing more


def test_a_bpe_token_holding_half_a_character_waits_for_the_rest():
    bpe = GPT2Tokenizer()
    text = "naïve 日本 🤗!"
    ids = bpe.encode(text)
    assert [bpe.decode_bytes([i]) for i in ids[2:5]] == [b" \xe6", b"\x97", b"\xa5"]  # " 日"
    stream = sample.TextStream(bpe, [])
    pieces = [stream.push(i) for i in ids]
    assert pieces == ["na", "ïve", " ", "", "日", "", "本", " ", "", "🤗", "!"]
    assert stream.text == text and not stream.done
    # stopped after the first of "本"'s three bytes: the end shows what was left as one U+FFFD
    first_byte = next(i for i in range(256) if bpe.decode_bytes([i]) == "本".encode()[:1])
    stream = sample.TextStream(bpe, [])
    assert stream.push(first_byte) == "" and stream.push(None) == "\ufffd" and stream.done


def test_end_of_text_ends_the_stream():
    bpe = GPT2Tokenizer()
    stream = sample.TextStream(bpe, [])
    assert [stream.push(i) for i in bpe.encode(" Hello world")] == [" Hello", " world"]
    assert stream.push(bpe.eot_id) == "" and stream.done
    assert stream.push(bpe.encode(" more")[0]) == "" and stream.text == " Hello world"
    # a character model has no end-of-text token: every id is text
    stream = sample.TextStream(TOK, [])
    assert stream.push(0) == "\n" and not stream.done


def test_a_stop_string_ends_the_text_just_after_it():
    stream = sample.TextStream(TOK, ["o w"])
    pieces = [stream.push(i) for i in TOK.encode("hello world. more")]
    assert "".join(pieces) == "hello w" == stream.text and stream.done
    assert pieces[:8] == list("hello w") + [""]
    stream = sample.TextStream(TOK, ["abc"])  # the whole text is the stop: found from its start
    assert [stream.push(i) for i in TOK.encode("abcd")] == ["a", "b", "c", ""] and stream.done


def test_a_stop_string_that_spans_two_pushes_ends_the_text():
    bpe = GPT2Tokenizer()
    stream = sample.TextStream(bpe, ["lo wo"])
    pieces = [stream.push(i) for i in bpe.encode(" hello world again")]
    assert pieces == [" hello", " wo", ""] and stream.text == " hello wo" and stream.done
    stream = sample.TextStream(TOK, ["b\n"])  # its last character alone is new
    assert [stream.push(i) for i in TOK.encode("ab\nc")] == ["a", "b", "\n", ""]


@pytest.mark.parametrize("stops", [["ld", "wor"], ["wor", "ld"]])
def test_the_earliest_of_several_stops_wins(stops):
    bpe = GPT2Tokenizer()
    stream = sample.TextStream(bpe, stops)  # both inside the token " world"
    assert "".join(stream.push(i) for i in bpe.encode(" hello world again")) == " hello wor"
    stream = sample.TextStream(TOK, ["\n\n", "l"])
    assert "".join(stream.push(i) for i in TOK.encode("ab\n\ncl")) == "ab\n\n"


def test_unescape_reads_newline_tab_and_backslash_and_leaves_the_rest():
    assert sample.unescape(r"a\nb\tc\\n\q\r") == "a\nb\tc\\n\\q\\r"
    assert sample.unescape("plain") == "plain"


# ------------------------------------------------------------------ the command line


def test_one_sample_streams_the_prompt_then_a_piece_per_token(run, capsys, monkeypatch):
    writes = []
    monkeypatch.setattr(sys.stdout, "write", lambda s: writes.append(s) or len(s))
    sample_out(capsys, run, "--prompt", "ROMEO:", "--temperature", 0, "--max-new-tokens", 20)
    text = greedy_text(run, "ROMEO:", 20)
    assert len(set(text)) > 4  # varied text, or equality would prove little
    pieces = [w for w in writes if w]
    assert pieces == ["ROMEO:", *text, *(["\n"] * (not text.endswith("\n")))]


def test_several_samples_print_under_a_header_each(run, capsys):
    argv = ["--prompt", "ROMEO:", "--prompt", "JULIET:", "--num-samples", 2, "--temperature", 0]
    out = sample_out(capsys, run, *argv, "--max-new-tokens", 12)
    expected = "".join(
        f"--- prompt {j}/2, sample {k}/2 ---\n" + ends_line(p + greedy_text(run, p, 12))
        for j, p in enumerate(["ROMEO:", "JULIET:"], 1)
        for k in (1, 2)
    )
    assert out == expected


def test_one_prompts_samples_are_drawn_apart_and_each_has_its_header(run, capsys):
    out = sample_out(
        capsys, run, "--prompt", "A", "--num-samples", 3, "--seed", 1, "--max-new-tokens", 10
    )
    assert len(set(several(out, "A", 10, 3))) == 3


def test_the_same_seed_gives_the_same_text_and_another_seed_other_text(run, capsys):
    argv = ["--prompt", "ROMEO:", "--max-new-tokens", 30, "--seed"]
    first = sample_out(capsys, run, *argv, 7)
    one_sample(first, "ROMEO:", 30)
    assert sample_out(capsys, run, *argv, 7) == first
    assert sample_out(capsys, run, *argv, 8) != first


def test_help_says_the_seed_fixes_the_samples_with_the_same_num_samples(run, capsys):
    """Samples are drawn together, a row each: --num-samples is part of what the seed repeats."""
    with pytest.raises(SystemExit):
        sample.main(["--help"])
    assert "The same --seed and --num-samples give the same samples." in capsys.readouterr().out
    argv = ["--prompt", "A", "--num-samples", 2, "--max-new-tokens", 30, "--seed", 7]
    assert sample_out(capsys, run, *argv) == sample_out(capsys, run, *argv)


def test_a_device_or_dtype_it_cannot_use_is_one_line_and_auto_is_the_cpu_in_float32(run, capsys):
    for flag, bad in ("--device", "tpu"), ("--dtype", "int8"):
        with pytest.raises(UserError, match=f"^argument {flag}: invalid choice: '{bad}'"):
            sample.main(["--out-dir", str(run), flag, bad])
    for device in "cuda", "mps":
        if not (torch.cuda if device == "cuda" else torch.mps).is_available():
            with pytest.raises(UserError, match=f"^--device {device}, but torch cannot use one"):
                sample.main(["--out-dir", str(run), "--device", device])
    argv = ["--prompt", "A", "--max-new-tokens", 20, "--seed", 1]
    auto = sample_out(capsys, run, *argv, "--device", "auto", "--dtype", "auto")
    assert auto == sample_out(capsys, run, *argv, "--device", "cpu", "--dtype", "float32")
    for dtype in "bfloat16", "float16":  # taken; their text may differ
        one_sample(sample_out(capsys, run, *argv, "--dtype", dtype), "A", 20)


def test_init_from_a_path_that_is_not_there_is_one_line():
    with pytest.raises(UserError, match="^--init-from ./no/such/run: no such file or folder$"):
        sample.main(["--init-from", "./no/such/run"])


def test_help_names_the_script(capsys):
    with pytest.raises(SystemExit):
        sample.main(["--help"])
    assert capsys.readouterr().out.startswith("usage: sample.py [-h]")


def test_temperature_zero_takes_the_likeliest_token_every_time(run, capsys):
    argv = ["--prompt", "ROMEO:", "--max-new-tokens", 24, "--temperature", 0]
    expected = ends_line("ROMEO:" + greedy_text(run, "ROMEO:", 24))
    assert sample_out(capsys, run, *argv) == expected  # no --seed: drawn seeds change nothing
    assert sample_out(capsys, run, *argv) == expected


def test_decoding_past_the_context_keeps_one_character_a_token(run, capsys):
    out = sample_out(capsys, run, "--prompt", "ROMEO:", "--max-new-tokens", 100, "--seed", 0)
    one_sample(out, "ROMEO:", 100)  # 3 x block_size past it


def test_a_stop_string_ends_the_sample_and_the_decoding(run, capsys, monkeypatch):
    text = greedy_text(run, "ROMEO:", 24)
    stop = text[6:8]
    cut = text[: text.index(stop) + len(stop)]
    assert len(cut) < 24
    steps = []

    def counted(*args):
        for tokens in generate(*args):
            steps.append(tokens)
            yield tokens

    monkeypatch.setattr(sample, "generate", counted)
    argv = ["--prompt", "ROMEO:", "--temperature", 0, "--max-new-tokens", 24, "--stop", stop]
    assert sample_out(capsys, run, *argv) == ends_line("ROMEO:" + cut)
    assert len(steps) == len(cut)  # the decoding stopped with the text
    steps.clear()
    out = sample_out(capsys, run, *argv, "--num-samples", 2)
    header = "--- prompt 1/1, sample {}/2 ---\n"
    assert out == "".join(header.format(k) + ends_line("ROMEO:" + cut) for k in (1, 2))
    assert len(steps) == len(cut)


def test_a_stop_string_ends_each_sample_where_it_comes(run, capsys):
    argv = ["--prompt", "A", "--num-samples", 2, "--seed", 5, "--max-new-tokens", 40]
    first, second = several(sample_out(capsys, run, *argv), "A", 40, 2)
    stop = first[:3]
    assert len(cut(second, stop)) > 3  # the second sample goes on after the first stopped
    out = sample_out(capsys, run, *argv, "--stop", stop)
    header = "--- prompt 1/1, sample {}/2 ---\n"
    assert out == header.format(1) + ends_line("A" + stop) + header.format(2) + ends_line(
        "A" + cut(second, stop)
    )


def test_an_escaped_stop_string_is_read_as_its_character(run, capsys):
    argv = ["--prompt", "A", "--temperature", 2, "--seed", 1, "--max-new-tokens", 100]
    text = one_sample(sample_out(capsys, run, *argv), "A", 100)
    assert "\n" in text
    out = sample_out(capsys, run, *argv, "--stop", "\\n")
    assert out == "A" + text[: text.index("\n") + 1]  # ends its line: no blank line after


def test_prompt_dash_reads_stdin_as_it_is(run, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("To be,\n"))  # as it is, its newline kept
    out = sample_out(capsys, run, "--prompt", "-", "--temperature", 0, "--max-new-tokens", 8)
    assert out == ends_line("To be,\n" + greedy_text(run, "To be,\n", 8))


def test_an_escaped_prompt_is_read_as_its_characters(run, capsys):
    out = sample_out(capsys, run, "--prompt", "A\\nB", "--temperature", 0, "--max-new-tokens", 8)
    assert out == ends_line("A\nB" + greedy_text(run, "A\nB", 8))


def test_an_empty_prompt_starts_from_the_newline_of_a_char_model(run, capsys):
    assert TOK.start_id == TOK.encode("\n")[0]
    text = greedy_text(run, "", 12)
    assert text == TOK.decode(greedy(our_model(run), TOK.encode("\n"), 12, len(CHARS))[1:])
    assert sample_out(capsys, run, "--temperature", 0, "--max-new-tokens", 12) == ends_line(text)
    assert sample_out(capsys, run, "--prompt", "", "--temperature", 0, "--max-new-tokens", 12) == (
        ends_line(text)
    )


def test_a_sample_that_ends_a_line_gets_no_blank_line_after_it(run, capsys):
    argv = ["--prompt", "ROMEO:\\n", "--max-new-tokens", 0]
    assert sample_out(capsys, run, *argv) == "ROMEO:\n"
    assert sample_out(capsys, run, *argv, "--num-samples", 2) == (
        "--- prompt 1/1, sample 1/2 ---\nROMEO:\n--- prompt 1/1, sample 2/2 ---\nROMEO:\n"
    )
    assert sample_out(capsys, run, *argv, "--prompt", "KING") == (
        "--- prompt 1/2, sample 1/1 ---\nROMEO:\n--- prompt 2/2, sample 1/1 ---\nKING\n"
    )


def test_max_new_tokens_zero_prints_the_prompt_alone(run, capsys):
    assert sample_out(capsys, run, "--prompt", "ROMEO:", "--max-new-tokens", 0) == "ROMEO:\n"


@pytest.mark.parametrize(
    "flag, bad, edge",
    [
        ("--num-samples", -1, 1),
        ("--num-samples", 0, 1),
        ("--top-k", 0, 1),
        ("--max-new-tokens", -1, 0),
        ("--temperature", -0.5, 0),
        ("--top-p", 0, 1),
        ("--top-p", 1.5, 1),
    ],
)
def test_a_value_past_a_flags_bound_is_refused_and_the_bound_is_taken(run, capsys, flag, bad, edge):
    argv = ["--out-dir", str(run), "--prompt", "A", "--max-new-tokens", "2", "--seed", "0"]
    with pytest.raises(UserError, match=flag):
        sample.main([*argv, flag, str(bad)])
    sample.main([*argv, flag, str(edge)])
    assert capsys.readouterr().out.startswith("A")


def test_an_empty_stop_string_is_refused(run):
    with pytest.raises(UserError, match="--stop: some text"):
        sample.main(["--out-dir", str(run), "--stop", ""])


def test_a_prompt_with_characters_the_model_lacks_is_one_line(run, capsys):
    with pytest.raises(UserError) as e:
        sample.main(["--out-dir", str(run), "--prompt", "ROMEO: ü€"])
    assert str(e.value) == "prompt 'ROMEO: ü€': 'ü€': not in this model's 65 characters"
    with pytest.raises(UserError) as e:  # a long prompt is named by its first 40 characters
        sample.main(["--out-dir", str(run), "--prompt", "A" * 40 + "ü"])
    assert str(e.value) == f"prompt {'A' * 40!r}: 'ü': not in this model's 65 characters"
    assert capsys.readouterr().out == ""


def test_init_from_a_run_folder_samples_its_weights(run, capsys):
    argv = ["--prompt", "KING", "--temperature", "0", "--max-new-tokens", "16"]
    sample.main(["--init-from", str(run), *argv])
    assert capsys.readouterr().out == sample_out(capsys, run, *argv)


@pytest.mark.parametrize("prompt", ["Hello, I am", ""])
def test_init_from_an_hf_gpt2_folder_samples_with_gpt2s_tokenizer(
    tmp_path, capsys, network_calls, prompt
):
    hf = hf_tiny(vocab=50257)
    with torch.no_grad():  # sharper, so that greedy text varies
        for p in hf.parameters():
            p.mul_(10 if p.dim() == 2 else 1)
    hf.save_pretrained(tmp_path / "hf")
    bpe = GPT2Tokenizer()
    ids = torch.tensor([bpe.encode(prompt) or [50256]])  # an empty prompt: from end-of-text
    with torch.no_grad():
        new = hf.generate(ids, max_new_tokens=10, do_sample=False)[0, ids.size(1) :].tolist()
    new = new[: new.index(50256)] if 50256 in new else new
    assert len(set(new)) > 3  # varied ids, or equality would prove little
    argv = ["--prompt", prompt, "--temperature", 0, "--max-new-tokens", 10]
    sample.main(["--init-from", str(tmp_path / "hf"), *map(str, argv)])
    assert capsys.readouterr().out == ends_line(prompt + bpe.decode(new))
    assert network_calls == []


def test_a_model_whose_vocabulary_is_smaller_than_its_tokenizers_is_one_line(tmp_path, capsys):
    hf_tiny(vocab=100).save_pretrained(tmp_path / "hf")  # GPT-2's tokenizer has 50257 tokens
    with pytest.raises(UserError) as e:
        sample.main(["--init-from", str(tmp_path / "hf"), "--prompt", "Hello world"])
    assert str(e.value) == (
        "the model's vocabulary (100) is smaller than its tokenizer's (50257); "
        "train one with --vocab-size 50257 or more"
    )
    assert capsys.readouterr().out == ""


def test_a_padded_vocabulary_never_samples_a_padding_id(run, tmp_path, capsys):
    checkpoint = load_checkpoint(run)
    config = GPTConfig(**checkpoint["model_config"] | {"vocab_size": 80})
    model = GPT(config)
    state = checkpoint["model"]
    for name in ("transformer.wte.weight", "lm_head.weight"):  # 65 rows, then 15 of padding
        state[name] = torch.cat([state[name], torch.full((15, 16), 10.0)])
    state["transformer.ln_f.weight"] = torch.zeros(16)  # every position's last state: ones
    state["transformer.ln_f.bias"] = torch.ones(16)
    model.load_state_dict(state)
    assert next(generate(model.eval(), torch.tensor([[0]]), 1, 0)).item() >= 65  # uncut: padding
    padded = {**checkpoint, "model": model.state_dict(), "model_config": asdict(config)}
    save_checkpoint(padded, tmp_path / "padded.pt")
    argv = ["--prompt", "A", "--max-new-tokens", 200, "--temperature", 2, "--seed", 0]
    one_sample(sample_out(capsys, tmp_path / "padded.pt", *argv), "A", 200)  # ids >= 65: errors


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_device_cpu_and_a_dtype_decode_in_that_dtype(run, capsys, monkeypatch, dtype):
    seen = []

    def spy(model, *args):
        seen.append((model.lm_head.weight.dtype, model.lm_head.weight.device.type))
        return generate(model, *args)

    monkeypatch.setattr(sample, "generate", spy)
    argv = ["--prompt", "ROMEO:", "--temperature", 0, "--max-new-tokens", 10]
    out = sample_out(capsys, run, *argv, "--device", "cpu", "--dtype", dtype)
    assert seen == [(getattr(torch, dtype), "cpu")]
    if dtype == "float32":
        assert out == ends_line("ROMEO:" + greedy_text(run, "ROMEO:", 10))
        assert sample_out(capsys, run, *argv) == out  # auto on a CPU: float32
        assert seen[-1] == (torch.float32, "cpu")
    else:
        one_sample(out, "ROMEO:", 10)


def model_run(tmp_path, n_embd: int):
    """A random checkpoint of n_embd, in the run's characters."""
    config = GPTConfig(len(CHARS), 8, 1, 2, n_embd)
    manifest = {"tokenizer": "char", "vocab_size": len(CHARS), "chars": CHARS}
    path = tmp_path / f"embd{n_embd}.pt"
    save_checkpoint(
        {"model": GPT(config).state_dict(), "model_config": asdict(config), "manifest": manifest},
        path,
    )
    return path


def test_a_small_model_samples_on_one_thread_unless_omp_num_threads_is_set(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for n_embd, threads in (256, 1), (272, 2):
        torch.set_num_threads(2)
        sample_out(capsys, model_run(tmp_path, n_embd), "--prompt", "A", "--max-new-tokens", 1)
        assert torch.get_num_threads() == threads, n_embd
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)
    sample_out(capsys, model_run(tmp_path, 16), "--prompt", "A", "--max-new-tokens", 1)
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("bf16_cpu", [False, True])
def test_auto_decodes_a_large_model_in_bfloat16_where_the_cpu_has_it_a_small_one_in_float32(
    tmp_path, capsys, monkeypatch, bf16_cpu
):
    seen = []

    def spy(model, *args):
        seen.append(model.lm_head.weight.dtype)
        return generate(model, *args)

    monkeypatch.setattr(sample, "generate", spy)
    monkeypatch.setattr(configs, "cpu_has_bf16", lambda: bf16_cpu)
    for n_embd in 256, 272:
        sample_out(capsys, model_run(tmp_path, n_embd), "--prompt", "A", "--max-new-tokens", 1)
    large = torch.bfloat16 if bf16_cpu else torch.float32
    assert seen == [torch.float32, large]
    sample_out(capsys, model_run(tmp_path, 256), "--prompt", "A", "--dtype", "bfloat16")
    assert seen[-1] == torch.bfloat16  # asked for: taken, whatever the size


def test_sample_py_run_as_a_script_prints_the_prompt_and_exits_0(run):
    proc = script("sample.py", "--out-dir", run, "--prompt", "ROMEO:", "--max-new-tokens", 5)
    assert proc.returncode == 0, proc.stderr[-2000:]
    one_sample(proc.stdout, "ROMEO:", 5)
