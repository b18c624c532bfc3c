"""Reference loss bands: what a run of a named config looks like over several seeds.

configs/reference/<config>.json (`python -m benchmarks reference --config small --seeds 5`) holds
the mean and min-max over seeds of each metrics key (KEYS) by step, the config behind it and the
command, machine, dtype and date. A run whose config matches one in every field that shapes the
loss curve is drawn over its band, logs its mean, and hears about an eval clearly outside it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from configs import BASE

REFERENCE_DIR = Path(__file__).resolve().parent.parent / "configs" / "reference"
KEYS = ("loss", "train_loss", "val_loss")

# Fields a run may differ in and still be compared: they leave the loss curve alone, within
# the seed spread (docs/training.md).
MATCH_IGNORES = frozenset({"name", "out_dir", "data_root", "resume", "seed", "eval_interval", "log_interval",
                           "sample_tokens", "attention", "device", "dtype", "compile", "threads", "wandb",
                           "wandb_project", "wandb_run_name"})

# "Clearly outside" is a band width beyond the band's edge, and never closer than MIN_MARGIN: a
# new seed lands outside n seeds' min-max range often (docs/training.md), and machines differ slightly.
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
        refs = (cls.load(path) for path in sorted(REFERENCE_DIR.glob("*.json")))
        return next((ref for ref in refs if not ref.mismatches(cfg, world_size)), None)

    def mismatches(self, cfg: dict[str, Any], world_size: int = 1) -> list[str]:
        """The fields (outside MATCH_IGNORES) in which cfg differs from the reference's config.
        A field newer than the reference matches at its default (which kept the old behaviour).
        tokens_per_step compares the global batch: 0 means one micro-batch per process, and the
        reference ran in one process."""
        ours, theirs = _global_batch(cfg, world_size), BASE.to_dict() | _global_batch(self.data["config"], 1)
        return [k for k in sorted(ours) if k not in MATCH_IGNORES and theirs.get(k) != ours[k]]

    @property
    def label(self) -> str:
        return "{name} reference ({dtype} on {device}, {date})".format(**self.data)

    def series(self, key: str) -> dict[str, list[float]]:
        """{"step", "mean", "min", "max"} lists for one metrics key."""
        return self.data["series"][key]

    def band(self, key: str, step: int) -> tuple[float, float, float] | None:
        """(min, mean, max) at step, linear between the reference's steps; None outside them."""
        s = self.data["series"].get(key)
        if not s or not s["step"][0] <= step <= s["step"][-1]:
            return None
        return tuple(float(np.interp(step, s["step"], s[k])) for k in ("min", "mean", "max"))

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
        bands = {key: self.band(key, record["step"]) for key in KEYS if record.get(key) is not None}
        return {f"ref_{key}": round(band[1], 4) for key, band in bands.items() if band is not None}


def _global_batch(cfg: dict[str, Any], world_size: int) -> dict[str, Any]:
    return cfg | {"tokens_per_step": cfg["tokens_per_step"] or cfg["batch_size"] * cfg["block_size"] * world_size}
