r"""Sample text from a trained GPT, streaming tokens to the terminal as they are produced.

    python sample.py --prompt "ROMEO:"                       # 500 new tokens from out/small (train it first)
    python sample.py --prompt "ROMEO:" --temperature 0       # greedy
    python sample.py --prompt "ROMEO:" --num-samples 3 --seed 7 --top-k 20 --top-p 0.9
    python sample.py --prompt "ROMEO:" --stop "\n\n"         # stop after the first speech
    python sample.py --prompt "ROMEO:" --prompt "JULIET:"    # two prompts, one batched pass
    python sample.py --prompt "ROMEO:" --compile             # compiled decode step: faster after a compile
    python sample.py --prompt-file prompts.txt               # one prompt per line
    echo "To be, or not" | python sample.py --prompt -       # prompt from stdin, verbatim
    python sample.py --config tiny --device cpu --dtype float32   # out/tiny; or --ckpt DIR|FILE
    python sample.py --init-from gpt2 --prompt "Hello"       # a hub id, a HF GPT-2 dir or a run dir

The tokenizer comes with the checkpoint (GPT-2 BPE for other Hugging Face models). "\n", "\t" and
"\\" in prompts and --stop mean newline, tab, backslash; an empty prompt starts from end-of-text
(or a newline). One sample streams as it is decoded; several decode in batches and print under a
header each. A sample ends at end-of-text or right after its first --stop string.
"""

from configs.errors import start_script

start_script(__name__)  # first: Ctrl-C during the imports below (torch: seconds) is one line

import argparse
import codecs
import itertools
import re
import sys
from collections.abc import Callable, Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

import torch

from configs import Device, Dtype, load_config, run_named
from configs.cli import ArgumentParser, Flag, argument, integer, number, seed
from configs.errors import UserError, entry_point
from model.kv_cache import generate
from training.runtime import set_threads, setup


def unescape(text: str) -> str:
    """Turn the two-character sequences \\n, \\t, \\\\ into newline, tab, backslash; leave others. Bytes of a
    command line that are not UTF-8 become U+FFFD, as the model would see them (not Python's stand-ins)."""
    text = text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)], text)


class TextStream:
    """One sample's token ids in, printable text out. An incremental UTF-8 decoder completes characters split
    across BPE tokens; `text` ends at end-of-text or after the first stop string."""

    def __init__(self, tok, stops: Sequence[str] = ()):
        self.tok = tok
        self.stops = list(stops)
        self.longest = max((len(s) for s in self.stops), default=0)
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""
        self.done = False

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is incomplete)."""
        if self.done or token_id == self.tok.eot_id:
            return self.finish()  # "" once done
        return self._add(self.decoder.decode(self.tok.decode_bytes([token_id])))

    def finish(self) -> str:
        """Flush bytes still held by the decoder (a truncated character becomes U+FFFD)."""
        piece = "" if self.done else self._add(self.decoder.decode(b"", final=True))
        self.done = True
        return piece

    def _add(self, piece: str) -> str:
        old = len(self.text)
        self.text += piece
        # Earlier text held no stop string, so only matches ending in the new piece are possible.
        start = max(0, old - self.longest + 1)
        ends = [i + len(s) for s in self.stops if (i := self.text.find(s, start)) >= 0]
        if ends:
            self.text = self.text[: min(ends)]
            self.done = True
        return self.text[old:]


def left_pad(rows: Sequence[Sequence[int]], device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token id lists -> idx (B, T) left-padded with 0, padding_mask (B, T) (None if no padding)."""
    T = max(len(r) for r in rows)
    idx = torch.tensor([[0] * (T - len(r)) + list(r) for r in rows], dtype=torch.long)
    mask = torch.tensor([[False] * (T - len(r)) + [True] * len(r) for r in rows], dtype=torch.bool)
    return idx.to(device), None if bool(mask.all()) else mask.to(device)


def generate_texts(model, tok, rows: Sequence[Sequence[int]], max_new_tokens: int, *, stops: Sequence[str] = (),
                   on_text: Callable[[int, str], None] | None = None, **sampling: Any) -> list[str]:
    """Decode all rows (prompt token ids) in one batched pass; return each row's new text. sampling (temperature,
    top_k, top_p, generator, compile) goes to generate; on_text(row, piece) gets each new piece, for streaming."""
    idx, mask = left_pad(rows, next(model.parameters()).device)
    streams = [TextStream(tok, stops) for _ in rows]
    emit = on_text or (lambda b, piece: None)
    with closing(generate(model, idx, max_new_tokens, eos_id=tok.eot_id, padding_mask=mask,
                          vocab_size=tok.vocab_size, **sampling)) as steps:  # closing restores the model's mode
        for step in steps:
            for b, token_id in enumerate(step.tolist()):  # one host sync per step: streaming needs it
                emit(b, streams[b].push(token_id))
            if all(s.done for s in streams):
                break
    for b, s in enumerate(streams):
        emit(b, s.finish())
    return [s.text for s in streams]


def load(args: argparse.Namespace):
    """(model in eval mode on the CPU, tokenizer) from --init-from, --ckpt, --config or out/small."""
    from data.tokenizer import tokenizer_from_manifest
    from model.checkpoint import find_checkpoint
    from model.hf import load_pretrained, pretrained_manifest

    where = load_config(args.config).run_dir if args.config else args.ckpt  # load_config: checks --config
    if args.config and (run := run_named(args.config)):  # a run (its dir or config.json) is sampled where it is
        where = run
    model, ckpt, path = load_pretrained(args.init_from or find_checkpoint(where, best=True, config=args.config or ""))
    tok = tokenizer_from_manifest(pretrained_manifest(path, ckpt))
    train_config = (ckpt or {}).get("train_config")
    check_vocab(model, tok, str(path), train_config.get("vocab_size") if isinstance(train_config, dict) else None)
    return model.eval(), tok


def check_vocab(model, tok, where: str, declared: int | None = None) -> None:
    """Refuse a tokenizer the model was not trained with. A larger model vocabulary is fine when training asked
    for it (`declared`: --vocab-size 50304) or it is padded to a multiple of 64: its extra ids are never sampled."""
    V, tv = model.config.vocab_size, tok.vocab_size
    if V != tv and not (tv < V and (declared == V or (V % 64 == 0 and V - tv < 64))):
        raise UserError(f"{where}: the model's vocabulary ({V} tokens) does not fit the {tok.name} tokenizer "
                        f"({tv} tokens) it would sample with; sample a model trained with that tokenizer")


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = [sys.stdin.read().removesuffix("\n") if p == "-" else unescape(p) for p in args.prompt or []]
    if args.prompt_file:
        try:
            lines = Path(args.prompt_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read --prompt-file {args.prompt_file}: {e}") from None
        from_file = [unescape(line) for line in lines if line.strip()]
        if not from_file:
            raise UserError(f"--prompt-file {args.prompt_file} has no prompts (one per line)")
        prompts += from_file
    return prompts or [""]


def encode_prompt(tok, text: str, block_size: int) -> list[int]:
    if not text:
        start = tok.decode([tok.start_id])
        what = "the end-of-text token" if tok.start_id == tok.eot_id else "a newline" if start == "\n" else repr(start)
        print(f"note: empty prompt: starting from {what}", file=sys.stderr)
        return [tok.start_id]
    try:
        ids = tok.encode(text)
    except UserError as e:
        raise UserError(f"prompt {text[:40]!r}: {e}") from None
    if len(ids) > block_size:
        print(f"note: the prompt is {len(ids)} tokens; the model sees only the last {block_size}", file=sys.stderr)
    return ids


def cpu_threads(requested: int, n_embd: int) -> int:
    """Threads for CPU decoding (0: torch's default). A small model's many tiny ops only slow down with more."""
    return requested or (1 if n_embd <= 256 else 0)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog="sample.py", description=__doc__)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--ckpt", "--out-dir", metavar="DIR|FILE", help="run dir or ckpt.pt file (default: out/small)")
    src.add_argument("--config", metavar="NAME|RUN_DIR", help="a config's run dir (small: out/small), or a run dir")
    src.add_argument("--init-from", metavar="NAME|DIR",
                     help="a GPT-2 hub id (gpt2, gpt2-medium, user/repo), a Hugging Face GPT-2 dir or a run dir")
    p.add_argument("--prompt", action="append", metavar="TEXT", help="prompt text (repeatable); - reads stdin")
    p.add_argument("--prompt-file", metavar="FILE", help="a file with one prompt per line")
    p.add_argument("--num-samples", type=integer(lo=1), default=1, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=integer(lo=0), default=500, help="tokens to generate per sample")
    p.add_argument("--temperature", type=number(lo=0), default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=integer(lo=1), help="keep only the k most likely tokens (default: all)")
    p.add_argument("--top-p", type=number(0, 1, lo_open=True),
                   help="keep the smallest set of tokens with this much probability (default: all)")
    p.add_argument("--seed", type=seed, help="same seed, same text (default: random)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end a sample after this text (repeatable)")
    p.add_argument("--batch-size", type=integer(lo=1), default=32, help="most rows decoded at once")
    p.add_argument("--device", default="auto", **argument(Device), help="auto: cuda > mps > cpu")
    p.add_argument("--dtype", default="auto", **argument(Dtype),
                   help="auto: bfloat16 (or float16) on GPUs, float32 on CPU and MPS")
    p.add_argument("--threads", type=integer(lo=0), default=0,
                   help="CPU threads; 0 = 1 for small models (n_embd <= 256), else torch's default")
    p.add_argument("--compile", action=Flag,
                   help="torch.compile the decode step: 3-5x tokens/s for small models, after a one-off compile")
    try:
        return p.parse_args(argv)
    except UserError as e:  # argparse calls --out-dir by its first name, --ckpt: name the one typed
        typed = sys.argv[1:] if argv is None else argv
        out_dir = any(a.partition("=")[0] in ("--out-dir", "--out_dir") for a in typed)
        raise UserError(str(e).replace("--ckpt", "--out-dir") if out_dir else str(e)) from None


def run(args: argparse.Namespace) -> None:
    if "" in args.stop:
        raise UserError("--stop must not be empty")
    if "" in (args.config, args.init_from, args.prompt_file):
        raise UserError("an empty --config, --init-from or --prompt-file names nothing")
    stops = [unescape(s) for s in args.stop]
    prompts = read_prompts(args)
    rt = setup(device=args.device, dtype=args.dtype, seed=None, training=False)
    model, tok = load(args)
    model.to(rt.device, rt.dtype)  # inference only: weights (and the KV cache) in the compute dtype
    if rt.device_type == "cpu":
        set_threads(cpu_threads(args.threads, model.config.n_embd))
    encoded = [encode_prompt(tok, p, model.config.block_size) for p in prompts]
    for stop in stops:  # a character model never writes a character its vocabulary lacks
        try:
            tok.encode(stop)
        except UserError as e:
            raise UserError(f"--stop {stop!r} can never match: {e}") from None
    generator = torch.Generator(device=rt.device)
    generator.manual_seed(args.seed) if args.seed is not None else generator.seed()

    def decode(rows: list[int], **stream: Any) -> list[str]:
        return generate_texts(model, tok, [encoded[j] for j in rows], args.max_new_tokens, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, stops=stops, generator=generator,
                              compile=args.compile, **stream)

    write_samples(args, prompts, decode)


def write_samples(args: argparse.Namespace, prompts: list[str], decode: Callable[..., list[str]]) -> None:
    """Stream one sample to stdout as it decodes; print several a --batch-size batch at a time, each under a header."""
    out = sys.stdout
    # lazy: --num-samples 1e9 streams until Ctrl-C instead of building a billion rows first
    rows = ((j, k) for j in range(len(prompts)) for k in range(args.num_samples))
    if len(prompts) * args.num_samples == 1:
        print(prompts[0], end="", file=out, flush=True)
        text = decode([0], on_text=lambda _, piece: (out.write(piece), out.flush()) if piece else None)[0]
        out.write("" if (prompts[0] + text).endswith("\n") else "\n")
        return
    while chunk := list(itertools.islice(rows, args.batch_size)):
        for (j, k), text in zip(chunk, decode([j for j, _ in chunk])):
            where = f"prompt {j + 1}/{len(prompts)}, " if len(prompts) > 1 else ""
            out.write(f"--- {where}sample {k + 1}/{args.num_samples} ---\n{prompts[j]}{text}")
            out.write("" if (prompts[j] + text).endswith("\n") else "\n")
        out.flush()


@entry_point
def main(argv: list[str] | None = None) -> None:
    run(parse_args(argv))  # `| head`: entry_point ends it quietly when the reader leaves


if __name__ == "__main__":
    sys.exit(main())
