"""Turn text into token files: data/prepared/<name>/{train.bin, val.bin, manifest.json}.

    python -m data.prepare shakespeare_char     # the bundled tinyshakespeare, a token per character
    python -m data.prepare shakespeare          # the same text in GPT-2's BPE tokens
    python -m data.prepare --text book.txt --tokenizer char         # -> data/prepared/book
    python -m data.prepare mycorpus --text corpus/                  # every .txt under corpus/
    python -m data.prepare --files docs.jsonl.gz --text-column body # parquet, jsonl, json, csv, txt
    python -m data.prepare tinystories --hf roneneldan/TinyStories --streaming   # the network's

One text is split by characters, its last tenth for val, as nanoGPT does. Documents (a folder,
--files, --hf; data/sources.py) are encoded one by one, each followed by <|endoftext|> ("\\n\\n" for
char), into a stream that is split by tokens. train.py prepares a preset on first use. A dataset
already prepared from the same bytes is reused; --force prepares it again.
"""

import difflib
import glob
import hashlib
import itertools
import json
import os
from pathlib import Path

import numpy as np
from filelock import FileLock
from tqdm import tqdm

from configs import ArgumentParser, UserError, replacing, run

from .loader import HEADER, MAGIC, VERSION, read_tokens, write_tokens
from .tokenizer import CharTokenizer, GPT2Tokenizer

PRESETS = {"shakespeare_char": "char", "shakespeare": "gpt2"}  # the bundled corpus, by tokenizer
CORPUS = Path(__file__).parent / "corpora" / "tinyshakespeare" / "input.txt"
DATASET_FILES = {"train.bin", "val.bin", "manifest.json"}


def utf8(data: bytes, path) -> str:
    """A corpus file's text, refused unless it is UTF-8 (a byte-order mark is dropped)."""
    try:
        text = data.decode("utf-8-sig")
        if "\x00" not in text:  # NUL bytes between ASCII letters: UTF-16 or UTF-32 without a BOM
            return text
    except UnicodeDecodeError:
        pass
    wide = data[:2] in (b"\xff\xfe", b"\xfe\xff") or b"\x00" in data[:4096]
    likely = "UTF-16 or UTF-32" if wide else "Latin-1 or Windows-1252"
    raise UserError(f"{path} is not UTF-8 (likely {likely}); save it as UTF-8")


def sha256(paths) -> str:
    """The sha256 of the files' bytes, one after the other."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
    return h.hexdigest()


def write_text(path, tokenizer: str, folder: Path, val_fraction: float):
    """One text file into folder/train.bin and val.bin, split by characters as nanoGPT splits it.
    Returns (the tokenizer, a char one of the text's characters; the token counts)."""
    text = utf8(Path(path).read_bytes(), path)
    tok = CharTokenizer("".join(sorted(set(text)))) if tokenizer == "char" else GPT2Tokenizer()
    cut = int(len(text) * (1 - val_fraction))
    counts = {}
    for split, part in ("train", text[:cut]), ("val", text[cut:]):
        counts[split] = write_tokens(
            folder / f"{split}.bin", [tok.encode_array(part)], tok.vocab_size
        )
    return tok, counts


def write_documents(read, tokenizer: str, folder: Path, val_fraction: float, quiet: bool):
    """The documents that read() yields, each followed by the separator, encoded into one stream,
    split by tokens into folder/train.bin and val.bin. Returns (the tokenizer, the token counts,
    the documents' sha256)."""
    if tokenizer == "char":  # its vocabulary is every character: a first pass finds them
        chars = set("\n")
        for doc in tqdm(read(), desc="characters", unit="doc", disable=quiet):
            chars.update(doc)
        tok = CharTokenizer("".join(sorted(chars)))
    else:
        tok = GPT2Tokenizer()
    separator = tok.encode_array("\n\n") if tok.eot_id is None else [tok.eot_id]
    hasher = hashlib.sha256()

    def encoded():
        todo = iter(tqdm(read(), desc="tokenizing", unit="doc", disable=quiet))
        while batch := list(itertools.islice(todo, 1024)):
            hasher.update("\x1e".join(batch).encode("utf-8", "surrogatepass") + b"\x1e")
            if tok.eot_id is None:
                ids = [tok.encode_array(doc) for doc in batch]
            else:  # tiktoken's threads
                ids = tok.enc.encode_ordinary_batch(batch, num_threads=os.cpu_count() or 1)
            yield np.concatenate([part for doc in ids for part in (doc, separator)])

    stream = folder / "train.bin"
    count = write_tokens(stream, encoded(), tok.vocab_size)
    cut = int(count * (1 - val_fraction))
    tokens = read_tokens(stream)
    tail = (tokens[i : i + 2**24] for i in range(cut, count, 2**24))
    val = write_tokens(folder / "val.bin", tail, tok.vocab_size)
    itemsize = tokens.itemsize
    del tokens, tail  # the memory map, before the file under it shrinks
    with open(stream, "r+b") as f:  # train.bin keeps the stream's first `cut` tokens: no copy
        f.write(HEADER.pack(MAGIC, VERSION, itemsize, cut))
        f.truncate(HEADER.size + cut * itemsize)
    return tok, {"train": cut, "val": val}, hasher.hexdigest()


def prepare(
    name=None,
    *,
    text=None,
    files=None,
    hf=None,
    tokenizer=None,
    root="data/prepared",
    val_fraction=0.1,
    force=False,
    quiet=False,
    **options,
) -> Path:
    """Prepare dataset `name`: a preset, or the name for a source (--text, --files, --hf; options
    are data/sources.py's). Returns its folder."""
    if not (name or text or files or hf) or name in PRESETS and (text or files or hf):
        raise UserError(
            f"name a preset ({', '.join(PRESETS)}), or give --text, --files or --hf "
            "and a name that is not a preset's"
        )
    if not 0 < val_fraction < 1:
        raise UserError(f"--val-fraction {val_fraction}: give a share between 0 and 1")
    one_text = text if text and Path(text).is_file() else CORPUS if name in PRESETS else None
    tokenizer = tokenizer or PRESETS.get(name, "gpt2")
    given = one_text or text or (files or [hf])[0]  # the source: a file, folder or dataset
    name = name or Path(given).name.split(".")[0]
    if not name or name.startswith(".") or "/" in name:
        raise UserError(f"{name!r} cannot name a dataset's folder; give a name such as mycorpus")
    out = Path(root) / name

    # the source: a text, a folder of text files, or (data/sources.py) data files or a dataset;
    # the sha256 of a local one's bytes tells whether the dataset already holds it
    if one_text:
        source, hashed = {"text": str(one_text)}, sha256([one_text])
    elif text:
        # glob follows a symlinked folder, where Path.rglob (before Python 3.13) skips it
        found = glob.glob(os.path.join(glob.escape(text), "**", "*.txt"), recursive=True)
        paths = sorted({p.resolve() for p in map(Path, found) if p.is_file()})  # a loop: once
        if not paths:
            why = "holds no .txt file" if Path(text).exists() else "no such file or folder"
            raise UserError(f"--text {text}: {why}; give a text file or a folder of them")
        read = lambda: (utf8(p.read_bytes(), p) for p in paths)
        source, hashed = {"folder": str(text)}, sha256(paths)
    else:
        from .sources import documents

        read, source = documents(files, hf, **options)
        hashed = sha256(files) if files else None  # a hub dataset's is known once it is read
    want = dict(version=VERSION, tokenizer=tokenizer, val_fraction=val_fraction, source=source)
    if hashed:
        want["sha256"] = hashed
    if out.is_file() or out.is_dir() and set(os.listdir(out)) - DATASET_FILES:
        raise UserError(f"{out} is not a dataset's folder; give another name, or another folder")
    saved = out / "manifest.json"  # up to date: its settings hold the wanted ones
    current = lambda: saved.is_file() and not force and want.items() <= read_manifest(out).items()
    if current():
        if not quiet:
            print(f"{name}: up to date in {out}")
        return out
    # Another source or tokenizer under the same name is not taken for an edit of the same text:
    # the runs trained on the dataset could not resume.
    old = read_manifest(out) if saved.is_file() and name not in PRESETS and not force else want
    if (old["source"], old["tokenizer"]) != (source, tokenizer):
        raise UserError(
            f"{out} holds dataset {name} of other text or another tokenizer; give --force to "
            "replace it (its runs can then not resume), or another name"
        )

    # the token files, built in a folder beside the dataset's and then swapped in whole: a prepare
    # that fails or is killed leaves the dataset as it was. One prepare at a time: another waits
    # for it, then finds the dataset prepared (under torchrun, nodes that share a folder).
    try:  # a file in the way is one line
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(
            f"cannot make {out.parent}: {e.strerror}; give another --out-root"
        ) from None
    with FileLock(out.with_name(f".{name}.lock")):  # it dies with its process
        if current():
            return out
        with replacing(out) as tmp:
            tmp.mkdir()
            if one_text:
                tok, counts = write_text(one_text, tokenizer, tmp, val_fraction)
            else:
                tok, counts, docs_hash = write_documents(read, tokenizer, tmp, val_fraction, quiet)
                hashed = hashed or docs_hash
            if not (counts["train"] and counts["val"]):
                raise UserError(f"{given}: too little text for a train and a val split; give more")
            chars = getattr(tok, "chars", None)
            manifest = want | dict(name=name, vocab_size=tok.vocab_size, sha256=hashed, chars=chars)
            manifest |= {f"{split}_tokens": n for split, n in counts.items()}  # train, val
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False))
    if not quiet:
        print(
            f"{name}: {tok.name} tokenizer, {tok.vocab_size:,} tokens in its vocabulary; "
            f"{counts['train']:,} train and {counts['val']:,} val tokens in {out}"
        )
    return out


def read_manifest(folder) -> dict:
    """A prepared dataset's manifest.json, or one line saying that it is damaged."""
    path = Path(folder, "manifest.json")
    try:
        manifest = json.loads(path.read_text())
        if not isinstance(manifest, dict) or {"tokenizer", "vocab_size", "chars"} - manifest.keys():
            raise ValueError("not a dataset's manifest")
    except (OSError, ValueError) as e:  # unreadable, or not UTF-8
        raise UserError(
            f"{path} is damaged ({e}); prepare {path.parent.name} again, with --force"
        ) from None
    return manifest


def dataset_dir(name: str, root: str, quiet: bool = False) -> Path:
    """Where dataset `name` is: a preset is prepared on first use, any other must be already."""
    prepared = Path(root, name, "manifest.json").is_file()
    if name in PRESETS:  # a run says nothing of a dataset prepared before
        return prepare(name, root=root, quiet=quiet or prepared)
    if not prepared:
        how = f"python -m data.prepare {name} --text FILE (or --files, --hf)"
        near = difflib.get_close_matches(name, PRESETS, 1)
        hint = f"did you mean {near[0]}? " if near else ""
        raise UserError(
            f"no dataset {name!r} in {root}; {hint}prepare it ({how}), give the --data-root "
            f"that holds it, or use a preset: {', '.join(PRESETS)}"
        )
    return Path(root, name)


def main(argv=None) -> None:
    p = ArgumentParser(
        prog="python -m data.prepare",
        description=__doc__,
    )
    p.add_argument("name", nargs="?", help=f"a preset ({', '.join(PRESETS)}), or a source's name")
    p.add_argument("--text", help="a UTF-8 text file, or a folder of .txt files (a document each)")
    p.add_argument(
        "--files", nargs="+", help=".txt, .parquet, .jsonl, .json or .csv, maybe compressed"
    )
    p.add_argument("--hf", help="a dataset folder, or a Hugging Face hub dataset's name")
    p.add_argument("--subset", help="the dataset's configuration (--hf)")
    p.add_argument("--split", default="train", help="the split to read (--hf)")
    p.add_argument("--text-column", default="text", help="the column holding the text")
    p.add_argument("--streaming", action="store_true", help="read a hub dataset as it downloads")
    p.add_argument("--tokenizer", choices=("char", "gpt2"), help="default: the preset's, else gpt2")
    p.add_argument("--val-fraction", type=float, default=0.1, help="the share held out for val")
    p.add_argument(
        "--out-root",
        dest="root",
        metavar="OUT_ROOT",
        default="data/prepared",
        help="where <name>/ is written",
    )
    p.add_argument("--force", action="store_true", help="prepare it again, even if up to date")
    p.add_argument("--quiet", action="store_true", help="no progress bars or summary")
    args = p.parse_args(argv)
    if not (args.files or args.hf) and args.text_column != "text":
        raise UserError("--text-column is for --files and --hf; drop it")
    if not args.hf and (args.subset or args.split != "train" or args.streaming):
        raise UserError("--subset, --split and --streaming are for --hf; drop them")
    prepare(**vars(args))


if __name__ == "__main__":
    run(main)
