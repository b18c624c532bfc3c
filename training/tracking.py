"""Weights & Biases for --wandb: a run started, or continued by its id, before any step trains."""

import os

from configs import UserError


def start_wandb(cfg, settings: dict, run_id: str):
    """The wandb run: online with an API key (or as WANDB_MODE says), else offline, which needs no
    account (`wandb sync` uploads it later); it writes into the run folder, or WANDB_DIR."""
    try:
        import wandb

        online = "WANDB_MODE" in os.environ or wandb.login(prompt=False, verify=False)
        return wandb.init(
            project=os.environ.get("WANDB_PROJECT", "gpt"),
            name=cfg.name,
            dir=os.environ.get("WANDB_DIR", str(cfg.run_dir)),
            config=settings,
            mode=None if online else "offline",
            id=run_id or None,
            resume="allow",
        )
    except Exception as e:  # no network, a bad WANDB_MODE...: what was asked for cannot be done
        raise UserError(
            f"--wandb: wandb did not start ({str(e).splitlines()[0]}); fix that, or run with "
            "WANDB_MODE=offline, or without --wandb"
        ) from None
