"""The run's record: metrics.jsonl and loss.png in the run directory, and wandb when asked."""

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from configs.errors import UserError, first_line
from data.files import atomic_write, write_errors


def _reason(e: Exception) -> str:
    """wandb's error in a line: a settings error (pydantic's, for a misspelt WANDB_MODE) holds it in errors()."""
    with contextlib.suppress(Exception):  # no errors(), or not pydantic's shape: this message must not fail itself
        return "; ".join(f"{d['loc'][0]}={d['input']!r}: {d['msg']}" for d in e.errors()) or first_line(e)
    return first_line(e)


class RunLog:
    """One run's metrics.jsonl, loss.png and wandb run; a resume drops the lines past its checkpoint's step."""

    def __init__(self, out_dir: Path, started: float, resume_step: int | None = None) -> None:
        self.out_dir, self.started = Path(out_dir), started
        self.path = self.out_dir / "metrics.jsonl"
        self.records: list[dict[str, Any]] = []
        if resume_step is not None and self.path.exists():
            for line in self.path.read_text().splitlines():
                with contextlib.suppress(json.JSONDecodeError):
                    rec = json.loads(line)
                    if rec.get("step", 0) <= resume_step:
                        self.records.append(rec)
        if self.records or self.path.exists():  # a new folder stays empty until the first record
            with write_errors(self.path), open(self.path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in self.records)
        self.wandb: Any = None
        self.wandb_from, self.plotted_at, self.plot_cost = 0, 0.0, 0.5  # wandb_from: the first step wandb lacks
        self.samples: list[list[Any]] = []

    def start_wandb(self, project: str, name: str, config: dict[str, Any], run_id: str | None) -> str:
        """Start a wandb run, or continue run_id, in out_dir/wandb (or $WANDB_DIR), and return its id."""
        try:
            import wandb
        except ImportError:
            raise UserError("--wandb needs the wandb package: pip install wandb (or drop --wandb)") from None
        # None leaves it to wandb (WANDB_MODE, its settings, else online); offline needs no account
        mode = None if "WANDB_MODE" in os.environ or os.environ.get("WANDB_API_KEY") else "offline"
        with contextlib.suppress(Exception):  # an older wandb without prompt=, or a broken settings file, means no key
            mode = mode and (None if wandb.login(prompt=False, verify=False) else mode)
        try:  # before the run writes a file or trains a step: a run the user asked to track is tracked or not started
            self.wandb = wandb.init(project=project or os.environ.get("WANDB_PROJECT") or "gpt", name=name,
                                    config=config, dir=None if os.environ.get("WANDB_DIR") else str(self.out_dir),
                                    id=run_id, resume="allow", mode=mode)
        except Exception as e:  # no key, a bad WANDB_MODE, no network, a folder it cannot write, ...
            raise UserError(f"--wandb: wandb did not start ({_reason(e)}); fix that, or run with WANDB_MODE=offline "
                            "(no account needed) or without --wandb") from None
        # after a kill -9 only wandb knows what it holds: the steps below starting_step (0 offline: docs/training.md)
        self.wandb_from = self.wandb.starting_step
        for record in self.records:
            self._send(record)
        if self.wandb.settings.mode == "offline" or mode == "offline":
            print(f"wandb: logging offline; upload later with `wandb sync {self.wandb.settings.sync_dir}` "
                  "(it holds the whole run: sync no older offline-run dir of it)")
        return self.wandb.id

    def log(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        with write_errors(self.path), open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        self._send(record)

    def _send(self, record: dict[str, Any]) -> None:
        if self.wandb is not None and record["step"] >= self.wandb_from:  # wandb drops a lower step anyway
            with self._wandb_may_fail():
                self.wandb.log({k: v for k, v in record.items() if k != "step" and v is not None}, step=record["step"])
                if "val_loss" in record:  # the summary keeps each key's last value, and this too
                    self.wandb.summary["best_val_loss"] = min(r["val_loss"] for r in self.records if "val_loss" in r)

    def log_sample(self, step: int, text: str) -> None:
        if self.wandb is not None and step >= self.wandb_from:
            import wandb
            self.samples.append([step, text])  # the whole table each time: wandb tables are immutable
            with self._wandb_may_fail():
                self.wandb.log({"samples": wandb.Table(columns=["step", "text"], data=self.samples)}, step=step)

    @contextlib.contextmanager
    def _wandb_may_fail(self) -> Iterator[None]:
        """wandb failing mid-run is a note, and the run goes on without it, since metrics.jsonl holds every record."""
        try:
            yield
        except Exception as e:
            print(f"note: wandb failed ({_reason(e)}); the run goes on without it; metrics.jsonl has every record",
                  file=sys.stderr)
            self.wandb = None

    def plot(self, force: bool = True) -> None:
        """Train and val loss against step in loss.png. force=False redraws at most every 30 s: not free on a CPU."""
        if not force and time.time() - self.plotted_at < 30:
            return
        self.plotted_at = time.time()
        failing = sys.exc_info()[1] is not None  # called from a `finally` while an error is on its way out
        try:
            self._plot()
        except Exception as e:  # a full disk, a bad MPLBACKEND or a name its fonts cannot show is not worth a run
            if not failing:
                print(f"note: {e}" if isinstance(e, UserError) else "note: loss.png not drawn: matplotlib failed "
                      f"({first_line(e, 100)}); check its settings (MPLBACKEND, matplotlibrc)", file=sys.stderr)
        finally:
            self.plot_cost = time.time() - self.plotted_at  # for --max-time's reserve

    def _plot(self) -> None:
        from matplotlib.figure import Figure  # Not pyplot's: a Figure of its own needs no GUI backend, nor closing.
        fig = Figure(figsize=(7, 4.5))
        ax = fig.subplots()
        ax.plot(*self._series("loss"), color="tab:blue", alpha=0.35, lw=1, label="train (running)")
        ax.plot(*self._series("train_loss"), "o-", color="tab:blue", ms=3, label="train (eval)")
        ax.plot(*self._series("val_loss"), "o-", color="tab:orange", ms=3, label="val")
        ax.set(xlabel="step", ylabel="loss", title=self.out_dir.name)
        ax.grid(alpha=0.3)
        ax.legend()
        if any("hellaswag_acc" in r for r in self.records):  # on a second axis, since accuracy rises as loss falls
            right = ax.twinx()
            right.plot(*self._series("hellaswag_acc_norm"), "s-", color="tab:green", ms=3, label="HellaSwag acc_norm")
            right.legend(loc="upper center")
        fig.tight_layout()
        atomic_write(self.out_dir / "loss.png", lambda f: fig.savefig(f, format="png", dpi=110))

    def _series(self, key: str) -> tuple[list[int], list[float]]:
        rows = [r for r in self.records if r.get(key) is not None]
        return [r["step"] for r in rows], [r[key] for r in rows]

    def close(self, exit_code: int = 0) -> None:
        """Finish the wandb run, as failed if exit_code != 0."""
        if self.wandb is not None:
            with self._wandb_may_fail():
                self.wandb.finish(exit_code=exit_code)
            self.wandb = None
