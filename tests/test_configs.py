"""Configs: named presets, TOML files, run directories, command-line overrides, train.py's --help."""

from dataclasses import fields, replace
from typing import get_type_hints

import pytest

import train
from configs import TrainConfig, available_configs, load_config, parse_config
from configs.cli import ArgumentParser, Flag
from configs.errors import UserError
from data.files import write_json


def test_named_configs_load_and_name_their_run_dir():
    names = available_configs()
    assert {"small", "tiny", "shakespeare_gpu", "gpt2", "finetune_gpt2"} <= set(names)
    for name in names:
        cfg = load_config(name)
        assert isinstance(cfg, TrainConfig) and cfg.name == name and cfg.out_dir == f"out/{name}"
    assert load_config("tiny", ["--out-dir", "elsewhere"]).out_dir == "elsewhere"


def test_overrides_accept_dashes_underscores_equals_and_bool_flags():
    cfg = load_config("small", ["--max-iters", "200", "--max_time=30", "--lr", "3e-4", "--no-bias",
                                "--compile", "--device", "cpu", "--tokens-per-step", "1e4", "--qk-norm", "true"])
    assert (cfg.max_iters, cfg.max_time, cfg.lr, cfg.bias, cfg.compile, cfg.device) == (200, 30.0, 3e-4, False, True, "cpu")
    assert cfg.tokens_per_step == 10000 and cfg.qk_norm is True
    assert load_config("tiny", ["--wandb"]).wandb is True
    cfg = load_config("tiny", ["--out_dir", "x", "--compile=False", "--tie_weights=0", "--bias", "no"])
    assert (cfg.out_dir, cfg.compile, cfg.tie_weights, cfg.bias) == ("x", False, False, False)


@pytest.mark.parametrize("argv, needle", [
    (["--max-iter", "5"], "did you mean --max-iters?"),
    (["--lerning-rate", "1"], "--help"),
    (["--max-iters", "abc"], "--max-iters: expects an integer, got 'abc'"),
    (["--max-iters", "2.5"], "expects an integer"),
    (["--lr", "fast"], "expects a number"),
    (["--device", "gpu"], "'gpu' is not one of auto, cpu, cuda, mps; did you mean 'cuda'?"),
    (["--lr-schedule", "cosin"], "did you mean 'cosine'"),
    (["--compile=maybe"], "expects true/false"),
    (["--max-iters"], "--max-iters: expected one argument"),
    (["200"], "unexpected argument"),
    (["--n-head", "3"], "divisible by n_head"),
    (["--min-lr", "1"], "must not exceed --lr"),
])
def test_bad_overrides_are_one_clear_line(argv, needle):
    with pytest.raises(UserError) as e:
        load_config("tiny", argv)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_unknown_config_suggests_the_close_one():
    with pytest.raises(UserError, match="did you mean 'small'"):
        load_config("smal")


def test_toml_config_with_base(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('base = "tiny"\nmax_iters = 7\nlr = 0.002\ncompile = true\n')
    cfg = load_config(str(path), ["--max-iters", "9"])
    assert (cfg.name, cfg.n_embd, cfg.max_iters, cfg.lr, cfg.compile) == ("mine", 16, 9, 0.002, True)
    assert cfg.out_dir == "out/mine"
    path.write_text('base = "tiny"\nmax_iter = 7\n')
    with pytest.raises(UserError, match="did you mean 'max_iters'"):
        load_config(str(path))
    path.write_text('device = "gpu"\n')
    with pytest.raises(UserError, match=r"mine.toml: device 'gpu' is not one of .*did you mean 'cuda'"):
        load_config(str(path))
    path.write_text('max_iters = 2.5\n')
    with pytest.raises(UserError, match="mine.toml: max_iters expects an integer, got 2.5"):
        load_config(str(path))
    with pytest.raises(UserError, match="not found"):
        load_config(str(tmp_path / "missing.toml"))


def test_a_run_directory_reproduces_its_config(tmp_path):
    ran = load_config("tiny", ["--max-iters", "7", "--lr", "0.002", "--no-bias", "--out-dir", str(tmp_path / "run"),
                               "--resume"])
    write_json(tmp_path / "run" / "config.json", ran.to_dict())  # what train.py writes
    cfg = replace(ran, out_dir="out/tiny", resume=False)  # its settings, not its place or its resuming
    assert load_config(str(tmp_path / "run")) == cfg
    assert load_config(str(tmp_path / "run" / "config.json")) == cfg
    again = load_config(str(tmp_path / "run"), ["--out-dir", str(tmp_path / "again")])
    assert again.to_dict() == cfg.to_dict() | {"out_dir": str(tmp_path / "again")}
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="has no config.json"):
        load_config(str(tmp_path / "empty"))
    (tmp_path / "run" / "config.json").write_text('{"max_iters": 7, "lr_rate": 1}')
    with pytest.raises(UserError, match="unknown key 'lr_rate'"):
        load_config(str(tmp_path / "run"))


def test_script_flags_sit_beside_the_fields():
    parser = ArgumentParser(prog="train.py")
    parser.add_argument("--plan", action=Flag, help="print the plan and exit")  # one line per script flag
    cfg, args = parse_config(parser, ["--config", "tiny", "--plan", "--max_iters=3"])
    assert (args.plan, args.config, cfg.max_iters, cfg.n_embd) == (True, "tiny", 3, 16)
    assert not hasattr(args, "max_iters")


def test_help_shows_the_selected_configs_values_and_every_field(capsys):
    assert train.main(["--config", "small", "--help"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert any("--pos-emb {learned,rope}" in line for line in lines)
    flat = "".join(out.split())  # argparse wraps long help lines
    small = load_config("small", [])
    for text in ("learnedabsolutepositions(GPT-2)orrotary(default:'rope')", "(default:'muon')",
                 f"(default:{small.max_iters})", f"(default:{small.lr})", "finetune_gpt2,gpt2,shakespeare_gpu,small,tiny"):
        assert text in flat
    for f in fields(TrainConfig):
        assert f"--{f.name.replace('_', '-')}" in out and "".join(f.metadata["help"].split()) in flat
    assert train.main(["--config=tiny", "-h"]) == 0
    assert "optimizersteps(default:20)" in "".join(capsys.readouterr().out.split())


def test_main_prints_error_line_and_exits_2(capsys):
    assert train.main(["--config", "tiny", "--max-iter", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown option '--max-iter'; did you mean --max-iters?") and "Traceback" not in err
    assert train.main(["--config=nope"]) == 2
    assert train.main(["--help"]) == 0 and "--max-iters" in capsys.readouterr().out


TYPES = get_type_hints(TrainConfig)
NUMERIC = [f.name for f in fields(TrainConfig) if TYPES[f.name] in (int, float)]
# Beyond nan, inf, -inf and negatives, which no numeric option takes: each option's other refusals
REFUSES = {"beta1": ["1", "1e9"], "beta2": ["1.5"], "muon_momentum": ["7", "1"], "dropout": ["1"],
           "decay_frac": ["0", "1.5"], "seed": [str(2**64)], "ddp_timeout": ["0", "604801", "1e30"], "batch_size": ["0"],
           "n_layer": ["0", "1001", "2000000000"], "block_size": ["0", "1048577", "1073741824"]} | dict.fromkeys(
    ("max_iters", "eval_interval", "log_interval", "n_head", "n_embd"), ["0"])  # the caps: tracebacks and hangs before
CASES = [(name, value) for name in NUMERIC for value in ("nan", "inf", "-inf", "-1", "-1e-3", *REFUSES.get(name, ()))]


@pytest.mark.parametrize("name, value", CASES, ids=[f"{n}={v}" for n, v in CASES])
def test_every_numeric_option_refuses_nan_inf_and_out_of_range_when_parsed(monkeypatch, capsys, name, value):
    monkeypatch.setattr(train, "train", lambda cfg: pytest.fail(f"trained with {name}={value}"))
    option = f"--{name.replace('_', '-')}"
    assert train.main(["--config", "tiny", option, value]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(f"error: {option}: expects "), err


@pytest.mark.parametrize("argv, needed", [(["--muon-lr", "0.1"], "--optimizer muon (this run: --optimizer adamw)"),
                                          (["--muon-momentum", "0.9"], "--optimizer muon (this run: --optimizer adamw)"),
                                          (["--decay-frac", "0.5"], "--lr-schedule wsd (this run: --lr-schedule cosine)"),
                                          (["--lr-schedule", "constant", "--lr-decay-iters", "5"],
                                           "--lr-schedule cosine/wsd (this run: --lr-schedule constant)"),
                                          (["--wandb-run-name", "x"], "--wandb")])
def test_a_flag_that_would_do_nothing_is_refused_naming_what_it_needs(argv, needed):
    flag = argv[-2]
    with pytest.raises(UserError) as e:
        load_config("tiny", argv)  # adamw, cosine, no wandb: each was silently ignored
    assert str(e.value) == f"{flag} does nothing without {needed}; add {needed.split(' (')[0]} or drop {flag}"
    cfg = load_config("tiny", argv + ["--optimizer", "muon", "--lr-schedule", "wsd", "--wandb"])
    assert getattr(cfg, flag[2:].replace("-", "_")) == type(getattr(cfg, flag[2:].replace("-", "_")))(argv[-1])


def test_bounds_are_stated_in_the_message_and_hold_for_files_and_code(tmp_path):
    for argv, message in [(["--lr", "-1e-3"], "--lr: expects a number >= 0, got '-1e-3'"),
                          (["--batch-size", "0"], "--batch-size: expects a whole number >= 1 or auto, got '0'"),
                          (["--max-time", "nan"], "--max-time: expects a finite number, got 'nan'"),
                          (["--muon-momentum", "7"], "--muon-momentum: expects a number in [0, 1), got '7'")]:
        with pytest.raises(UserError) as e:
            load_config("tiny", argv)
        assert str(e.value) == message
    edges = ["--lr", "0", "--min-lr", "0", "--beta1", "0", "--decay-frac", "1", "--max-time", "0", "--batch-size", "auto",
             "--optimizer", "muon", "--lr-schedule", "wsd"]  # what --decay-frac and --muon-momentum act with
    cfg = load_config("tiny", edges + ["--muon-momentum", "0.999", "--ddp-timeout", "1e-3", "--warmup-iters", "0",
                                  "--n-layer", "1000"])
    assert (cfg.lr, cfg.beta1, cfg.decay_frac, cfg.batch_size, cfg.muon_momentum) == (0, 0, 1, 0, 0.999)
    path = tmp_path / "mine.toml"
    path.write_text('base = "tiny"\nbatch_size = 0\n')  # auto, as a run's config.json stores it
    assert load_config(str(path)).batch_size == 0
    path.write_text("muon_momentum = 7\n")
    with pytest.raises(UserError, match=r"mine.toml: muon_momentum expects a number in \[0, 1\), got 7$"):
        load_config(str(path))
    path.write_text("max_time = inf\n")
    with pytest.raises(UserError, match="mine.toml: max_time expects a finite number, got inf$"):
        load_config(str(path))
    for bad, message in [(dict(lr=-1), "lr expects a number >= 0, got -1"),
                         (dict(grad_clip=float("nan")), "grad_clip expects a finite number, got nan"),
                         (dict(max_iters=0), "max_iters expects an integer >= 1, got 0")]:
        with pytest.raises(UserError) as e:
            replace(load_config("tiny"), **bad)
        assert str(e.value) == message
