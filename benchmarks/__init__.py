"""Measurements of the project, each printing one JSON line: `python -m benchmarks --help`."""

import json

import torch


def emit(record: dict) -> None:
    """One JSON line: the record, and what ran it (the CPU's or GPU's model name, torch's threads);
    each record names its dtype."""
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    else:
        try:
            with open("/proc/cpuinfo") as f:
                device = next(
                    line.split(":")[1].strip() for line in f if line.startswith("model name")
                )
        except (OSError, StopIteration):
            device = "a CPU"
    print(json.dumps({"device": device, "threads": torch.get_num_threads()} | record), flush=True)
