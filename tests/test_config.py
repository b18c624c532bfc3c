"""TrainConfig and train.py's command line: presets, flags, config files, config.json, bounds.

Every mistake a user can make in the settings is a UserError of one line, which names the flag
where it can; configs.run prints it as `error: ...` (tests/test_failures.py runs the scripts).
"""

import json
import math
import re
from dataclasses import fields, replace
from pathlib import Path
from typing import Annotated, Literal, get_args, get_origin

import pytest

from configs import PRESETS, TrainConfig, UserError, load_config, parse_args, settings


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def kind_of(f) -> type:
    """A field's type without its help text: int, float, str, bool or a Literal."""
    return get_args(f.type)[0] if get_origin(f.type) is Annotated else f.type


FIELDS = {f.name: kind_of(f) for f in fields(TrainConfig)}
BOOLS = [n for n, k in FIELDS.items() if k is bool]
CHOICES = {n: get_args(k) for n, k in FIELDS.items() if get_origin(k) is Literal}

# A value on the command line for every int, float and str field, each other than tiny's and
# valid on its own.
VALUES = {
    "vocab_size": "100",
    "block_size": "48",
    "n_layer": "3",
    "n_head": "4",
    "n_embd": "32",
    "dropout": "0.25",
    "name": "mine",
    "dataset": "other",
    "data_root": "elsewhere",
    "batch_size": "7",
    "tokens_per_step": "896",
    "lr": "0.003",
    "muon_lr": "0.05",
    "min_lr": "0.0005",
    "warmup_iters": "5",
    "decay_frac": "0.5",
    "weight_decay": "0.05",
    "beta1": "0.8",
    "beta2": "0.95",
    "grad_clip": "0.5",
    "max_iters": "30",
    "max_time": "12.5",
    "eval_interval": "5",
    "eval_iters": "3",
    "eval_batch_size": "8",
    "log_interval": "2",
    "sample_tokens": "64",
    "threads": "3",
    "seed": "42",
    "ddp_timeout": "60",
    "out_dir": "runs/x",
    "init_from": "gpt2",
    "hellaswag": "hs.jsonl",
    "hellaswag_interval": "20",
}


@pytest.fixture(autouse=True)
def elsewhere(tmp_path, monkeypatch):
    """Relative run folders (out/tiny/config.json, read by --resume) resolve in an empty folder,
    not in the repository, where a user's runs may be."""
    monkeypatch.chdir(tmp_path)


def refused(argv) -> str:
    """parse_args's refusal of argv: its one-line message."""
    with pytest.raises(UserError) as e:
        parse_args(argv)
    message = str(e.value)
    assert message and "\n" not in message, message
    return message


def test_every_preset_loads_and_names_its_run_folder():
    toml = sorted(p.stem for p in (Path(__file__).parent.parent / "configs").glob("*.toml"))
    assert PRESETS == toml == ["finetune_gpt2", "gpt2", "shakespeare_gpu", "small", "tiny"]
    for name in PRESETS:
        cfg = load_config(name)
        assert isinstance(cfg, TrainConfig)
        assert (cfg.name, cfg.out_dir, cfg.run_dir) == (name, "", Path("out", name))
    small = load_config("small")
    assert (small.n_layer, small.n_embd, small.max_iters, small.optimizer) == (4, 128, 1050, "muon")
    assert load_config("gpt2").vocab_size == 50304 and load_config("gpt2").compile is True


def test_no_config_is_small_and_no_flag_changes_nothing():
    assert parse_args([]) == load_config("small")
    assert parse_args(["--config", "tiny"]) == load_config("tiny")
    assert parse_args(["--config=tiny"]) == load_config("tiny")


@pytest.mark.parametrize("name", VALUES)
def test_every_number_and_text_field_is_a_flag_of_its_type(name):
    cfg = parse_args(["--config", "tiny", flag(name), VALUES[name]])
    kind = FIELDS[name]
    assert cfg == replace(load_config("tiny"), **{name: kind(VALUES[name])})
    assert type(getattr(cfg, name)) is kind


def test_the_table_of_values_covers_every_field():
    typed = {n for n, k in FIELDS.items() if k in (int, float, str)}
    assert set(VALUES) == typed
    assert typed | set(BOOLS) | set(CHOICES) == set(FIELDS)


@pytest.mark.parametrize("name", BOOLS)
def test_every_boolean_is_a_flag_and_its_no_form(name):
    tiny = load_config("tiny")
    assert parse_args(["--config", "tiny", flag(name)]) == replace(tiny, **{name: True})
    assert parse_args(["--config", "tiny", f"--no-{flag(name)[2:]}"]) == replace(
        tiny, **{name: False}
    )
    # a word after a boolean flag is not its value: `--compile false` would have meant the reverse
    assert refused(["--config", "tiny", flag(name), "false"]) == "unrecognized arguments: false"


@pytest.mark.parametrize("name", CHOICES)
def test_every_choice_is_a_flag_and_a_bad_one_lists_them(name):
    for choice in CHOICES[name]:
        assert getattr(parse_args(["--config", "tiny", flag(name), choice]), name) == choice
    message = refused(["--config", "tiny", flag(name), "nope"])
    assert message.startswith(f"argument {flag(name)}: invalid choice: 'nope'")
    assert all(f"'{choice}'" in message for choice in CHOICES[name])


def test_flags_win_over_the_preset_and_the_rest_is_the_presets():
    argv = ["--config", "small", "--max-iters", "5", "--pos-emb", "learned", "--compile"]
    cfg = parse_args(argv + ["--lr", "0.01", "--no-bias", "--out-dir", "runs/a"])
    small = load_config("small")
    expected = dict(max_iters=5, pos_emb="learned", compile=True, lr=0.01, bias=False)
    assert cfg == replace(small, **expected, out_dir="runs/a")
    assert cfg.n_embd == 128 and cfg.run_dir == Path("runs/a")


@pytest.mark.parametrize("preset", ["small", "tiny"])
def test_help_lists_every_field_with_the_chosen_configs_values(preset, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as e:
        parse_args(["--config", preset, "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps long lines
    cfg = load_config(preset)
    for f in fields(TrainConfig):
        kind = kind_of(f)
        weights = "; --resume and --init-from take the weights'"
        about = "the network's (model/gpt.py)" + weights * (f.name not in {"block_size", "dropout"})
        about = get_args(f.type)[1] if get_origin(f.type) is Annotated else about
        if kind is bool:
            shown = f"{flag(f.name)}, --no-{flag(f.name)[2:]}"
        elif get_origin(kind) is Literal:
            shown = f"{flag(f.name)} {{{','.join(get_args(kind))}}}"
        else:
            shown = f"{flag(f.name)} {kind.__name__.upper()}"
        assert f"{shown} {about} (default: {getattr(cfg, f.name)})" in text, f.name
    assert f"optimizer steps (default: {cfg.max_iters})" in text
    assert ("(default: 1050)" in text) is (preset == "small")
    assert "finetune_gpt2, gpt2, shakespeare_gpu, small, tiny" in text


def test_a_toml_file_starts_from_its_base_and_names_the_run_after_itself(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('base = "small"\nmax_iters = 7\nlr = 0.002\ncompile = true\n')
    cfg = load_config(str(path))
    assert cfg == replace(load_config("small"), name="mine", max_iters=7, lr=0.002, compile=True)
    assert cfg.run_dir == Path("out/mine")
    assert parse_args(["--config", str(path), "--max-iters", "9"]).max_iters == 9
    path.write_text('name = "other"\nn_layer = 2\n')  # no base: TrainConfig's defaults
    assert load_config(str(path)) == replace(TrainConfig(), name="other", n_layer=2)


def test_a_runs_config_json_round_trips_and_its_folder_reads_it(tmp_path):
    ran = replace(
        load_config("tiny"),
        max_iters=7,
        lr=0.002,
        bias=False,
        pos_emb="rope",
        out_dir=str(tmp_path / "run"),
        resume=True,
        eval_only=True,
    )
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps(settings(ran), indent=1))
    again = replace(ran, resume=False, eval_only=False)  # the settings, not what the command did
    assert load_config(str(tmp_path / "run" / "config.json")) == again
    assert load_config(str(tmp_path / "run")) == again
    assert parse_args(["--config", str(tmp_path / "run")]) == again
    # a preset's run writes its folder, out/<name>, into config.json
    assert settings(load_config("tiny"))["out_dir"] == "out/tiny"
    assert load_config(str(tmp_path / "run")).run_dir == tmp_path / "run"


def test_an_unknown_key_in_a_file_is_one_line_with_a_did_you_mean(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('base = "tiny"\nmax_iter = 7\n')
    with pytest.raises(UserError) as e:
        load_config(str(path))
    assert str(e.value) == f"{path}: unknown setting 'max_iter'; did you mean 'max_iters'?"
    path.write_text("colour = 1\n")  # nothing close: no guess
    with pytest.raises(UserError) as e:
        load_config(str(path))
    assert str(e.value) == f"{path}: unknown setting 'colour'"


@pytest.mark.parametrize(
    "line, message",
    [
        ('max_iters = "5"', "--max-iters '5': expected an int"),
        ("max_iters = 1.5", "--max-iters 1.5: expected an int"),
        ("max_iters = true", "--max-iters True: expected an int"),
        ("lr = true", "--lr True: expected a float"),
        ("compile = 1", "--compile 1: expected a bool"),
        ("name = 3", "--name 3: expected a str"),
        ("pos_emb = 1", "--pos-emb 1: choose one of learned, rope"),
        ('device = "gpu"', "--device 'gpu': choose one of auto, cpu, cuda, mps"),
    ],
)
def test_a_value_of_the_wrong_type_in_a_file_is_one_line_naming_the_flag(tmp_path, line, message):
    path = tmp_path / "mine.toml"
    path.write_text(f'base = "tiny"\n{line}\n')
    with pytest.raises(UserError) as e:
        load_config(str(path))
    assert str(e.value) == message


def test_an_int_where_a_float_goes_is_taken(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text("lr = 1\nmin_lr = 0\n")
    cfg = load_config(str(path))
    assert (cfg.lr, cfg.min_lr) == (1, 0)


NAN, INF = math.nan, math.inf
SHAPE = "must be n_head x an even head size (rope's)"
BELOW_1 = "--dropout, --beta1, --beta2: below 1; --decay-frac: in (0, 1]"
BOUNDS = [  # (fields on top of tiny's, the message)
    ({"lr": -1.0}, "--lr -1.0: expected a finite number, at least 0"),
    ({"max_iters": -5}, "--max-iters -5: expected a finite number, at least 0"),
    ({"warmup_iters": -1}, "--warmup-iters -1: expected a finite number, at least 0"),
    ({"max_time": NAN}, "--max-time nan: expected a finite number, at least 0"),
    ({"grad_clip": INF}, "--grad-clip inf: expected a finite number, at least 0"),
    ({"ddp_timeout": -INF}, "--ddp-timeout -inf: expected a finite number, at least 0"),
    ({"max_iters": 0}, "--max-iters, --eval-interval and --log-interval: at least 1"),
    ({"log_interval": 0}, "--max-iters, --eval-interval and --log-interval: at least 1"),
    ({"batch_size": 0}, "--n-layer, --n-head, --n-embd, --block-size, --batch-size: at least 1"),
    ({"n_head": 0}, "--n-layer, --n-head, --n-embd, --block-size, --batch-size: at least 1"),
    ({"n_head": 3}, f"--n-embd 16 {SHAPE}"),
    ({"pos_emb": "rope", "n_embd": 18}, f"--n-embd 18 {SHAPE}"),
    ({"pos_emb": "rope", "n_head": 16}, f"--n-embd 16 {SHAPE}"),
    ({"dropout": 1.0}, BELOW_1),
    ({"beta1": 1.0}, BELOW_1),
    ({"beta2": 1.5}, BELOW_1),
    ({"decay_frac": 0.0}, BELOW_1),
    ({"decay_frac": 1.5}, BELOW_1),
    ({"min_lr": 0.01}, "--min-lr 0.01 is above --lr 0.001"),
    ({"seed": 2**63}, "--seed must be below 2**63"),
    ({"hellaswag_interval": 15}, "--hellaswag-interval must be a multiple of --eval-interval"),
]
IDS = [",".join(f"{k}={v}" for k, v in bad.items()) for bad, _ in BOUNDS]


def toml_value(value) -> str:
    return json.dumps(value) if isinstance(value, str) else str(value)  # nan, inf: TOML's too


@pytest.mark.parametrize("bad, message", BOUNDS, ids=IDS)
def test_every_bound_is_one_line_from_a_flag(bad, message):
    argv = [f"{flag(name)}={value}" for name, value in bad.items()]  # = takes -inf as a value
    assert refused(["--config", "tiny", *argv]) == message


@pytest.mark.parametrize("bad, message", BOUNDS, ids=IDS)
def test_every_bound_is_one_line_from_a_file(tmp_path, bad, message):
    path = tmp_path / "mine.toml"
    path.write_text('base = "tiny"\n' + "".join(f"{k} = {toml_value(v)}\n" for k, v in bad.items()))
    with pytest.raises(UserError) as e:
        load_config(str(path))
    assert str(e.value) == message
    assert refused(["--config", str(path)]) == message


@pytest.mark.parametrize("bad, message", BOUNDS, ids=IDS)
def test_every_bound_is_one_line_from_code(bad, message):
    with pytest.raises(UserError) as e:
        replace(load_config("tiny"), **bad)
    assert str(e.value) == message


def test_the_edges_of_the_bounds_are_taken():
    edges = dict(
        lr=0.0,
        min_lr=0.0,
        beta1=0.0,
        dropout=0.999,
        decay_frac=1.0,
        seed=2**63 - 1,
        hellaswag_interval=20,
        n_embd=18,  # an odd head size without rope
        warmup_iters=0,
        max_time=0.0,
    )
    cfg = replace(load_config("tiny"), **edges)
    assert all(getattr(cfg, k) == v for k, v in edges.items())
    assert replace(cfg, pos_emb="rope", n_embd=20).n_embd == 20  # a head of 10: even
    assert replace(cfg, lr=0.5, min_lr=0.5).min_lr == 0.5


def test_resume_takes_the_runs_settings_and_re_applies_only_what_was_typed(tmp_path):
    run = tmp_path / "run"
    ran = replace(load_config("tiny"), max_iters=7, lr=0.002, n_embd=32, out_dir=str(run))
    run.mkdir()
    (run / "config.json").write_text(json.dumps(settings(ran)))
    typed = ["--out-dir", str(run), "--resume", "--max-iters", "9"]
    # --config defaults to small: its values are not the run's, and only --max-iters is typed
    assert parse_args(typed) == replace(ran, max_iters=9, resume=True)
    assert parse_args(["--config", "tiny", *typed, "--lr", "0.004"]) == replace(
        ran, max_iters=9, lr=0.004, resume=True
    )
    # another --config's settings would be ignored: one line says so
    assert refused(["--config", "small", *typed]) == (
        f"--resume continues {run} with its own settings; --config small has others "
        "(--block-size 64, not 32): leave --config out, and give changes as flags"
    )
    # a file of the same name but other settings too; the run's own config.json is taken
    (tmp_path / "tiny.toml").write_text('base = "tiny"\nlr = 0.5\n')
    assert "--config " + str(tmp_path / "tiny.toml") + " has others (--n-embd 16, not 32)" in (
        refused(["--config", str(tmp_path / "tiny.toml"), *typed])
    )
    assert parse_args(["--config", str(run / "config.json"), *typed]) == replace(
        ran, max_iters=9, resume=True
    )
    # --init-from and --eval-only do nothing with --resume: refused; so is a run without its
    # config.json
    with_init = refused([*typed, "--init-from", "gpt2"])
    assert with_init == "--resume goes on from the run's checkpoint: leave --init-from out"
    assert refused([*typed, "--eval-only"]) == (
        "--eval-only scores the run's best.pt: leave --resume out"
    )
    (run / "config.json").unlink()
    (run / "ckpt.pt").write_bytes(b"")
    assert refused(typed).startswith(f"cannot resume {run}: its config.json is gone; put it back")
    # a preset's run folder, out/<name>, relative to where train.py runs
    (tmp_path / "out" / "tiny").mkdir(parents=True)
    (tmp_path / "out" / "tiny" / "config.json").write_text(
        json.dumps(settings(replace(load_config("tiny"), seed=5)))
    )
    assert parse_args(["--config", "tiny", "--resume"]).seed == 5
    # no run yet: the preset and the flags (train.py then says there is no checkpoint)
    cfg = parse_args(["--config", "tiny", "--out-dir", str(tmp_path / "none"), "--resume"])
    assert cfg == replace(load_config("tiny"), out_dir=str(tmp_path / "none"), resume=True)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-iter", "5"], "unrecognized arguments: --max-iter 5"),
        (["--max-iters-", "5"], "unrecognized arguments: --max-iters- 5"),
        (["--max-it", "5"], "unrecognized arguments: --max-it 5"),  # no abbreviations
        (["--conf", "nope"], "unrecognized arguments: --conf nope"),
        (["--max_iters", "5"], "unrecognized arguments: --max_iters 5"),
        (["5"], "unrecognized arguments: 5"),
        (["--max-iters"], "argument --max-iters: expected one argument"),
        (["--max-iters", "1.5"], "argument --max-iters: invalid int value: '1.5'"),
        (["--lr", "fast"], "argument --lr: invalid float value: 'fast'"),
        (["--config"], "argument --config: expected one argument"),
    ],
)
def test_a_misspelt_or_malformed_flag_is_one_line(argv, message):
    assert refused(["--config", "tiny", *argv]) == message


def test_a_config_that_is_not_there_is_one_line_listing_the_presets(tmp_path):
    message = refused(["--config", "smal"])
    assert message.startswith("--config smal: ")
    assert message.endswith(
        "give a preset (finetune_gpt2, gpt2, shakespeare_gpu, small, tiny) or a .toml file"
    )
    (tmp_path / "bad.toml").write_text("max_iters = = 3\n")
    assert refused(["--config", str(tmp_path / "bad.toml")]).startswith(
        f"--config {tmp_path}/bad.toml: "
    )
    (tmp_path / "bad.json").write_text("{max_iters: 3}")
    assert refused(["--config", str(tmp_path / "bad.json")]).startswith(
        f"--config {tmp_path}/bad.json"
    )
    (tmp_path / "empty").mkdir()  # a folder without a run's config.json
    assert re.match(
        rf"--config {tmp_path}/empty: .*config.json", refused(["--config", str(tmp_path / "empty")])
    )


@pytest.mark.parametrize("config, near", [("smal", "small"), ("configs/small.py", "small")])
def test_a_config_near_a_presets_name_is_told_the_preset(config, near):
    assert f"did you mean --config {near}? give a preset" in refused(["--config", config])


def test_an_option_that_does_nothing_with_eval_only_is_one_line():
    argv = [
        "--config",
        "tiny",
        "--eval-only",
        "--hellaswag",
        "x.jsonl",
        "--hellaswag-interval",
        "20",
    ]
    assert refused(argv) == "--eval-only scores HellaSwag once: leave --hellaswag-interval out"


def test_help_says_init_from_is_not_read_by_resume_and_booleans_take_no_value(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--init-from STR a run folder, or a GPT-2 folder or hub id; not read by --resume" in text
    assert "--bias, --no-bias" in text and "[BOOL]" not in text


def test_an_empty_config_and_a_base_that_is_itself_are_one_line(tmp_path):
    assert refused(["--config", ""]).startswith("--config is empty; give a preset (")
    (tmp_path / "me.toml").write_text(f'base = "{tmp_path / "me.toml"}"\n')
    message = refused(["--config", str(tmp_path / "me.toml")])
    assert message == f"{tmp_path / 'me.toml'}: its base is itself, or a base of its base"


@pytest.mark.parametrize("name", ["shakespeare_gpu", "gpt2", "finetune_gpt2"])
def test_a_gpu_preset_holds_its_tokens_a_step_whatever_the_number_of_gpus(name):
    """Without tokens_per_step, torchrun on 8 GPUs would train on 8 times the preset's batch."""
    cfg = load_config(name)
    assert cfg.tokens_per_step >= cfg.batch_size * cfg.block_size


def test_a_base_file_is_found_beside_the_file_that_names_it(tmp_path, monkeypatch):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "b1.toml").write_text('base = "tiny"\nlr = 0.005\n')
    (tmp_path / "runs" / "b2.toml").write_text('base = "b1.toml"\nmax_iters = 7\n')
    monkeypatch.chdir(tmp_path)  # not runs/: the base is looked up beside b2.toml
    cfg = load_config("runs/b2.toml")
    assert (cfg.lr, cfg.max_iters, cfg.n_embd) == (0.005, 7, 16)
    (tmp_path / "runs" / "b1.toml").unlink()
    with pytest.raises(UserError) as e:  # blamed on the file that names it
        load_config("runs/b2.toml")
    assert str(e.value).startswith("runs/b2.toml: base 'b1.toml' is neither a preset (")
