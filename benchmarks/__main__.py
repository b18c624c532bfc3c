"""The benchmarks: each prints one JSON line per measurement.

Run from the repository:
python -m benchmarks size                        # Python tokens of the code, and what loads
python -m benchmarks train --config small --iters 200       # train.py's tokens/s and step time
python -m benchmarks train --config small --iters 200 --busy 1   # beside a busy process
python -m benchmarks sample --config small       # decoding tokens/s, eager and compiled
python -m benchmarks sample --config gpt2 --modes eager,transformers --temperature 0 --tokens 100
python -m benchmarks time-to-loss --config small # whole `python train.py` runs: wall s, val loss
python -m benchmarks max-time --config small --max-time 20   # the share of a run in its steps
python -m benchmarks gpu                         # pytest -m cuda, GPT-2's step, shakespeare_gpu
"""

import sys

from configs import ArgumentParser, run


def main(argv=None) -> None:
    from . import decode, gpu, runs, size

    p = ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__,
    )
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("size", help="Python tokens per file and folder, and what the commands load")
    train = sub.add_parser("train", help="train.py's training tokens/s and ms a step")
    train.add_argument("--config", default="small")
    train.add_argument("--iters", type=int, default=200, help="steps (the first fifth warms up)")
    train.add_argument("--busy", type=int, default=0, help="busy processes started before the run")
    sample = sub.add_parser("sample", help="decoding tokens/s: eager and compiled")
    sample.add_argument("--config", default="small")
    sample.add_argument("--tokens", type=int, default=500, help="tokens decoded per round")
    sample.add_argument("--modes", default="eager,compiled", help="eager, compiled, transformers")
    sample.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    sample.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="auto: sample.py's choice on this CPU (transformers: its float32)",
    )
    times = sub.add_parser("time-to-loss", help="whole train.py runs: wall seconds and val loss")
    times.add_argument("--config", default="small")
    times.add_argument("--runs", type=int, default=1)
    share = sub.add_parser("max-time", help="the share of a run's printed time in its steps")
    share.add_argument("--config", default="small")
    on_gpu = sub.add_parser("gpu", help="one GPU: the cuda tests, GPT-2's step, shakespeare_gpu")
    on_gpu.add_argument("--iters", type=int, default=30, help="GPT-2 steps (the last 5 timed)")
    on_gpu.add_argument("--nanogpt", help="nanoGPT's repository: its bench.py runs beside ours")
    args, extra = p.parse_known_args(argv)  # train and time-to-loss pass other flags to train.py
    if extra and args.command not in ("train", "time-to-loss", "max-time"):
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "size":
        size.main()
    elif args.command == "sample":
        decode.main(args)
    elif args.command == "gpu":
        gpu.main(args)
    else:
        run_ = {"train": runs.train, "time-to-loss": runs.time_to_loss, "max-time": runs.share}
        run_[args.command](args, extra)


if __name__ == "__main__":
    run(lambda: main(sys.argv[1:]))
