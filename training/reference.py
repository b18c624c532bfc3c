"""Reference loss bands: the min and max of a named config's train and val loss over several seeds.

`python -m benchmarks reference --config small` writes configs/reference/small.json. A run whose config matches one
in every field that shapes the loss curve is drawn over its band, and hears about an eval clearly outside it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from configs import BASE

REFERENCE_DIR = Path(__file__).resolve().parent.parent / "configs" / "reference"

# A run may differ in these fields and still be compared: they move the loss curve less than seeds do.
MATCH_IGNORES = frozenset({"name", "out_dir", "data_root", "resume", "seed", "eval_interval", "log_interval",
                           "sample_tokens", "attention", "device", "dtype", "compile", "threads", "wandb",
                           "wandb_project", "wandb_run_name"})

# "Clearly outside" is more than a band width beyond the band's edge, and never closer than MIN_MARGIN: a new seed
# often lands just outside the range of n seeds (docs/training.md), and machines differ slightly.
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
        """The reference whose config shapes the loss curve as cfg (a run's resolved config.json) does, if any."""
        refs = (cls.load(path) for path in sorted(REFERENCE_DIR.glob("*.json")))
        return next((ref for ref in refs if not ref.mismatches(cfg, world_size)), None)

    def mismatches(self, cfg: dict[str, Any], world_size: int = 1) -> list[str]:
        """The fields outside MATCH_IGNORES in which cfg differs; a field newer than the reference matches at its
        default. tokens_per_step compares the global batch, since 0 means one micro-batch per process."""
        ours, theirs = _global_batch(cfg, world_size), BASE.to_dict() | _global_batch(self.data["config"], 1)
        return [k for k in sorted(ours) if k not in MATCH_IGNORES and theirs.get(k) != ours[k]]

    def band(self, step: int) -> tuple[float, float] | None:
        """The (min, max) of val loss at step, linear between the eval steps; None outside them."""
        steps, val = self.data["band"]["step"], self.data["band"]["val_loss"]
        if not steps[0] <= step <= steps[-1]:
            return None
        return float(np.interp(step, steps, val["min"])), float(np.interp(step, steps, val["max"]))

    def check(self, step: int, val_loss: float) -> str | None:
        """A note when the eval's val loss is clearly outside the band, else None."""
        lo, hi = self.band(step) or (-math.inf, math.inf)  # no band, no note
        margin = max(hi - lo, MIN_MARGIN)
        if lo - margin <= val_loss <= hi + margin:
            return None
        return (f"note: step {step} val loss {val_loss:.4f} is {'above' if val_loss > hi else 'below'} the "
                f"{self.data['name']} reference band ({lo:.4f}-{hi:.4f}, {len(self.data['seeds'])} seeds, margin "
                f"{margin:.3f}); usual causes: an lr or batch size other than the config's (changed code or "
                f"--resume), or other data under this name")


def _global_batch(cfg: dict[str, Any], world_size: int) -> dict[str, Any]:
    return cfg | {"tokens_per_step": cfg["tokens_per_step"] or cfg["batch_size"] * cfg["block_size"] * world_size}
