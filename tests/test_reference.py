"""Reference loss bands (reference.py): the band over seeds, the match rule, the out-of-band line."""

from dataclasses import replace

import pytest

import train
from benchmarks.runs import build_reference as build
from benchmarks.runs import write_reference as write
from configs import load_config
from training import reference
from training.reference import MIN_MARGIN, Reference

STEPS = (0, 10, 20)


def resolved(name, *argv):
    """A named config as a run records it in config.json (vocab_size: the char tokenizer's 65)."""
    return replace(load_config(name, list(argv)), vocab_size=65).to_dict()


def three_seeds(val):
    """metrics.jsonl records of three runs; val[seed][i] is seed's val loss at STEPS[i]."""
    return [[{"step": s, "loss": v + 0.1, "lr": 1e-3} for s, v in zip(STEPS[1:], vals[1:])]
            + [{"step": s, "train_loss": v - 0.1, "val_loss": v} for s, v in zip(STEPS, vals)] for vals in val]


def make(tmp_path, val, cfg=None):
    data = build("tiny", cfg or resolved("tiny"), three_seeds(val), [1, 2, 3], "python -m benchmarks ...", "cpu", "float32")
    return Reference.load(write(data, tmp_path / "tiny.json"))


def test_band_is_min_max_over_seeds_linear_between_steps(tmp_path):
    ref = make(tmp_path, [[4.0, 3.0, 2.0], [4.2, 3.1, 2.3], [4.1, 3.2, 2.1]])
    assert ref.data["final_val_loss"] == [2.0, 2.3, 2.1] and ref.data["seeds"] == [1, 2, 3]
    assert ref.data["band"] == {"step": [0, 10, 20], "val_loss": {"min": [4.0, 3.0, 2.0], "max": [4.2, 3.2, 2.3]},
                                "train_loss": {"min": [3.9, 2.9, 1.9], "max": [4.1, 3.1, 2.2]}}
    assert ref.band(10) == pytest.approx((3.0, 3.2))
    assert ref.band(5) == pytest.approx((3.5, 3.7))  # halfway between steps 0 and 10
    assert ref.band(15) == pytest.approx((2.5, 2.75))
    assert ref.band(21) is None and ref.band(-1) is None  # never extrapolated


def test_a_step_only_some_seeds_logged_is_left_out(tmp_path):
    runs = three_seeds([[4.0, 3.0, 2.0]] * 3)
    runs[1] = [r for r in runs[1] if r["step"] != 10]
    data = build("tiny", resolved("tiny"), runs, [1, 2, 3], "", "cpu", "float32")
    assert data["band"]["step"] == [0, 20] and data["band"]["train_loss"]["max"] == [3.9, 1.9]


def test_match_rule_changed_lr_or_layers_means_no_band(tmp_path, monkeypatch):
    monkeypatch.setattr(reference, "REFERENCE_DIR", tmp_path)
    ref = make(tmp_path, [[4.0, 3.0, 2.0]] * 3)
    same = resolved("tiny", "--seed", "7", "--eval-interval", "5", "--out-dir", "elsewhere", "--dtype", "float32",
                    "--threads", "1", "--attention", "explicit", "--resume", "--wandb")
    assert Reference.matching(same).path == ref.path
    assert ref.mismatches(resolved("tiny", "--lr", "2e-3")) == ["lr"]
    assert ref.mismatches(resolved("tiny", "--n-layer", "3")) == ["n_layer"]
    assert ref.mismatches(resolved("tiny", "--max-iters", "30")) == ["max_iters"]  # the schedule stretches
    assert ref.mismatches(resolved("tiny", "--batch-size", "8")) == ["batch_size", "tokens_per_step"]
    assert ref.mismatches(resolved("tiny", "--max-time", "5")) == ["max_time"]  # an lr schedule by the clock
    # tokens_per_step 0: one micro-batch per process, so two DDP processes take twice the reference's batch
    assert ref.mismatches(resolved("tiny"), world_size=2) == ["tokens_per_step"]
    assert ref.mismatches(resolved("tiny", "--tokens-per-step", "128")) == []  # 4 x 32, spelled out
    assert Reference.matching(resolved("tiny", "--lr", "2e-3")) is None
    assert Reference.matching(resolved("small")) is None
    # a field added after the reference was made matches at its default, not otherwise
    del ref.data["config"]["qk_norm"]
    assert ref.mismatches(resolved("tiny")) == [] and ref.mismatches(resolved("tiny", "--qk-norm")) == ["qk_norm"]


@pytest.mark.parametrize("path", sorted(reference.REFERENCE_DIR.glob("*.json")), ids=lambda p: p.stem)
def test_shipped_references_match_their_configs(path):
    ref, name = Reference.load(path), path.stem
    assert ref.mismatches(resolved(name)) == [], f"configs/{name}.py changed: rerun `{ref.data['command']}`"
    assert len(ref.data["seeds"]) >= 3 and ref.data["command"].startswith(f"python -m benchmarks reference --config {name}")
    assert all(ref.data[k] for k in ("machine", "device", "dtype", "date", "torch"))
    band = ref.data["band"]
    assert band["step"][0] == 0 and band["step"][-1] == ref.data["config"]["max_iters"]
    assert all(lo <= hi for key in ("train_loss", "val_loss") for lo, hi in zip(band[key]["min"], band[key]["max"]))
    final = ref.data["final_val_loss"]  # each seed's last eval: the band's last step spans them
    assert (min(final), max(final)) == (band["val_loss"]["min"][-1], band["val_loss"]["max"][-1])


def test_check_flags_only_clearly_outside(tmp_path):
    ref = make(tmp_path, [[4.0, 3.0, 2.0], [4.2, 3.1, 2.3], [4.1, 3.2, 2.1]])  # at step 10: 3.0-3.2, margin 0.2
    assert ref.check(10, 3.39) is None  # outside the band, within the margin
    assert ref.check(10, 2.81) is None
    line = ref.check(10, 3.41)
    assert "step 10 val loss 3.4100 is above the tiny reference band (3.0000-3.2000" in line
    assert "is below" in ref.check(10, 2.79) and "lr or batch size" in ref.check(10, 2.79)
    assert ref.check(20, 2.59) is None and ref.check(20, 2.61)  # at step 20: 2.0-2.3, so margin 0.3
    flat = make(tmp_path, [[4.0, 3.0, 2.0]] * 3)  # seeds that agree exactly still leave MIN_MARGIN
    assert flat.check(10, 3.0 + MIN_MARGIN * 0.9) is None and flat.check(10, 3.03)
    assert flat.check(25, 9.0) is None  # past the reference: no band, no line


def tiny_run(tmp_path, data_root, *argv, run="run"):
    cfg = load_config("tiny", ["--device", "cpu", "--sample-tokens", "0", *argv])
    return train.train(replace(cfg, out_dir=str(tmp_path / run), data_root=str(data_root)))


def test_out_of_band_run_prints_one_line_per_eval_and_goes_on(tmp_path, data_root, monkeypatch, capsys):
    refs = tmp_path / "refs"
    monkeypatch.setattr(reference, "REFERENCE_DIR", refs)
    make(refs, [[1.0, 0.9, 0.8], [1.1, 1.0, 0.9], [1.0, 1.0, 1.0]])  # far below what tiny reaches (~4)
    result = tiny_run(tmp_path, data_root)
    assert result["step"] == 20 and result["stopped"] == "max_iters"  # a note, not a stop
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: step")]
    assert [n.split()[2] for n in notes] == ["0", "10", "20"]
    assert all("is above the tiny reference band" in n for n in notes)
    assert (tmp_path / "run" / "loss.png").read_bytes()[:4] == b"\x89PNG"

    tiny_run(tmp_path, data_root, "--lr", "2e-3", run="other")  # another lr: no band, no notes
    assert "note: step" not in capsys.readouterr().out


def test_a_new_seed_of_tiny_stays_inside_the_shipped_band(tmp_path, data_root, capsys):
    result = tiny_run(tmp_path, data_root, "--seed", "99")  # not one of the reference's seeds
    assert "note: step" not in capsys.readouterr().out
    lo, hi = Reference.matching(resolved("tiny")).band(20)
    assert lo - 0.03 < result["val_loss"] < hi + 0.03
