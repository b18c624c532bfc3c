"""Configs: named presets, TOML files, command-line overrides and their error messages."""

import pytest

import train
from configs import TrainConfig, available_configs, load_config, parse_overrides
from errors import UserError


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
    assert parse_overrides(["--wandb"]) == {"wandb": True}


@pytest.mark.parametrize("argv, needle", [
    (["--max-iter", "5"], "did you mean --max-iters?"),
    (["--lerning-rate", "1"], "--help"),
    (["--max-iters", "abc"], "--max-iters expects an integer, got 'abc'"),
    (["--max-iters", "2.5"], "expects an integer"),
    (["--lr", "fast"], "expects a number"),
    (["--device", "gpu"], "'gpu' is not one of auto, cpu, cuda, mps"),
    (["--lr-schedule", "cosin"], "did you mean 'cosine'"),
    (["--compile", "maybe"], "expects true/false"),
    (["--max-iters"], "needs a value"),
    (["200"], "unexpected argument"),
    (["--n-head", "3"], "divisible by n_head"),
    (["--min-lr", "1"], "must not exceed lr"),
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
    with pytest.raises(UserError, match="not found"):
        load_config(str(tmp_path / "missing.toml"))


def test_main_prints_error_line_and_exits_2(capsys):
    assert train.main(["--config", "tiny", "--max-iter", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown option '--max-iter'; did you mean --max-iters?") and "Traceback" not in err
    assert train.main(["--config=nope"]) == 2
    assert train.main(["--help"]) == 0 and "--max-iters" in capsys.readouterr().out
