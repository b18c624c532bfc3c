"""The command line of every script: both spellings of a flag, booleans, --help with defaults and
choices, and each bad input as one `error:` line with exit status 2."""

import pytest

import data.prepare as prep
import sample
import train
from model.__main__ import main as model_main

SCRIPTS = {"train": train.main, "sample": sample.main, "prepare": prep.main, "model": model_main}

BAD = [  # (script, argv, what the one error line must say)
    ("train", ["--max-iter", "3"], "unknown option '--max-iter'; did you mean --max-iters?"),
    ("train", ["--max_iter=3"], "did you mean --max-iters?"),
    ("train", ["--lerning-rate", "1"], "unknown option '--lerning-rate'; see --help"),
    ("train", ["--max-iters", "abc"], "--max-iters: expects an integer, got 'abc'"),
    ("train", ["--max-iters", "2.5"], "--max-iters: expects an integer, got '2.5'"),
    ("train", ["--lr", "fast"], "--lr: expects a number, got 'fast'"),
    ("train", ["--device", "gpu"], "--device: 'gpu' is not one of auto, cpu, cuda, mps; did you mean 'cuda'?"),
    ("train", ["--pos-emb=ROPE"], "did you mean 'rope'?"),
    ("train", ["--compile=maybe"], "--compile: expects true/false (or no value), got 'maybe'"),
    ("train", ["--compile", "maybe"], "unexpected argument 'maybe'"),  # not a boolean word: not the flag's value
    ("train", ["--no-compile=true"], "--no-compile takes no value"),
    ("train", ["--max-iters"], "--max-iters: expected one argument"),
    ("train", ["200"], "unexpected argument '200'"),
    ("train", ["--conf", "tiny"], "did you mean --config?"),
    ("train", ["--config"], "--config: expected one argument"),
    ("train", ["--config", "smal"], "unknown config 'smal'; did you mean 'small'?"),
    ("train", ["--config", "runs/missing.toml"], "config file runs/missing.toml not found"),
    ("train", ["--n-head", "3"], "must be divisible by n_head"),
    ("sample", ["--temprature", "1"], "did you mean --temperature?"),
    ("sample", ["--max_new_tokens", "x"], "--max-new-tokens: expects an integer, got 'x'"),
    ("sample", ["--dtype", "fp16"], "did you mean 'float16'?"),
    ("sample", ["--top-p"], "--top-p: expected one argument"),
    ("sample", ["--ckpt", "a", "--config", "small"], "--config: not allowed with argument --ckpt"),
    ("prepare", ["--tokenizer", "chr"], "--tokenizer: 'chr' is not one of char, gpt2; did you mean 'char'?"),
    ("prepare", ["--txt", "a.txt"], "did you mean --text?"),
    ("prepare", ["--val-fraction", "x"], "--val-fraction: expects a number, got 'x'"),
    ("prepare", ["shakespeare_char", "--force=maybe"], "--force: expects true/false"),
    ("prepare", ["shakespeare_char", "--force", "true", "extra"], "unexpected argument 'extra'"),
    ("prepare", ["a", "b"], "unexpected argument 'b'"),
    ("model", ["--seq-len", "x"], "--seq-len: expects an integer, got 'x'"),
    ("model", ["--confg", "tiny"], "did you mean --config?"),
]


@pytest.mark.parametrize("script, argv, needle", BAD, ids=[f"{s}:{' '.join(a)}" for s, a, _ in BAD])
def test_bad_input_is_one_error_line_and_exit_2(capsys, script, argv, needle):
    assert SCRIPTS[script](["--config", "tiny", *argv] if script == "train" else argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: ") and needle in err, err


@pytest.mark.parametrize("script, needles", [
    ("sample", ["--device {auto,cpu,cuda,mps}", "(default:0.8)", "(default:500)", "--ckptDIR|FILE,--out-dirDIR|FILE"]),
    ("prepare", ["--tokenizer {char,gpt2}", "(default:0.1)", "--no-force[BOOL]", "(default:'data/prepared')"]),
    ("model", ["--config NAME|FILE|RUN_DIR", "finetune_gpt2,gpt2,shakespeare_gpu,small,tiny", "(default:'small')"]),
])
def test_help_shows_defaults_and_choices(capsys, script, needles):
    assert SCRIPTS[script](["--help"]) == 0
    out = capsys.readouterr().out
    flat = "".join(out.split())  # argparse wraps long help lines
    assert all(n in out if " " in n else n in flat for n in needles)


def test_sample_takes_both_spellings():
    args = sample.parse_args(["--out_dir", "out/tiny", "--max_new_tokens=5", "--top-k", "3", "--top_p=0.9",
                              "--device=cpu"])
    assert (args.ckpt, args.max_new_tokens, args.top_k, args.top_p, args.device) == ("out/tiny", 5, 3, 0.9, "cpu")


def test_prepare_takes_both_spellings_and_boolean_forms(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(prep, "prepare", lambda name, **kw: calls.append((name, kw)))
    argv = ["shakespeare_char", "--val_fraction=0.05", "--out-root", str(tmp_path), "--force", "--quiet=true",
            "--num_proc", "2", "--tokenizer=char", "--no-streaming"]
    assert prep.main(argv) == 0
    name, kw = calls[0]
    assert name == "shakespeare_char" and (kw["val_fraction"], kw["num_proc"], kw["tokenizer"]) == (0.05, 2, "char")
    assert (kw["force"], kw["verbose"], kw["streaming"], kw["out_root"]) == (True, False, False, str(tmp_path))


@pytest.mark.parametrize("argv, force", [(["--force", "shakespeare_char"], True), (["--no-force", "shakespeare_char"],
                                          False), (["--force", "no", "shakespeare_char"], False),
                                         (["--no_force", "shakespeare_char"], False)])
def test_a_word_after_a_boolean_flag_is_its_value_only_if_it_is_one(monkeypatch, argv, force):
    calls = []
    monkeypatch.setattr(prep, "prepare", lambda name, **kw: calls.append((name, kw)))
    assert prep.main(argv) == 0
    assert calls[0][0] == "shakespeare_char" and calls[0][1]["force"] is force


def test_model_trace_takes_both_spellings(capsys):
    assert model_main(["--config=tiny", "--seq_len", "4", "--batch-size=2", "--blocks", "0"]) == 0
    assert "input idx (2, 4) token ids" in capsys.readouterr().out


# Every numeric option of the other scripts, with values it must refuse before any work starts
NUMERIC = [("sample", "--num-samples", ["0", "nan", "inf", "-1e-3"]), ("sample", "--max-new-tokens", ["-1", "nan"]),
           ("sample", "--temperature", ["nan", "inf", "-inf", "-1e-3"]), ("sample", "--top-k", ["0", "nan", "-1e-3"]),
           ("sample", "--top-p", ["nan", "inf", "0", "1.5", "-1e-3"]), ("sample", "--seed", ["-1", str(2**64)]),
           ("sample", "--batch-size", ["0", "nan"]), ("sample", "--threads", ["-1", "inf"]),
           ("prepare", "--val-fraction", ["nan", "inf", "0", "1", "1.5", "-1e-3"]), ("prepare", "--num-proc", ["0", "-1"])]
VALUES = [(script, option, value) for script, option, values in NUMERIC for value in values]


@pytest.mark.parametrize("script, option, value", VALUES, ids=[f"{s}:{o}={v}" for s, o, v in VALUES])
def test_numeric_options_of_every_script_refuse_bad_values_by_name(monkeypatch, tmp_path, capsys, script, option, value):
    monkeypatch.setattr(prep, "prepare", lambda *a, **kw: pytest.fail("prepared"))
    monkeypatch.setattr(train, "train", lambda cfg: pytest.fail("trained"))
    before = {"sample": ["--ckpt", str(tmp_path / "none")], "prepare": ["shakespeare_char"]}[script]
    assert SCRIPTS[script]([*before, option, value]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(f"error: {option}"), err
    assert "expected one argument" not in err, err  # the value reached the option's converter
