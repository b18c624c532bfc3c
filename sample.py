r"""Sample text from a trained GPT, streamed to the terminal as it is decoded.

    python sample.py --prompt "ROMEO:"                  # out/small's best.pt (train it first)
    python sample.py --prompt "ROMEO:" --temperature 0  # the likeliest token at each step
    python sample.py --prompt "ROMEO:" --num-samples 3 --seed 7 --top-k 20 --top-p 0.9
    python sample.py --prompt "ROMEO:" --stop "\n\n"    # each sample ends at its first blank line
    python sample.py --prompt "ROMEO:" --prompt "JULIET:"   # one prompt after the other
    echo "To be, or not" | python sample.py --prompt -  # the prompt from stdin, as it is
    python sample.py --out-dir out/shakespeare_gpu --prompt "KING:"   # another run's, or a .pt file
    python sample.py --init-from gpt2 --prompt "Hello, I'm a language model,"   # GPT-2's weights
    python sample.py --prompt "ROMEO:" --compile        # compiled decoding: faster for small models

"\n", "\t" and "\\" in a prompt or --stop are a newline, a tab and a backslash. An empty prompt
starts from end-of-text (a newline for a character model). One sample streams as it is decoded;
several print one after another, each under a header. A sample ends at end-of-text or just after
its first --stop string. The same --seed and --num-samples give the same samples.
"""

import codecs
import os
import re
import sys

import torch

from configs import ArgumentParser, UserError, device_and_dtype, run
from data.tokenizer import tokenizer
from model.checkpoint import load_checkpoint, model_from
from model.gpt import generate


def unescape(text: str) -> str:
    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m[1]], text)


class TextStream:
    """One sample's tokens in, its text out, in whole UTF-8 characters (a BPE token can hold part of
    one); `done` at end-of-text or after the first stop string, where the text is cut."""

    def __init__(self, tok, stops):
        self.tok, self.stops, self.text, self.done = tok, stops, "", False
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int | None) -> str:
        """Add a token (None: the end) and return the text it completes."""
        if self.done:
            return ""
        end = token is None or token == self.tok.eot_id
        old = len(self.text)
        self.text += self.decoder.decode(b"" if end else self.tok.decode_bytes([token]), final=end)
        self.done = end
        for stop in self.stops:  # only a match that ends in the new text is new
            if (i := self.text.find(stop, max(0, old - len(stop) + 1))) >= 0:
                self.text, self.done = self.text[: i + len(stop)], True
        return self.text[old:]


def main(argv=None) -> None:
    p = ArgumentParser(prog="sample.py", description=__doc__)
    weights = p.add_mutually_exclusive_group()
    weights.add_argument("--out-dir", default="out/small", help="a run folder, or a .pt file")
    weights.add_argument("--init-from", help="a GPT-2 hub id (gpt2), a Hugging Face or run folder")
    p.add_argument("--prompt", action="append", help="the text to go on from; - reads stdin")
    p.add_argument("--num-samples", type=int, default=1, help="samples a prompt, decoded together")
    p.add_argument("--max-new-tokens", type=int, default=500, help="the most tokens a sample gets")
    p.add_argument("--temperature", type=float, default=0.8, help="below 1: surer; 0: greedy")
    p.add_argument("--top-k", type=int, help="draw among the k likeliest tokens only")
    p.add_argument(
        "--top-p", type=float, default=1.0, help="draw among the likeliest, summing to p"
    )
    p.add_argument(
        "--seed", type=int, help="with the same --num-samples, the same samples (default: random)"
    )
    p.add_argument("--stop", action="append", default=[], help="end a sample just after this text")
    p.add_argument("--device", choices=("auto", "cpu", "cuda", "mps"), default="auto")
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="auto: bfloat16 where the hardware has it (on a CPU, for n_embd over 256), float16 on "
        "older GPUs, else float32",
    )
    p.add_argument("--compile", action="store_true", help="compiled decoding (model/compiled.py)")
    args = p.parse_args(argv)
    # --top-k 0 is out of bounds; only None leaves top-k off
    top_k = 1 if args.top_k is None else args.top_k
    if min(args.num_samples, top_k) < 1 or args.max_new_tokens < 0 or not args.temperature >= 0:
        raise UserError(
            "--num-samples, --top-k: at least 1; --max-new-tokens, --temperature: at least 0"
        )
    if not 0 < args.top_p <= 1 or "" in args.stop:
        raise UserError("--top-p: above 0, at most 1; --stop: some text")

    # the model and its tokenizer, in the compute dtype, on the device
    if args.init_from:
        from model.hf import load_weights  # GPT-2's too, from Hugging Face

        model, manifest = load_weights(args.init_from)
    else:
        checkpoint = load_checkpoint(args.out_dir)
        model, manifest = model_from(checkpoint), checkpoint["manifest"]
    tok = tokenizer(manifest, model.config.vocab_size)
    if not all(p.isfinite().all() for p in model.parameters()):
        raise UserError(
            f"{args.init_from or args.out_dir}: its weights hold nan or inf; sample an earlier "
            "checkpoint of the run"
        )
    device, dtype = device_and_dtype(args.device, args.dtype)
    if device == "cpu" and model.config.n_embd <= 256:
        # A small model's time goes to its many tiny ops, which more threads and bfloat16's
        # conversions only slow; a large one's to reading its weights, which bfloat16 halves.
        dtype = torch.float32 if args.dtype == "auto" else dtype
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(1)
    model.to(device, dtype).eval()
    if args.compile:
        from model.compiled import compiled

        model = compiled(model)
    generator = torch.Generator(device)
    generator.manual_seed(args.seed) if args.seed is not None else generator.seed()

    # each prompt's samples, decoded as a batch: one streams, several print under a header each
    if "-" in (args.prompt or []) and sys.stdin is None:
        raise UserError("--prompt - reads stdin, which is closed; give the prompt as text")
    prompts = [sys.stdin.read() if p == "-" else unescape(p) for p in args.prompt or [""]]
    stops = [unescape(s) for s in args.stop]
    alone = len(prompts) * args.num_samples == 1
    for number, prompt in enumerate(prompts, 1):
        try:
            ids = tok.encode(prompt) if prompt else [tok.start_id]
        except UserError as e:
            raise UserError(f"prompt {prompt[:40]!r}: {e}") from None
        streams = [TextStream(tok, stops) for _ in range(args.num_samples)]
        if alone:
            print(prompt, end="", flush=True)
        idx = torch.tensor([ids] * args.num_samples, device=device)
        sampling = args.temperature, args.top_k, args.top_p, generator, tok.vocab_size
        for tokens in generate(model, idx, args.max_new_tokens, *sampling):
            pieces = [stream.push(t) for stream, t in zip(streams, tokens.tolist())]  # a host sync
            if alone:
                print(pieces[0], end="", flush=True)
            if all(stream.done for stream in streams):
                break
        for k, stream in enumerate(streams, 1):
            rest = stream.push(None)
            if not alone:
                print(f"--- prompt {number}/{len(prompts)}, sample {k}/{args.num_samples} ---")
            text = rest if alone else prompt + stream.text
            print(text, end="" if (prompt + stream.text).endswith("\n") else "\n", flush=True)


if __name__ == "__main__":
    run(main)
