"""loss.png: the training and validation losses of metrics.jsonl against the step."""

import json
from pathlib import Path

from configs import replacing


def plot_losses(run_dir: Path) -> None:
    from matplotlib.figure import Figure  # a Figure of its own needs no window system, nor closing

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for key, style, label in (
        ("loss", "-", "train (running)"),
        ("train_loss", "o-", "train"),
        ("val_loss", "o-", "val"),
    ):
        rows = [r for r in records if key in r]
        ax.plot(
            [r["step"] for r in rows],
            [r[key] for r in rows],
            style,
            label=label,
            alpha=0.4 if key == "loss" else 1,
        )
    ax.set(xlabel="step", ylabel="loss", title=run_dir.name)
    ax.grid(alpha=0.3)
    ax.legend()
    with replacing(run_dir / "loss.png") as tmp:
        fig.savefig(tmp, format="png", dpi=110)
