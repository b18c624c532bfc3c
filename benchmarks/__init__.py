"""What the benchmarks share: one JSON line per measurement, a device sync around each timing."""

import itertools
import json
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def timed(fn: Callable[[], Any], device: str) -> tuple[Any, float]:
    """fn()'s result and its wall seconds, with the device synced before each clock read."""
    sync = torch.get_device_module(device).synchronize
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


def stepper(model: Any, optimizer: Any, fwd: Any, pool: list, rt: Any, grad_clip: float) -> Callable[[], Any]:
    """A training step of train.py's own functions through fwd (the model, maybe compiled) on pool's batches in turn."""
    from train import forward_backward, optimizer_step

    data = SimpleNamespace(next_step=itertools.cycle(pool).__next__)  # all that forward_backward reads

    def step() -> Any:
        if rt.threads:
            rt.threads.update()  # as train.py's loop does
        loss = forward_backward(fwd, data, rt)
        optimizer_step(model, optimizer, rt, grad_clip)
        return loss

    return step
