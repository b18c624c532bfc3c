"""The benchmarks' command line: each subcommand prints one JSON line per measurement.

    python -m benchmarks sample                   # decoding tokens/s (benchmarks/decode.py)
    python -m benchmarks train --config small --iters 200        # step time, ours vs plain PyTorch
    python -m benchmarks time-to-loss --config small --max-time 45 --target 1.88
    python -m benchmarks memory --config small    # plan.py's peak memory vs the measured one
    python -m benchmarks hellaswag --config gpt2 --items 100     # HellaSwag seconds per 100 items
"""

import sys

from configs.cli import ArgumentParser
from configs.errors import entry_point

from . import decode, hellaswag, memory, runs, train


@entry_point
def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m benchmarks", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (decode.add_sample_parser, train.add_train_parser, runs.add_time_to_loss_parser,
                memory.add_memory_parser, hellaswag.add_hellaswag_parser):
        add(sub.add_parser)
    args, extra = parser.parse_known_args(argv)  # all but sample pass the flags they lack on to TrainConfig
    if extra and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    args.func(args)


if __name__ == "__main__":
    sys.exit(main())
