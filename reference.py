"""Reference loss bands: what a run of a named config looks like over several seeds.

configs/reference/<config>.json holds, for train.py's metrics keys (loss, train_loss,
val_loss), the mean and min-max over seeds at each step, the config that produced them, and
the command, machine, dtype and date (`python bench.py reference --config small --seeds 5 ...`
writes it). A run whose config matches a reference's in every field that shapes the loss
curve (MATCH_IGNORES lists the rest) is drawn over its band, gets it as a separate series
in metrics.jsonl and wandb, and hears about it at an eval that lands clearly outside.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REFERENCE_DIR = Path(__file__).resolve().parent / "configs" / "reference"
KEYS = ("loss", "train_loss", "val_loss")

# Fields that leave the loss curve alone, so a run may differ in them and still be compared:
# names, paths and logging; how often to evaluate (evaluation draws no random numbers: seed 7
# of small evaluated every 600 or every 150 steps has the same val loss at 600, 1200, 1800);
# attention (sdpa and explicit compute the same numbers); where and how fast it runs (device,
# dtype, threads, compile: a 600-step run of small ends 0.002 apart in bf16 and fp32, inside
# the seed spread; the reference records its own dtype); the seed (the band is over seeds);
# resume (exact: N steps equal N/2 + N/2 resumed).
MATCH_IGNORES = frozenset({
    "name", "out_dir", "data_root", "resume", "seed", "eval_interval", "log_interval", "sample_tokens",
    "attention", "device", "dtype", "compile", "threads", "wandb", "wandb_project", "wandb_run_name",
})

# With n seeds, a new seed falls outside their min-max range with probability 2 / (n + 1)
# (it is as likely to be the lowest or the highest of the n + 1 as any other), a third of the
# time for n = 5, so the band itself cannot be the alarm. A run is "clearly outside" when it is
# a whole band width beyond the band's edge: 5 Gaussian seeds span 2.3 standard deviations on
# average, so that is about 3.5 from the mean (4.6 for 10 seeds). Measured: 15 fresh seeds of
# tiny against its 10-seed band, 0 of 45 evals flagged, the farthest 0.8 margins beyond the
# band; seed 7 of small, outside its 5-seed band at 9 of 13 evals, at most 0.54 beyond. Never
# closer than MIN_MARGIN: a few seeds can agree by chance at a step, and other CPUs, bf16 vs
# fp32 and kernel choices move losses by a few thousandths.
MIN_MARGIN = 0.02


@dataclass(frozen=True)
class Reference:
    """One configs/reference/<config>.json: the band, the config behind it and how it was made."""

    path: Path
    data: dict[str, Any]

    @classmethod
    def load(cls, path: str | Path) -> Reference:
        return cls(Path(path), json.loads(Path(path).read_text()))

    @classmethod
    def matching(cls, cfg: dict[str, Any], world_size: int = 1) -> Reference | None:
        """The reference whose config shapes the loss curve exactly as cfg does, if one does.
        cfg is the run's resolved config (vocab_size set), as its config.json records it."""
        for path in sorted(REFERENCE_DIR.glob("*.json")):
            ref = cls.load(path)
            if not ref.mismatches(cfg, world_size):
                return ref
        return None

    def mismatches(self, cfg: dict[str, Any], world_size: int = 1) -> list[str]:
        """The fields (outside MATCH_IGNORES) in which cfg differs from the reference's config.
        A field newer than the reference matches at its default (which kept the old behaviour).
        tokens_per_step compares the global batch: 0 means one micro-batch per process, and the
        reference ran in one process."""
        from configs import BASE

        ours, theirs = _global_batch(cfg, world_size), _global_batch(self.data["config"], 1)
        defaults = BASE.to_dict()
        return [k for k in sorted(ours) if k not in MATCH_IGNORES and theirs.get(k, defaults.get(k)) != ours[k]]

    @property
    def label(self) -> str:
        d = self.data
        return f"{d['name']} reference ({d['dtype']} on {d['device']}, {d['date']})"

    def series(self, key: str) -> dict[str, list[float]]:
        """{"step", "mean", "min", "max"} lists for one metrics key."""
        return self.data["series"][key]

    def band(self, key: str, step: int) -> tuple[float, float, float] | None:
        """(min, mean, max) at step, linear between the reference's steps; None outside them."""
        s = self.data["series"].get(key)
        if not s or not s["step"][0] <= step <= s["step"][-1]:
            return None
        lo, mean, hi = (float(np.interp(step, s["step"], s[k])) for k in ("min", "mean", "max"))
        return lo, mean, hi

    def margin(self, key: str, step: int) -> float:
        lo, _, hi = self.band(key, step) or (0.0, 0.0, 0.0)
        return max(hi - lo, MIN_MARGIN)

    def check(self, step: int, losses: dict[str, float]) -> str | None:
        """One line when the eval's val loss is clearly outside the band (see MIN_MARGIN), else None."""
        band, value = self.band("val_loss", step), losses.get("val_loss")
        if band is None or value is None:
            return None
        lo, _, hi = band
        margin = self.margin("val_loss", step)
        if lo - margin <= value <= hi + margin:
            return None
        side = "above" if value > hi else "below"
        return (f"note: step {step} val loss {value:.4f} is {side} the {self.data['name']} reference band "
                f"({lo:.4f}-{hi:.4f}, {len(self.data['seeds'])} seeds, margin {margin:.3f}); usual causes: an lr "
                f"or batch size other than the config's (changed code or --resume), or other data under this name")

    def means(self, record: dict[str, Any]) -> dict[str, float]:
        """{"ref_<key>": band mean at the record's step} for each metrics key the record has."""
        out = {}
        for key in KEYS:
            if record.get(key) is not None and (band := self.band(key, record["step"])) is not None:
                out[f"ref_{key}"] = round(band[1], 4)
        return out


def _global_batch(cfg: dict[str, Any], world_size: int) -> dict[str, Any]:
    return cfg | {"tokens_per_step": cfg["tokens_per_step"] or cfg["batch_size"] * cfg["block_size"] * world_size}


def build(name: str, config: dict[str, Any], runs: list[list[dict[str, Any]]], seeds: list[int],
          command: str, device: str, dtype: str) -> dict[str, Any]:
    """A reference from several seeds' metrics.jsonl records (one list per run): for each key,
    the steps every run logged it and the mean, min and max over runs there."""
    import datetime

    import torch

    series = {}
    for key in KEYS:
        per_run = [{r["step"]: r[key] for r in records if r.get(key) is not None} for records in runs]
        steps = sorted(set.intersection(*(set(d) for d in per_run)))
        values = [[d[step] for d in per_run] for step in steps]  # (steps, runs)
        series[key] = {"step": steps, **{stat: [round(f(v), 4) for v in values] for stat, f in
                                         (("mean", statistics.fmean), ("min", min), ("max", max))}}
    final = [[r for r in records if r.get("val_loss") is not None][-1]["val_loss"] for records in runs]
    return {"name": name, "command": command, "machine": machine(device), "device": device, "dtype": dtype,
            "torch": torch.__version__, "date": datetime.date.today().isoformat(), "seeds": seeds,
            "final_val_loss": [round(v, 4) for v in final],
            "config": {k: v for k, v in config.items() if k not in ("seed", "out_dir")}, "series": series}


def machine(device: str) -> str:
    """The CPU's model name (what lscpu prints) and core count; on CUDA, the GPU's name."""
    import os
    import platform
    import re

    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    names = re.findall(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.MULTILINE) if cpuinfo.exists() else []
    return f"{names[0] if names else platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def write(ref: dict[str, Any], path: Path) -> Path:
    """JSON with each list of numbers on one line: small diffs, readable by eye."""
    import re

    text = json.dumps(ref, indent=1)
    text = re.sub(r"\[\s+([^][{}]*?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    return path
