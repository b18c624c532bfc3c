"""Measurements of the project, each printing one JSON line: `python -m benchmarks --help`."""

import json


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)
