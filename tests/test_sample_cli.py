"""sample.py's command line, run in-process as a user would: prompts, limits, headers, errors."""

import copy
import dataclasses
import os
import sys
from pathlib import Path

import pytest
import torch
from test_sample import BLOCK, CHARS, TOK, make_run, tiny_model

import sample
from data.files import write_json
from data.tokenizer import CharTokenizer, get_tokenizer
from model import GPT, GPTConfig, generate


def test_cli_streams_text_token_by_token(tmp_path, monkeypatch, capsys):
    run = make_run(tmp_path)
    writes = []
    monkeypatch.setattr(sys.stdout, "write", lambda s: writes.append(s) or len(s))
    argv = ["--ckpt", str(run), "--prompt", "ROMEO:", "--max-new-tokens", "30", "--seed", "3", "--device", "cpu"]
    assert sample.main(argv) == 0
    assert writes[0] == "ROMEO:" and len(writes) >= 31  # the prompt, then one piece per token
    first = "".join(writes)
    writes.clear()
    assert sample.main(argv) == 0 and "".join(writes) == first  # --seed reproduces


def _corrupt(run):
    (run / "ckpt.pt").write_bytes(b"not a zip file at all")


def _wrong_manifest(run):
    write_json(run / "manifest.json", {"tokenizer": "char", "vocab_size": 3, "chars": "abc"})


def _wrong_shapes(run):
    state = torch.load(run / "ckpt.pt", weights_only=True)
    state["model_config"]["n_embd"] = 32
    torch.save(state, run / "ckpt.pt")


@pytest.mark.parametrize("setup, extra, needle", [
    (None, ["--prompt", "ROMEO: ü€"], "'ü€'"),
    (_corrupt, [], "corrupt"),
    (_wrong_manifest, [], "does not fit the char tokenizer (3 tokens)"),
    (_wrong_shapes, [], "do not match"),
    (lambda run: (run / "manifest.json").unlink(), [], "manifest.json"),
    (lambda run: (run / "manifest.json").write_text('{"tokenizer": "ch'), [], "Unterminated string"),
    (lambda run: (run / "manifest.json").write_text("[1, 2]"), [], "a JSON list"),
    (lambda run: (run / "manifest.json").write_bytes(bytes(range(256))), [], "can't decode"),
    (None, ["--top-p", "1.5"], "--top-p"),
], ids=["unknown-chars", "corrupt", "vocab-mismatch", "shapes", "no-manifest", "truncated-manifest", "list-manifest",
        "binary-manifest", "bad-flag"])
def test_cli_errors_are_one_line_exit_2(tmp_path, capsys, setup, extra, needle):
    run = make_run(tmp_path)
    if setup:
        setup(run)
    assert sample.main(["--ckpt", str(run), "--max-new-tokens", "3", *extra]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: ") and needle in err


def test_a_sample_that_ends_a_line_gets_no_blank_line_after_it(tmp_path, capsys):
    run = make_run(tmp_path)
    base = ["--ckpt", str(run), "--max-new-tokens", "0", "--device", "cpu"]
    assert sample.main([*base, "--prompt", "ROMEO:\\n"]) == 0  # the prompt's \n is read as a newline
    assert capsys.readouterr().out == "ROMEO:\n"
    assert sample.main([*base, "--prompt", "KING:", "--num-samples", "2"]) == 0
    assert capsys.readouterr().out == "--- sample 1/2 ---\nKING:\n--- sample 2/2 ---\nKING:\n"
    (tmp_path / "p.txt").write_text("A\\n\nB\\n\n")
    assert sample.main([*base, "--prompt-file", str(tmp_path / "p.txt")]) == 0
    assert capsys.readouterr().out == "--- prompt 1/2, sample 1/1 ---\nA\n--- prompt 2/2, sample 1/1 ---\nB\n"


def test_cli_empty_prompt_notes_its_start(tmp_path, capsys):
    run = make_run(tmp_path)
    assert sample.main(["--ckpt", str(run), "--prompt", "", "--max-new-tokens", "5", "--seed", "0"]) == 0
    out, err = capsys.readouterr()
    assert "note: empty prompt: starting from a newline" in err and len(out.rstrip("\n")) >= 1


def test_cli_bpe_model_from_hf_dir(tmp_path, capsys):
    from model.hf import save_hf_gpt2

    torch.manual_seed(0)
    save_hf_gpt2(GPT(GPTConfig(vocab_size=50257, block_size=16, n_layer=1, n_head=1, n_embd=8)), tmp_path / "hf")
    argv = ["--init-from", str(tmp_path / "hf"), "--max-new-tokens", "20", "--seed", "0", "--stop", "\\n"]
    assert sample.main([*argv, "--prompt", "Hello"]) == 0
    assert sample.main([*argv, "--prompt", ""]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("Hello") and "end-of-text" in err


def test_hf_model_with_a_smaller_vocabulary_than_gpt2_is_refused(tmp_path, capsys):
    from model.hf import save_hf_gpt2

    save_hf_gpt2(GPT(GPTConfig(vocab_size=100, block_size=16, n_layer=1, n_head=1, n_embd=8)), tmp_path / "hf")
    assert sample.main(["--init-from", str(tmp_path / "hf"), "--prompt", "Hello world"]) == 2  # was an IndexError
    assert "the model's vocabulary (100 tokens) does not fit the gpt2 tokenizer" in capsys.readouterr().err


def test_padded_model_vocab_never_samples_the_padding_ids(tmp_path, capsys):
    run = make_run(tmp_path, vocab=128)  # 65 chars padded to a multiple of 64
    argv = ["--ckpt", str(run), "--prompt", "A", "--max-new-tokens", "200", "--temperature", "2", "--seed", "0",
            "--device", "cpu"]
    assert sample.main(argv) == 0  # an id >= 65 would fail to decode
    assert len(capsys.readouterr().out) == 1 + 200 + 1


def test_cpu_threads():
    assert [sample.cpu_threads(0, n) for n in (64, 256, 257, 768)] == [1, 1, 0, 0]  # small models: one thread
    assert sample.cpu_threads(3, 64) == 3  # asked for: as asked


@pytest.mark.parametrize("model_vocab, declared, ok", [(65, None, True), (64, None, False), (128, None, True),
                                                       (129, None, False), (192, None, False), (192, 192, True),
                                                       (66, None, False)])
def test_a_model_vocab_fits_the_tokenizer_when_equal_padded_or_declared(model_vocab, declared, ok):
    model = tiny_model(vocab=model_vocab)
    if not ok:
        with pytest.raises(sample.UserError, match="does not fit the char tokenizer"):
            sample.check_vocab(model, TOK, "run", declared)
        return
    sample.check_vocab(model, TOK, "run", declared)
    with pytest.raises(sample.UserError):  # 64 padding ids: a multiple of 64 only pads by fewer
        sample.check_vocab(tiny_model(vocab=128), CharTokenizer(list(CHARS[:64])), "run")


def test_a_padded_vocabulary_is_cut_from_the_logits():
    """Decoding cuts the logits to the tokenizer's vocabulary (sample.py passes it down): greedy tokens are
    those of the -inf mask on the padding ids that sample.py once hooked onto lm_head, and seeded samples
    are those of the same network without the padding rows, on the reference loop and the cached path."""
    padded, V = tiny_model(vocab=128), len(CHARS)
    with torch.no_grad():  # padding rows that win every argmax unless they are cut
        padded.lm_head.weight[V:] = 10 * padded.lm_head.weight[: 128 - V]
    cut = GPT(dataclasses.replace(padded.config, vocab_size=V)).double().eval()
    cut.load_state_dict({k: v[:V] if k in ("transformer.wte.weight", "lm_head.weight") else v
                         for k, v in padded.state_dict().items()})
    masked = copy.deepcopy(padded)
    masked.lm_head.register_forward_hook(lambda m, i, out: out.index_fill(-1, torch.arange(V, 128), float("-inf")))
    rows = [TOK.encode("ROMEO:"), TOK.encode("A")]
    idx, pad = sample.left_pad(rows, "cpu")

    def run(model, use_cache, vocab_size=None, **kw):
        gen = torch.Generator().manual_seed(0)
        steps = generate(model, idx, 3 * BLOCK, padding_mask=pad, generator=gen, vocab_size=vocab_size,
                         use_cache=use_cache, **kw)
        return torch.stack(list(steps), 1).tolist()

    assert max(max(r) for r in run(padded, True, temperature=0)) >= V  # uncut, the padding ids win
    for use_cache in (True, False):
        assert run(padded, use_cache, V, temperature=0) == run(masked, use_cache, temperature=0)
        seeded = dict(temperature=1.0, top_k=20, top_p=0.95)
        assert run(padded, use_cache, V, **seeded) == run(cut, use_cache, **seeded)
    seeded = dict(temperature=1.0, top_k=20, generator=torch.Generator().manual_seed(1))
    texts = sample.generate_texts(padded, TOK, rows, 3 * BLOCK, **seeded)
    seeded["generator"].manual_seed(1)
    assert texts == sample.generate_texts(cut, TOK, rows, 3 * BLOCK, **seeded)


def test_a_prompt_of_exactly_block_size_tokens_is_seen_whole(capsys):
    assert sample.encode_prompt(TOK, "A" * BLOCK, BLOCK) == TOK.encode("A" * BLOCK)
    assert capsys.readouterr().err == ""
    sample.encode_prompt(TOK, "A" * (BLOCK + 1), BLOCK)
    assert f"only the last {BLOCK}" in capsys.readouterr().err
    assert sample.encode_prompt(TOK, "", BLOCK) == [TOK.encode("\n")[0]]
    assert "empty prompt: starting from a newline" in capsys.readouterr().err
    assert sample.encode_prompt(get_tokenizer("gpt2"), "", BLOCK) == [50256]
    assert "empty prompt: starting from the end-of-text token" in capsys.readouterr().err


@pytest.mark.parametrize("flag, bad, edge", [
    ("--num-samples", "0", "1"), ("--max-new-tokens", "-1", "0"), ("--temperature", "-0.1", "0"),
    ("--top-k", "0", "1"), ("--top-p", "0", "1"), ("--batch-size", "0", "1"), ("--threads", "-1", "0")])
def test_cli_refuses_a_value_past_each_limit_and_takes_the_limit(tmp_path, capsys, flag, bad, edge):
    run = make_run(tmp_path)
    argv = ["--ckpt", str(run), "--prompt", "A", "--max-new-tokens", "2", "--seed", "0"]
    assert sample.main([*argv, flag, bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag}: expects ") and err.endswith(f", got '{bad}'\n") and err.count("\n") == 1
    assert sample.main([*argv, flag, edge]) == 0
    assert capsys.readouterr().out.startswith("A")


def test_prompts_from_stdin_a_file_or_none(tmp_path, monkeypatch):
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("To be\\n\n"))
    assert sample.read_prompts(sample.parse_args(["--prompt", "-"])) == ["To be\\n"]  # verbatim, minus echo's newline
    monkeypatch.setattr(sys, "stdin", io.StringIO("no newline"))
    assert sample.read_prompts(sample.parse_args(["--prompt", "-", "--prompt", "a\\tb"])) == ["no newline", "a\tb"]
    (tmp_path / "p.txt").write_text("ROMEO:\\nO\n\n  \nJULIET: é\n", encoding="utf-8")
    got = sample.read_prompts(sample.parse_args(["--prompt", "x", "--prompt-file", str(tmp_path / "p.txt")]))
    assert got == ["x", "ROMEO:\nO", "JULIET: é"]  # blank lines skipped, escapes read
    assert sample.read_prompts(sample.parse_args([])) == [""]
    (tmp_path / "blank.txt").write_text("\n \n")
    with pytest.raises(sample.UserError, match="has no prompts"):
        sample.read_prompts(sample.parse_args(["--prompt-file", str(tmp_path / "blank.txt")]))


def test_cli_finds_a_configs_run_and_its_declared_vocab(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert sample.main(["--config", "tiny", "--prompt", "A"]) == 2
    assert capsys.readouterr().err == ("error: no checkpoint at out/tiny/ckpt.pt; train one first: "
                                       "`python train.py --config tiny`\n")
    run = make_run(tmp_path / "out", vocab=192)  # padded far past the 65 chars: only if training asked for it
    argv = ["--ckpt", str(run), "--prompt", "A", "--max-new-tokens", "4", "--seed", "0"]
    assert sample.main(argv) == 2
    assert capsys.readouterr().err.startswith(f"error: {run / 'ckpt.pt'}: the model's vocabulary (192 tokens) does not")
    state = torch.load(run / "ckpt.pt")
    state["train_config"] = {"vocab_size": 192}
    torch.save(state, run / "ckpt.pt")
    assert sample.main(argv) == 0 and len(capsys.readouterr().out) == 1 + 4 + 1
    (tmp_path / "out" / "run").rename(tmp_path / "out" / "tiny")
    assert sample.main(["--config", "tiny", "--prompt", "A", "--max-new-tokens", "4", "--seed", "0"]) == 0
    assert capsys.readouterr().out.startswith("A")


def test_cli_sets_cpu_threads(tmp_path, capsys, monkeypatch):
    run = make_run(tmp_path)
    argv = ["--ckpt", str(run), "--prompt", "A", "--max-new-tokens", "2", "--device", "cpu"]
    torch.set_num_threads(2)
    # 3 threads must fit the cores it may use
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert sample.main(argv) == 0 and torch.get_num_threads() == 1  # n_embd 16: one thread
    assert sample.main([*argv, "--threads", "3"]) == 0 and torch.get_num_threads() == 3


def test_cli_prints_each_sample_of_each_prompt_under_its_header(tmp_path, capsys):
    run = make_run(tmp_path)
    model, n = sample.load(sample.parse_args(["--ckpt", str(run)]))[0], 6
    alone = {p: sample.generate_texts(model, TOK, [TOK.encode(p)], n, temperature=0)[0] for p in ("ROMEO:", "Ay")}
    argv = ["--ckpt", str(run), "--max-new-tokens", str(n), "--seed", "0", "--batch-size", "3", "--device", "cpu"]
    for narrow in (["--top-k", "1"], ["--top-p", "0.001"]):  # only the likeliest token: greedy, whatever the draw
        assert sample.main([*argv, *narrow, "--prompt", "ROMEO:", "--prompt", "Ay", "--num-samples", "2"]) == 0
        assert capsys.readouterr().out == "".join(
            f"--- prompt {j + 1}/2, sample {k + 1}/2 ---\n{p}{alone[p]}\n" for j, p in enumerate(alone) for k in range(2))
    assert sample.main([*argv, "--top-k", "1", "--prompt", "Ay", "--stop", "\\n"]) == 0  # ends in its newline
    assert capsys.readouterr().out == "Ay" + (alone["Ay"][: alone["Ay"].index("\n") + 1] if "\n" in alone["Ay"]
                                              else alone["Ay"] + "\n")
    stop = alone["Ay"][2]
    assert sample.main([*argv, "--top-k", "1", "--prompt", "Ay", "--num-samples", "2", "--stop", stop]) == 0
    cut = alone["Ay"][: alone["Ay"].index(stop) + 1]
    assert capsys.readouterr().out == f"--- sample 1/2 ---\nAy{cut}\n--- sample 2/2 ---\nAy{cut}\n"


def test_help_names_the_script_and_shows_the_usage_examples(capsys):
    with pytest.raises(SystemExit) as exit:
        sample.parse_args(["--help"])
    out = capsys.readouterr().out
    assert exit.value.code == 0 and out.startswith("usage: sample.py ") and 'python sample.py --prompt "ROMEO:"' in out
    assert all(f in out for f in ("--ckpt DIR|FILE, --out-dir DIR|FILE", "--init-from NAME|DIR", "--stop TEXT"))
    assert vars(sample.parse_args([])) == {
        "ckpt": None, "config": None, "init_from": None, "prompt": None, "prompt_file": None, "num_samples": 1,
        "max_new_tokens": 500, "temperature": 0.8, "top_k": None, "top_p": None, "seed": None, "stop": [],
        "batch_size": 32, "device": "auto", "dtype": "auto", "threads": 0, "compile": False}
    assert sample.parse_args(["--out-dir", "x", "--compile"]).ckpt == "x" and sample.parse_args(["--compile"]).compile
    assert sample.main(["--stop", ""]) == 2 and capsys.readouterr().err == "error: --stop must not be empty\n"


@pytest.mark.parametrize("argv, says", [
    (["--config", "tiny", "--out-dir", "x"], "--out-dir: not allowed with argument --config"),
    (["--out-dir", "x", "--config", "tiny"], "--config: not allowed with argument --out-dir"),
    (["--init-from", "gpt2", "--ckpt", "x"], "--ckpt: not allowed with argument --init-from"),
])
def test_exclusive_sources_name_the_flag_typed(argv, says, capsys):
    assert sample.main(argv) == 2
    assert capsys.readouterr().err == f"error: {says}\n"


def test_config_with_only_best_pt_samples_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (make_run(tmp_path / "out") / "ckpt.pt").rename(tmp_path / "out/run/best.pt")
    (tmp_path / "out/run").rename(tmp_path / "out/tiny")
    assert sample.main(["--config", "tiny", "--prompt", "A", "--max-new-tokens", "3", "--seed", "0"]) == 0
    assert capsys.readouterr().out.startswith("A")


def test_more_threads_than_the_machine_has_cores_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)  # 2 cores, whatever this has
    argv = ["--ckpt", str(make_run(tmp_path)), "--prompt", "A", "--max-new-tokens", "2", "--device", "cpu"]
    for threads in ("3", "1073741824"):  # the latter was a torch allocation traceback
        assert sample.main([*argv, "--threads", threads]) == 2
        assert capsys.readouterr().err == (f"error: --threads {threads}: this process may use 2 cores; use at most 2 "
                                           "(0 = torch's default)\n")
    assert sample.main([*argv, "--threads", "2"]) == 0 and capsys.readouterr().out.startswith("A")


def test_a_plain_file_or_an_empty_ckpt_is_not_taken_for_a_run_directory(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    for ckpt, says in [(tmp_path / "notes.txt", f"{tmp_path / 'notes.txt'} is a file, not a checkpoint (.pt) or run "
                                                "directory; give a run directory or a .pt file"),
                       ("", "an empty run path names nothing; give a run directory or a .pt file")]:
        assert sample.main(["--ckpt", str(ckpt), "--prompt", "A"]) == 2
        assert capsys.readouterr().err == f"error: {says}\n"


def test_a_huge_num_samples_streams_without_building_its_rows_first(capsys):
    import resource
    import tracemalloc

    chunks = []

    def decode(rows, **_):  # two batches, then Ctrl-C
        chunks.append(rows)
        if len(chunks) == 2:
            raise KeyboardInterrupt
        return ["x"] * len(rows)

    args = sample.parse_args(["--num-samples", str(10**9), "--batch-size", "3"])
    # Building the billion rows up front must fail fast (MemoryError), not take the machine's memory.
    used = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
    limits = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (used + 2**30, limits[1]))
    tracemalloc.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            sample.write_samples(args, ["A"], decode)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        resource.setrlimit(resource.RLIMIT_AS, limits)
    assert chunks == [[0] * 3] * 2 and peak < 2**20
    assert capsys.readouterr().out == "".join(f"--- sample {k}/1000000000 ---\nAx\n" for k in (1, 2, 3))


def test_config_given_a_run_dir_or_its_config_json_samples_that_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run = make_run(tmp_path / "x")  # config.json says tiny: its default run dir, out/tiny, does not exist
    write_json(run / "config.json", sample.load_config("tiny").to_dict())
    for config in (run, run / "config.json"):  # was: no checkpoint at out/tiny/ckpt.pt
        assert sample.main(["--config", str(config), "--prompt", "A", "--max-new-tokens", "3", "--seed", "0"]) == 0
        assert capsys.readouterr().out.startswith("A")


def test_ctrl_c_while_streaming_ends_the_text_and_prints_the_shared_line(tmp_path, monkeypatch, capsys):
    from configs.errors import INTERRUPTED

    def decode(*_, on_text, **__):
        on_text(0, "xy")
        raise KeyboardInterrupt

    monkeypatch.setattr(sample, "generate_texts", decode)
    assert sample.main(["--ckpt", str(make_run(tmp_path)), "--prompt", "A"]) == 130
    assert capsys.readouterr() == ("Axy", INTERRUPTED + "\n")  # was: err "\n" only
