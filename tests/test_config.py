"""TrainConfig and train.py's command line: presets, flags, config files, config.json, bounds.

Every mistake a user can make in the settings is a UserError of one line, which names the flag
where it can; configs.run prints it as `error: ...` (tests/test_failures.py runs the scripts).
Command lines are written as a shell has them; tables of cases as text, a case a line.
"""

import json
import re
import tomllib
from dataclasses import replace
from pathlib import Path
from typing import get_args, get_type_hints

import pytest
from conftest import ROOT, rows

from configs import PRESETS, TrainConfig, UserError, load_config, parse_args, settings

TINY = load_config("tiny")


def parse(argv):
    return parse_args(argv.split())


def refused(arg, read=parse):
    """The message of the UserError that read(arg) raises: one line."""
    with pytest.raises(UserError, match=r"\A.*\Z") as e:  # . is not a line break
        read(arg)
    return str(e.value)


def write(path, data):
    """The text (as UTF-8) or bytes in the file at path, in folders made as needed."""
    (p := Path(path)).parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


@pytest.fixture(autouse=True)
def elsewhere(tmp_path, monkeypatch):
    """Each test runs in an empty folder of its own (test_data.py's too): relative paths, such as
    run folders (out/tiny/config.json, read by --resume), resolve there, not in the repository,
    where a user's runs may be."""
    monkeypatch.chdir(tmp_path)


def test_presets_load_and_name_their_run_folder_and_no_config_is_small():
    presets = sorted(p.stem for p in ROOT.glob("configs/*.toml"))
    assert PRESETS == presets == "finetune_gpt2 gpt2 shakespeare_gpu small tiny".split()
    for name in PRESETS:
        cfg = load_config(name)
        assert (cfg.name, cfg.out_dir, cfg.run_dir) == (name, "", Path("out", name))
        # the GPU presets: the same batch, however many GPUs torchrun starts
        assert name in ("small", "tiny") or cfg.tokens_per_step >= cfg.batch_size * cfg.block_size
    small = parse("--config small --n-layer 4 --n-embd 96 --max-iters 1050 --optimizer muon")
    assert parse("") == small == load_config("small")  # no --config, and no flag that changes
    assert parse("--config gpt2 --vocab-size 50304 --compile") == load_config("gpt2")
    assert parse("--config tiny") == parse("--config=tiny") == TINY
    # flags win over the preset, and the rest is the preset's
    flags = "--max-iters 5 --pos-emb learned --compile --lr 0.01 --no-bias --out-dir a"
    assert parse(f"--config small {flags}") == replace(
        small, max_iters=5, pos_emb="learned", compile=True, lr=0.01, bias=False, out_dir="a"
    )
    assert parse(flags).run_dir == Path("a")


@pytest.mark.parametrize("config", ["", "--config tiny"])  # no --config: small's
def test_every_field_is_a_flag_of_its_type_that_help_shows_with_the_configs_value(
    config, capsys, monkeypatch
):
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit, match="^0$"):
        parse(f"{config} --help")
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps long lines
    base, values = parse(config), dict(v.split("=") for v in VALUES.split())
    for name, kind in get_type_hints(TrainConfig, include_extras=True).items():
        weights = "; --resume and --init-from take the weights'" * (
            name not in ("block_size", "dropout")
        )
        kind, about = (
            get_args(kind)
            if hasattr(kind, "__metadata__")
            else (kind, f"the network's (model/gpt.py){weights}")
        )
        f, choices = f"--{name.replace('_', '-')}", get_args(kind)
        if kind is bool:  # and a word after it is not its value: --compile false
            shown, tries = f", --no-{f[2:]}", {f: True, f"--no-{f[2:]}": False}
            assert refused(f"{config} {f} false") == "unrecognized arguments: false"
        elif choices:  # a Literal's
            shown, tries = f" {{{','.join(choices)}}}", {f"{f} {c}": c for c in choices}
            message = refused(f"{config} {f} nope")
            assert message.startswith(f"argument {f}: invalid choice: 'nope'") and all(
                f"'{c}'" in message for c in choices
            )
        else:
            shown, value = f" {kind.__name__.upper()}", values.pop(name)
            tries = {f"{f} {value}": kind(value)}
        for arg, value in tries.items():  # that value, of its type, and the rest the config's
            cfg = parse(f"{config} {arg}")
            assert cfg == replace(base, **{name: value}) and type(getattr(cfg, name)) is type(value)
        assert f"{f}{shown} {about} (default: {getattr(base, name)})" in text, name
    assert not values  # a value for each int, float and str field
    assert "[BOOL]" not in text and ("(default: 1050)" in text) is (base.name == "small")
    assert "finetune_gpt2, gpt2, shakespeare_gpu, small, tiny" in text


# a value for every int, float and str field, other than the presets' and valid on its own
VALUES = """vocab_size=100 block_size=48 n_layer=3 n_head=4 n_embd=32 dropout=0.25 name=mine
dataset=other data_root=elsewhere batch_size=7 tokens_per_step=896 lr=0.003 muon_lr=0.05
min_lr=0.0005 warmup_iters=5 decay_frac=0.5 weight_decay=0.05 beta1=0.8 beta2=0.95 grad_clip=0.5
max_iters=30 max_time=12.5 eval_interval=5 eval_iters=3 eval_batch_size=8 log_interval=2
sample_tokens=64 threads=3 seed=42 ddp_timeout=60 out_dir=runs/x init_from=gpt2
hellaswag=hs.jsonl hellaswag_interval=2100"""


def test_a_toml_file_starts_from_its_base_found_beside_it_and_a_runs_config_json_round_trips():
    write("mine.toml", 'base = "small"\nmax_iters = 7\nlr = 0.002\ncompile = true\n')
    mine = parse("--config small --name mine --max-iters 7 --lr 0.002 --compile")
    assert load_config("mine.toml") == mine and mine.run_dir == Path("out/mine")
    assert parse("--config mine.toml --max-iters 9") == replace(mine, max_iters=9)
    write("mine.toml", 'name = "other"\nlr = 1\nmin_lr = 0\n')  # no base; an int lr
    assert load_config("mine.toml") == replace(TrainConfig(), name="other", lr=1, min_lr=0)
    # config.json: the settings, not what the command did, and the folder it is now in
    ran = parse("--config tiny --max-iters 7 --lr 0.002 --no-bias --pos-emb rope --out-dir run")
    write("run/config.json", json.dumps(settings(replace(ran, resume=True, eval_only=True))))
    assert load_config("run/config.json") == load_config("run") == parse("--config run") == ran
    assert settings(TINY)["out_dir"] == "out/tiny"  # a preset's: out/<name>
    # a base file is found beside the file that names it, and its absence blamed on that file
    write("runs/b1.toml", 'base = "tiny"\nlr = 0.005\n')
    write("runs/b2.toml", 'base = "b1.toml"\nmax_iters = 7\n')  # runs/b1.toml, not ./
    assert load_config("runs/b2.toml") == parse("--config tiny --name b2 --lr 0.005 --max-iters 7")
    Path("runs/b1.toml").unlink()  # blamed on the file that names it
    assert refused("runs/b2.toml", load_config).startswith(
        "runs/b2.toml: base 'b1.toml' is neither a preset ("
    )


# TOML on top of tiny's | its one line
TYPES = """max_iters = "5" | --max-iters '5': expected an int
max_iters = 1.5 | --max-iters 1.5: expected an int
max_iters = true | --max-iters True: expected an int
lr = true | --lr True: expected a float
compile = 1 | --compile 1: expected a bool
name = 3 | --name 3: expected a str
pos_emb = 1 | --pos-emb 1: choose one of learned, rope
device = "gpu" | --device 'gpu': choose one of auto, cpu, cuda, mps
max_iter = 7 | mine.toml: unknown setting 'max_iter'; did you mean 'max_iters'?
colour = 1 | mine.toml: unknown setting 'colour'"""


@pytest.mark.parametrize("toml, message", rows(TYPES))
def test_a_wrong_type_or_an_unknown_key_in_a_file_is_one_line(toml, message):
    write("mine.toml", f'base = "tiny"\n{toml}\n')
    assert refused("mine.toml", load_config) == message


FINITE = "expected a finite number, at least 0"
SHAPE = "must be n_head x an even head size (rope's)"
BELOW_1 = "--dropout, --beta1, --beta2: below 1; --decay-frac: in (0, 1]"
# TOML on top of tiny's | its one line from a file, flags and code; none: the edges, taken
BOUNDS = f"""lr = -1.0 | --lr -1.0: {FINITE}
max_iters = -5 | --max-iters -5: {FINITE}
warmup_iters = -1 | --warmup-iters -1: {FINITE}
max_time = nan | --max-time nan: {FINITE}
grad_clip = inf | --grad-clip inf: {FINITE}
ddp_timeout = -inf | --ddp-timeout -inf: {FINITE}
max_iters = 0 | --max-iters, --eval-interval and --log-interval: at least 1
log_interval = 0 | --max-iters, --eval-interval and --log-interval: at least 1
batch_size = 0 | --n-layer, --n-head, --n-embd, --block-size, --batch-size: at least 1
n_head = 0 | --n-layer, --n-head, --n-embd, --block-size, --batch-size: at least 1
n_head = 3 | --n-embd 16 {SHAPE}
pos_emb = "rope"; n_embd = 18 | --n-embd 18 {SHAPE}
pos_emb = "rope"; n_head = 16 | --n-embd 16 {SHAPE}
dropout = 1.0 | {BELOW_1}
beta1 = 1.0 | {BELOW_1}
beta2 = 1.5 | {BELOW_1}
decay_frac = 0.0 | {BELOW_1}
decay_frac = 1.5 | {BELOW_1}
min_lr = 0.01 | --min-lr 0.01 is above --lr 0.001
seed = 9223372036854775808 | --seed must be below 2**63
hellaswag_interval = 15 | --hellaswag-interval must be a multiple of --eval-interval
lr = 0.0; min_lr = 0.0; beta1 = 0.0; dropout = 0.999; decay_frac = 1.0; warmup_iters = 0 |
seed = 9223372036854775807; hellaswag_interval = 20; max_time = 0.0; n_embd = 18 |
pos_emb = "rope"; n_embd = 20 |
lr = 0.5; min_lr = 0.5 |"""  # the edges: 18 is an odd head size without rope, 20 an even one


@pytest.mark.parametrize("row", BOUNDS.splitlines())
def test_every_bound_is_one_line_from_a_file_flags_and_code_and_the_edges_are_taken(row):
    toml, message = map(str.strip, row.split("|"))
    bad = tomllib.loads(toml := toml.replace("; ", "\n"))
    write("tiny.toml", f'base = "tiny"\n{toml}\n')  # a run named tiny
    flags = "--config tiny " + " ".join(
        f"--{k.replace('_', '-')}={v}" for k, v in bad.items()
    )  # =-inf
    code = lambda bad: replace(TINY, **bad)
    for read, arg in (
        (load_config, "tiny.toml"),
        (parse, "--config tiny.toml"),
        (parse, flags),
        (code, bad),
    ):
        assert (refused(arg, read) if message else read(arg)) == (message or code(bad))


def test_resume_takes_the_runs_settings_and_re_applies_only_what_was_typed():
    ran = parse("--config tiny --max-iters 7 --lr 0.002 --n-embd 32 --out-dir run")
    write("run/config.json", json.dumps(settings(ran)))
    typed, resumed = " --out-dir run --resume --max-iters 9", replace(ran, max_iters=9, resume=True)
    # --config defaults to small: its values are not the run's, and only --max-iters is typed
    assert parse(typed) == parse(f"--config run/config.json{typed}") == resumed
    assert parse(f"--config tiny --lr 0.004{typed}") == replace(resumed, lr=0.004)
    # another --config's settings would be ignored: one line says so; a file named tiny too
    assert refused(f"--config small{typed}") == (
        "--resume continues run with its own settings; --config small has others "
        "(--block-size 64, not 32): leave --config out, and give changes as flags"
    )
    write("tiny.toml", 'base = "tiny"\nlr = 0.5\n')
    assert "--config tiny.toml has others (--n-embd 16, not 32)" in refused(
        f"--config tiny.toml{typed}"
    )
    # nor a run without its config.json (--init-from, --eval-only: MISTAKES)
    Path("run/config.json").rename("run/ckpt.pt")
    assert refused(typed).startswith("cannot resume run: its config.json is gone; put it back")
    # a preset's run folder, out/<name>, relative to where train.py runs; no run: the preset's
    write("out/tiny/config.json", json.dumps(settings(replace(TINY, seed=5))))
    assert parse("--config tiny --resume").seed == 5
    assert parse("--config tiny --resume --out-dir none") == replace(
        TINY, out_dir="none", resume=True
    )


# a command line | its one line; "..." stands for any text
MISTAKES = """--config tiny --max-iter 5 | unrecognized arguments: --max-iter 5
--config tiny --max-iters- 5 | unrecognized arguments: --max-iters- 5
--config tiny --max-it 5 | unrecognized arguments: --max-it 5
--config tiny --conf nope | unrecognized arguments: --conf nope
--config tiny --max_iters 5 | unrecognized arguments: --max_iters 5
--config tiny 5 | unrecognized arguments: 5
--config tiny --max-iters | argument --max-iters: expected one argument
--config tiny --max-iters 1.5 | argument --max-iters: invalid int value: '1.5'
--config tiny --lr fast | argument --lr: invalid float value: 'fast'
--config tiny --config | argument --config: expected one argument
--config tiny --eval-only --hellaswag x --hellaswag-interval 20 | --eval-only scores \
HellaSwag once: leave --hellaswag-interval out
--config tiny --resume --init-from gpt2 | --resume goes on from the run's checkpoint: \
leave --init-from out
--config tiny --resume --eval-only | --eval-only scores the run's best.pt: leave --resume out
--config= | --config is empty; give a preset (finetune_gpt2, gpt2, shakespeare_gpu, small, tiny) \
or a .toml file
--config me.toml | me.toml: its base is itself, or a base of its base
--config smal | --config smal: ...; did you mean --config small? give a preset (finetune_gpt2, \
gpt2, shakespeare_gpu, small, tiny) or a .toml file
--config configs/small.py | --config configs/small.py: ...; did you mean --config small? give a \
preset (finetune_gpt2, gpt2, shakespeare_gpu, small, tiny) or a .toml file
--config bad.toml | --config bad.toml: ...
--config bad.json | --config bad.json: ...
--config empty | --config empty: ...empty/config.json..."""


@pytest.mark.parametrize("argv, message", rows(MISTAKES))
def test_a_misspelt_malformed_or_idle_flag_or_config_is_one_line(argv, message):
    write("me.toml", 'base = "me.toml"\n')
    write("bad.toml", "max_iters = = 3\n")
    write("bad.json", "{max_iters: 3}")
    Path("empty").mkdir()  # a folder without a run's config.json: named
    assert re.fullmatch(".*".join(map(re.escape, message.split("..."))), refused(argv))
