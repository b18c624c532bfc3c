"""The run's record: metrics.jsonl and loss.png in the run directory, and wandb when asked."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from configs.errors import UserError, first_line
from data.files import atomic_write, write_errors

if TYPE_CHECKING:
    from training.reference import Reference


def _wandb_has_key(wandb: Any) -> bool:
    try:
        return bool(os.environ.get("WANDB_API_KEY") or wandb.login(prompt=False, verify=False))
    except Exception:  # older wandb without prompt=, or a broken settings file: treat as no key
        return False


def _reason(e: Exception) -> str:
    """wandb's error in a line: a settings error (pydantic's, for a misspelt WANDB_MODE) holds it in errors(),
    whose text only counts them; any other error's first line says it."""
    try:
        return "; ".join(f"{d['loc'][0]}={d['input']!r}: {d['msg']}" for d in e.errors()) or first_line(e)
    except Exception:  # no errors(), or not pydantic's shape: this is only the message of another failure
        return first_line(e)


class RunLog:
    """One run's metrics.jsonl, loss.png and wandb run. On resume, lines past the checkpoint's step
    are dropped (the run redoes those steps) and wandb gets exactly the steps it lacks; with a
    matching reference, records carry its mean (ref_val_loss, ...) and loss.png draws its band."""

    def __init__(self, out_dir: Path, started: float, resume_step: int | None = None,
                 reference: Reference | None = None) -> None:
        self.out_dir, self.started = Path(out_dir), started  # started: time.time() at the run's start
        self.reference = reference
        self.path = self.out_dir / "metrics.jsonl"
        self.records: list[dict[str, Any]] = []
        if resume_step is not None and self.path.exists():
            for line in self.path.read_text().splitlines():
                with contextlib.suppress(json.JSONDecodeError):
                    rec = json.loads(line)
                    if rec.get("step", 0) <= resume_step:
                        self.records.append(rec)
        if self.records or self.path.exists():  # a new folder stays empty until a record comes
            with write_errors(self.path), open(self.path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in self.records)
        self.wandb: Any = None
        self.wandb_from = 0  # the first step the wandb run lacks
        self.plotted_at, self.plot_cost = 0.0, 0.5
        self.samples: list[list[Any]] = []

    def start_wandb(self, project: str, name: str, config: dict[str, Any], run_id: str | None) -> str:
        """Start (or continue, given run_id) a wandb run in out_dir/wandb (or $WANDB_DIR); returns its id."""
        try:
            import wandb
        except ImportError:
            raise UserError("--wandb needs the wandb package: pip install wandb (or drop --wandb)") from None
        # None: wandb's own choice (WANDB_MODE, its settings, else online); offline needs no account
        mode = None if "WANDB_MODE" in os.environ or _wandb_has_key(wandb) else "offline"
        try:  # before the run writes a file or trains a step: a run the user asked to track is tracked or not started
            self.wandb = wandb.init(project=project or os.environ.get("WANDB_PROJECT") or "gpt", name=name,
                                    config=config, dir=None if os.environ.get("WANDB_DIR") else str(self.out_dir),
                                    id=run_id, resume="allow", mode=mode)
        except Exception as e:  # no key, a bad WANDB_MODE, no network, a folder it cannot write, ...
            raise UserError(f"--wandb: wandb did not start ({_reason(e)}); fix that, or run with WANDB_MODE=offline "
                            "(no account needed) or without --wandb") from None
        # after a kill -9 only wandb knows what it holds: steps below starting_step (0 offline: docs/training.md)
        self.wandb_from = self.wandb.starting_step
        for record in self.records:
            self._send(record)
        if self.wandb.settings.mode == "offline" or mode == "offline":
            print(f"wandb: logging offline; upload later with `wandb sync {self.wandb.settings.sync_dir}` "
                  "(it holds the whole run: sync no older offline-run dir of it)")
        return self.wandb.id

    def log(self, record: dict[str, Any]) -> None:
        if self.reference is not None:
            record = record | self.reference.means(record)
        self.records.append(record)
        with write_errors(self.path), open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        self._send(record)

    def _send(self, record: dict[str, Any]) -> None:
        if self.wandb is not None and record["step"] >= self.wandb_from:  # wandb drops a lower step anyway
            with self._wandb_may_fail():
                self.wandb.log({k: v for k, v in record.items() if k != "step" and v is not None}, step=record["step"])
                if "val_loss" in record:  # the summary keeps each key's last value, and this: the runs table shows both
                    self.wandb.summary["best_val_loss"] = min(r["val_loss"] for r in self.records if "val_loss" in r)

    def log_sample(self, step: int, text: str) -> None:
        if self.wandb is not None and step >= self.wandb_from:
            import wandb

            self.samples.append([step, text])  # the whole table each time: wandb tables are immutable
            with self._wandb_may_fail():
                self.wandb.log({"samples": wandb.Table(columns=["step", "text"], data=self.samples)}, step=step)

    @contextlib.contextmanager
    def _wandb_may_fail(self) -> Iterator[None]:
        """wandb failing mid-run (its staging folder unwritable, its service gone) is a note, and the run
        goes on without it: metrics.jsonl holds every record, and hours of training outweigh a dashboard."""
        try:
            yield
        except Exception as e:
            print(f"note: wandb failed ({_reason(e)}); the run goes on without it; metrics.jsonl has every record",
                  file=sys.stderr)
            self.wandb = None

    def plot(self, force: bool = True) -> None:
        """Train and val loss against step in loss.png (a note without matplotlib).
        force=False redraws at most every 30 s: a redraw is not free on a small CPU."""
        if not force and time.time() - self.plotted_at < 30:
            return
        self.plotted_at = time.time()
        failing = sys.exc_info()[1] is not None  # called from a `finally` while an error is on its way out
        try:
            self._plot()
        except Exception as e:  # a full disk, a bad MPLBACKEND, a name its fonts cannot show: not worth a run
            if not failing:
                print(f"note: {e}" if isinstance(e, UserError) else "note: loss.png not drawn: matplotlib failed "
                      f"({first_line(e, 100)}); check its settings (MPLBACKEND, matplotlibrc)", file=sys.stderr)
        finally:
            self.plot_cost = time.time() - self.plotted_at  # for max_time's reserve

    def _plot(self) -> None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("note: matplotlib is not installed, skipping loss.png (pip install matplotlib)")
            return

        if self.reference is None:
            fig, ax = plt.subplots(figsize=(7, 4.5))
        else:  # below the curves, val minus the reference's mean: the band is too thin to see up there
            fig, (ax, gap) = plt.subplots(2, 1, figsize=(7, 6.5), sharex=True, height_ratios=(3, 1.3))
            self._plot_reference(ax, gap)
        ax.plot(*self._series("loss"), color="tab:blue", alpha=0.35, lw=1, label="train (running)")
        ax.plot(*self._series("train_loss"), "o-", color="tab:blue", ms=3, label="train (eval)")
        ax.plot(*self._series("val_loss"), "o-", color="tab:orange", ms=3, label="val")
        ax.set(xlabel="" if self.reference else "step", ylabel="loss", title=self.out_dir.name)
        ax.grid(alpha=0.3)
        ax.legend(title=self.reference and f"config matches the {self.reference.label}", title_fontsize="small")
        fig.tight_layout()
        try:
            atomic_write(self.out_dir / "loss.png", lambda f: fig.savefig(f, format="png", dpi=110))
        finally:
            plt.close(fig)

    def _series(self, key: str) -> tuple[list[int], list[float]]:
        pts = [(r["step"], r[key]) for r in self.records if r.get(key) is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    def _plot_reference(self, ax: Any, gap: Any) -> None:
        """The reference's min-max bands under the run's curves (ax); in gap, the run's val loss,
        the band and the out-of-band thresholds, each minus the reference's val mean."""
        ref = self.reference
        for key, color, what in (("loss", "tab:blue", "train"), ("val_loss", "tab:orange", "val")):
            s = ref.series(key)
            ax.fill_between(s["step"], s["min"], s["max"], color=color, alpha=0.18, lw=0,
                            label=f"reference {what}: min-max of {len(ref.data['seeds'])} seeds")
        val = {k: np.array(v) for k, v in ref.series("val_loss").items()}
        steps, mean = val["step"], val["mean"]
        ax.plot(steps, mean, "--", color="tab:orange", lw=0.8, alpha=0.7, label="reference val: mean")
        margin = np.array([ref.margin("val_loss", step) for step in steps])
        gap.fill_between(steps, val["min"] - mean, val["max"] - mean, color="tab:orange", alpha=0.18, lw=0)
        gap.plot(steps, val["min"] - margin - mean, ":", color="gray", lw=1)
        gap.plot(steps, val["max"] + margin - mean, ":", color="gray", lw=1, label="band +- margin: a note beyond")
        run = [(step, v - band[1]) for step, v in zip(*self._series("val_loss"))
               if (band := ref.band("val_loss", step)) is not None]
        gap.plot([p[0] for p in run], [p[1] for p in run], "o-", color="tab:orange", ms=3)
        gap.axhline(0, color="tab:orange", lw=0.8, ls="--", alpha=0.7)
        gap.set(xlabel="step", ylabel="val - ref. mean")
        gap.grid(alpha=0.3)
        gap.legend(fontsize="small")

    def close(self, exit_code: int = 0) -> None:
        """exit_code != 0 marks the wandb run as failed (a crash, a divergence, an interruption)."""
        if self.wandb is not None:
            with self._wandb_may_fail():
                self.wandb.finish(exit_code=exit_code)
            self.wandb = None
