"""bench.py's subcommands that outgrew it, and what they share: one JSON line per measurement,
and a device sync before each clock read."""

from __future__ import annotations

import json
from typing import Any

import torch


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
