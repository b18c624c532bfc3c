"""Turn text into token files: data/prepared/<name>/{train.bin, val.bin, manifest.json}.

    python -m data.prepare shakespeare_char        # bundled tinyshakespeare, char-level (no network)
    python -m data.prepare shakespeare             # bundled tinyshakespeare, GPT-2 BPE (no network)
    python -m data.prepare --text book.txt --tokenizer char          # -> data/prepared/book_char
    python -m data.prepare --text corpus_dir/ --name mycorpus        # every .txt under the folder
    python -m data.prepare --files a.parquet b.parquet --text-column content --num-proc 2
    python -m data.prepare --files docs.jsonl.gz --val-fraction 0.05  # .gz/.bz2/.xz/.zst, .txt, .csv too
    python -m data.prepare --hf path/to/dataset_dir --split validation  # data files or save_to_disk
    python -m data.prepare --hf roneneldan/TinyStories --revision main --streaming   # needs network

A single text (a preset, --text FILE) is split by characters, as nanoGPT does. Folders, --files and
--hf are encoded document by document (each followed by <|endoftext|>, or "\\n\\n" for char) into one
stream split by tokens, since a streamed source's size is known only at its end. A re-run whose
manifest matches reuses the files; --force rebuilds them.
"""

from configs.errors import start_script

start_script(__name__)  # first, so that Ctrl-C during the imports below (numpy, tiktoken) is one line

import contextlib
import errno
import fcntl
import hashlib
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np
from tqdm import tqdm

from configs.cli import ArgumentParser, Choice, Flag, integer, number
from configs.errors import UserError, entry_point

from .files import is_dataset, swap_dir, write_errors, write_json
from .manifest import read_dataset_manifest
from .sources import Source, dataset_source, files_source, text_source
from .tokenfile import VERSION, dtype_for_vocab, read_tokens, truncate_tokens, write_tokens
from .tokenizer import TOKENIZERS, GPT2Tokenizer, Tokenizer, get_tokenizer

DEFAULT_ROOT = Path("data/prepared")
CORPORA = Path(__file__).resolve().parent / "corpora"
_SHAKESPEARE = CORPORA / "tinyshakespeare" / "input.txt"
PRESETS = {"shakespeare_char": "char", "shakespeare": "gpt2"}  # each preset's tokenizer for the bundled text
CHAR_DOC_SEPARATOR = "\n\n"
_BATCH_DOCS, _BATCH_CHARS = 1024, 4 << 20  # documents encoded at a time, bounded by their total size
_COPY_CHUNK = 1 << 24  # tokens copied at a time from the stream into val.bin
_CHUNK_CHARS = 4 << 20  # a single text is encoded in pieces of about this size, to bound memory
_SAFE_CUT = re.compile(r"(?<=\S\n)(?=\S)")


def _resolve(name: str | None, text: Any, files: Any, hf: str | None, subset: str | None, split: str,
             revision: str | None, text_column: str, streaming: bool, tokenizer: str | None) -> tuple[Source, str, str]:
    """The source, tokenizer and output name that prepare()'s arguments ask for; options it would ignore are refused."""
    if len(given := [flag for flag, v in (("--text", text), ("--files", files), ("--hf", hf)) if v]) > 1:
        raise UserError(f"give one source, not {' and '.join(given)}")
    hub = [f for f, v in (("--subset", subset), ("--split", split != "train"), ("--revision", revision),
                          ("--streaming", streaming)) if v]
    if hub and not hf:
        raise UserError(f"{', '.join(hub)}: for --hf datasets only; drop {'them' if len(hub) > 1 else 'it'}")
    if text_column != "text" and not (hf or files):
        raise UserError("--text-column: for --hf datasets and --files with columns (parquet, jsonl, json, csv); "
                        "drop it")
    if not given:  # a preset: the bundled text, under the preset's tokenizer
        if name is None:
            raise UserError(f"name a preset ({', '.join(PRESETS)}) or give --text, --files or --hf")
        if name not in PRESETS:
            raise UserError(f"unknown dataset preset {name!r}; presets: {', '.join(PRESETS)} "
                            "(or prepare your own text with --text/--files/--hf)")
        if tokenizer not in (None, PRESETS[name]):
            raise UserError(f"preset {name!r} uses tokenizer {PRESETS[name]!r}; for another "
                            f"tokenizer use --text {_SHAKESPEARE} --tokenizer {tokenizer}")
        source = text_source(_SHAKESPEARE)  # recorded relative to the repository: a moved checkout is no new source
        source.description["path"] = str(_SHAKESPEARE.relative_to(CORPORA.parent.parent))
        return source, PRESETS[name], name
    tokenizer = tokenizer or "gpt2"
    if tokenizer not in TOKENIZERS:
        raise UserError(f"unknown tokenizer {tokenizer!r}; choose one of: {', '.join(TOKENIZERS)}")
    source = (text_source(text) if text else files_source(files, text_column) if files
              else dataset_source(hf, subset, split, text_column, streaming, revision))  # type: ignore[arg-type]
    name = name or (source.stem + ("_char" if tokenizer == "char" else ""))
    if name in PRESETS:  # a run asking for the preset would rebuild it from the bundled text over this one
        raise UserError(f"{name!r} is a preset's name; pass another --name for this text")
    return source, tokenizer, name


def _reusable(out_dir: Path, source: Source, tokenizer: str, val_fraction: float) -> dict[str, Any] | None:
    """The manifest of an existing dataset made from this source the same way, else None. A hub dataset has no
    hash before it is read, so there its description stands for its content."""
    want = {"version": VERSION, "tokenizer": tokenizer, "val_fraction": val_fraction,
            "split_by": "characters" if source.single else "tokens",
            **({"sha256": source.sha256} if source.sha256 is not None else {"source": source.description})}
    try:
        manifest = read_dataset_manifest(out_dir)
    except UserError:  # missing, damaged or inconsistent: rebuild
        return None
    return manifest if all(manifest.get(k) == v for k, v in want.items()) else None


def _encode(tok: Tokenizer, docs: list[str], separate: bool, threads: int) -> np.ndarray:
    """Encode texts in the file dtype, each followed by the document separator if ``separate``. tiktoken encodes
    GPT-2's on `threads` threads; the char tokenizer's numpy search is fast enough on one."""
    parts = ([np.array(ids, np.int64) for ids in tok.enc.encode_ordinary_batch(docs, num_threads=threads)]
             if isinstance(tok, GPT2Tokenizer) else [tok.encode_array(doc) for doc in docs])
    if separate:
        sep = np.asarray([tok.eot_id] if tok.eot_id is not None else tok.encode(CHAR_DOC_SEPARATOR))
        parts = [p for doc in parts for p in (doc, sep)]
    return np.concatenate(parts).astype(dtype_for_vocab(tok.vocab_size))


def _pieces(text: str, bar: Any) -> Iterator[str]:
    """The text in pieces of about _CHUNK_CHARS characters, each cut after a lone newline before a non-space,
    where GPT-2's pre-tokenizer ends a piece anyway: the pieces encode to exactly the whole text's tokens."""
    pos = 0
    while pos < len(text):
        cut = _SAFE_CUT.search(text, min(pos + _CHUNK_CHARS, len(text)))
        end = cut.start() if cut else len(text)
        bar.update(end - pos)
        yield text[pos:end]
        pos = end


def _batches(texts: Iterable[str], count: int, chars: float = math.inf) -> Iterator[list[str]]:
    """The texts in lists of `count`, or fewer where they reach `chars` characters first."""
    batch: list[str] = []
    size = 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if len(batch) >= count or size >= chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _split_point(n: int, val_fraction: float) -> int:
    """Where val starts in n characters or tokens: its last val_fraction, with neither part empty."""
    cut = int(n * (1 - val_fraction))
    if cut == 0 or cut == n:
        raise UserError(f"--val-fraction {val_fraction} of {n} tokens leaves {'val' if cut == n else 'train'} empty; "
                        "give more text or a --val-fraction nearer 0.1")
    return cut


def _prepare_single_text(source: Source, tok_name: str, out_dir: Path, val_fraction: float,
                         num_proc: int, verbose: bool) -> tuple[Tokenizer, dict[str, int], str | None]:
    corpus = "".join(source.documents())
    if not corpus.strip():
        raise UserError(f"{source.label} is empty; give a file with text")
    tok = get_tokenizer(tok_name, text=corpus)
    cut = _split_point(len(corpus), val_fraction)
    counts = {}
    with tqdm(total=len(corpus), unit="char", unit_scale=True, desc=f"{out_dir.name}: tokenizing",
              disable=not verbose or len(corpus) < 4 * _CHUNK_CHARS) as bar:
        for split, part in (("train", corpus[:cut]), ("val", corpus[cut:])):
            encoded = (_encode(tok, batch, False, num_proc) for batch in _batches(_pieces(part, bar), num_proc))
            counts[split] = write_tokens(out_dir / f"{split}.bin", encoded, tok.vocab_size)
    return tok, counts, source.sha256


def _prepare_documents(source: Source, tok_name: str, out_dir: Path, val_fraction: float,
                       num_proc: int, verbose: bool) -> tuple[Tokenizer, dict[str, int], str | None]:
    """Encode the documents into one stream, then split it by tokens. The tail is copied to val.bin and the
    stream, cut short, becomes train.bin, so disk use peaks at 1 + val_fraction times the tokens, not 2."""
    opts: dict[str, Any] = {"total": source.total, "unit": "doc", "disable": not verbose}
    if tok_name == "char":  # its vocabulary takes a first pass (streamed from the hub, a second download)
        chars = set(CHAR_DOC_SEPARATOR)
        for doc in tqdm(source.documents(), desc=f"{out_dir.name}: char vocabulary", **opts):
            chars.update(doc)
    tok = get_tokenizer(tok_name, chars=sorted(chars) if tok_name == "char" else None)
    hasher, stream = hashlib.sha256(), out_dir / "stream.tmp"

    def encoded(docs: list[str]) -> np.ndarray:
        hasher.update(("\x1e".join(docs) + "\x1e").encode("utf-8", "surrogatepass"))  # as if document by document
        return _encode(tok, docs, True, num_proc)

    # documents() is called before the bar opens, so that a hub that cannot be reached is one line of error
    with tqdm(source.documents(), desc=f"{out_dir.name}: tokenizing", **opts) as documents:
        batches = _batches(filter(str.strip, documents), _BATCH_DOCS, _BATCH_CHARS)  # empty ones add only separators
        write_tokens(stream, map(encoded, batches), tok.vocab_size)
    tokens = read_tokens(stream)
    if len(tokens) == 0:
        raise UserError(f"{source.label} has no text; give a non-empty corpus")
    cut = _split_point(len(tokens), val_fraction)
    val_chunks = (tokens[i : i + _COPY_CHUNK] for i in range(cut, len(tokens), _COPY_CHUNK))
    counts = {"val": write_tokens(out_dir / "val.bin", val_chunks, tok.vocab_size), "train": cut}
    del tokens, val_chunks  # release the memmap before truncating the file under it
    truncate_tokens(stream, cut)
    os.replace(stream, out_dir / "train.bin")
    return tok, counts, source.sha256 or hasher.hexdigest()


def hold_dataset(ds_dir: str | os.PathLike, *, rebuild: bool = False) -> IO[str]:
    """Keep dataset ds_dir as it is until the returned file is closed or the process ends. Holders (runs, DDP
    ranks) share it, and a prepare meanwhile fails with one line; rebuild=True, a prepare's own, excludes all."""
    ds_dir = Path(ds_dir)
    path = ds_dir.parent / f".{ds_dir.name}.lock"  # beside the folder, since a lock inside would be swapped out
    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            lock = open(path, "a+")
        except OSError as e:
            if not rebuild:
                return open(os.devnull)  # no one can write the folder, so no prepare can change it either
            if e.errno == errno.ENAMETOOLONG:  # the lock's name is the dataset's and 6 characters more
                raise UserError(f"the dataset name {ds_dir.name[:20]}... is too long for this file system; "
                                "give a shorter --name") from None
            why = ": a file, not a folder;" if path.parent.is_file() else f" ({e.strerror});"
            raise UserError(f"cannot write {path.parent}{why} use a folder that can be written for the "
                            "prepared data") from None
        try:
            fcntl.flock(lock, (fcntl.LOCK_EX if rebuild else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            try:  # shared holders (runs) let a shared lock in, and a prepare lets none in
                fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
                why = "is in use by a run; wait for it to finish, or prepare it under another name"
            except BlockingIOError:
                why = f"is being prepared by another process (pid {path.read_text().strip() or '?'}); wait for it"
            lock.close()
            raise UserError(f"dataset {ds_dir.name} {why}") from None
        if path.exists() and path.stat().st_ino == os.fstat(lock.fileno()).st_ino:  # else a prepare deleted it
            break
        lock.close()
    if rebuild:
        lock.truncate(0)
        print(os.getpid(), file=lock, flush=True)
    return lock


@contextlib.contextmanager
def _rebuilding(out_dir: Path) -> Iterator[Path]:
    """An empty folder to build dataset out_dir in, swapped in whole (files.swap_dir) when the block completes."""
    lock = hold_dataset(out_dir, rebuild=True)
    work = out_dir.parent / f".{out_dir.name}.tmp" / out_dir.name
    try:
        shutil.rmtree(work.parent, ignore_errors=True)  # a killed prepare's, since the lock rules out a live one
        work.mkdir(parents=True)
        yield work
        swap_dir(work, out_dir)
    finally:
        shutil.rmtree(work.parent, ignore_errors=True)  # ours: unfinished, or the old dataset after the swap
        Path(lock.name).unlink(missing_ok=True)  # see hold_dataset
        lock.close()


def dataset_dir(name: str, root: str | os.PathLike = DEFAULT_ROOT, verbose: bool = True) -> Path:
    """Where dataset `name` is. A preset is prepared on first use (a no-op later); others must be prepared already."""
    if name in PRESETS:
        return prepare(name, out_root=root, verbose=verbose)
    path = Path(root) / name
    if is_dataset(path):
        return path
    if (path / "manifest.json").is_file():
        raise UserError(f"{path} has no train.bin: a run's or an exported model's folder, not a prepared dataset; "
                        "give --dataset a dataset's name")
    root = "" if Path(root) == DEFAULT_ROOT else f" --out-root {root}"
    raise UserError(f"dataset {name!r} is neither a preset ({', '.join(PRESETS)}) nor prepared in {path}; prepare "
                    "it first: python -m data.prepare --text PATH (or --files FILE ..., --hf DATASET) "
                    f"--name {name}{root}")


def prepare(name: str | None = None, *, text: str | os.PathLike | None = None,
            files: Sequence[str | os.PathLike] | None = None, hf: str | None = None,
            subset: str | None = None, split: str = "train", revision: str | None = None,
            text_column: str = "text", streaming: bool = False, tokenizer: str | None = None,
            val_fraction: float = 0.1, out_root: str | os.PathLike = DEFAULT_ROOT,
            num_proc: int | None = None, force: bool = False, verbose: bool = True) -> Path:
    """Prepare dataset ``name`` (a preset, or the output name for a --text/--files/--hf source); returns its folder."""
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"--val-fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    if num_proc and num_proc > (cores := os.cpu_count() or 1):  # more threads than cores would only contend
        raise UserError(f"--num-proc {num_proc}: this machine has {cores} cores; use at most {cores}")
    source, tok_name, name = _resolve(name, text, files, hf, subset, split, revision, text_column, streaming, tokenizer)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise UserError(f"dataset name {name!r} must start with a letter or digit, then letters, digits, '.', '_' "
                        "or '-' (it names a folder); pass another --name")
    out_dir = Path(out_root) / name
    if not force and (manifest := _reusable(out_dir, source, tok_name, val_fraction)) is not None:
        if verbose:
            print(f"{name}: up to date ({manifest['train_tokens']:,} train / {manifest['val_tokens']:,} val tokens) "
                  f"in {out_dir}", flush=True)
        return out_dir

    t0 = time.perf_counter()
    num_proc = num_proc or min(8, os.cpu_count() or 1)
    with write_errors(out_dir), _rebuilding(out_dir) as work:  # its lock, build folder and swap
        # The swap replaces out_dir whole, so only what an earlier prepare wrote may be there, not a run or a model.
        held = sorted(os.listdir(out_dir)) if out_dir.is_dir() else ["a file"] if out_dir.exists() else []
        if held and ("manifest.json" not in held or set(held) - {"manifest.json", "train.bin", "val.bin"}):
            raise UserError(f"{out_dir} is not a prepared dataset ({', '.join(held[:3])}{', ...' * (len(held) > 3)}); "
                            "pass another --name or --out-root, or delete it")
        tok, counts, sha256 = (_prepare_single_text if source.single else _prepare_documents)(
            source, tok_name, work, val_fraction, num_proc, verbose)
        manifest = _manifest(name, tok, counts, source, sha256, val_fraction)
        write_json(work / "manifest.json", manifest, ensure_ascii=False)  # chars as they read
    if verbose:
        print(f"{name}: {tok.name} tokenizer, vocab {tok.vocab_size:,}; train {counts['train']:,} tokens, val "
              f"{counts['val']:,} tokens ({manifest['dtype']}) in {time.perf_counter() - t0:.2f}s -> {out_dir}",
              flush=True)
    return out_dir


def _manifest(name: str, tok: Tokenizer, counts: dict[str, int], source: Source, sha256: str | None,
              val_fraction: float) -> dict[str, Any]:
    """What a dataset's manifest.json records: the tokenizer and its vocabulary, the counts and the source."""
    separator = None if source.single else "<|endoftext|>" if tok.eot_id is not None else CHAR_DOC_SEPARATOR
    return {"version": VERSION, "name": name, "tokenizer": tok.name, "vocab_size": tok.vocab_size,
            **({"chars": "".join(tok.chars)} if tok.name == "char" else {}), "eot_id": tok.eot_id,
            "train_tokens": counts["train"], "val_tokens": counts["val"], "dtype": dtype_for_vocab(tok.vocab_size).name,
            "source": source.description, "sha256": sha256, "val_fraction": val_fraction,
            "split_by": "characters" if source.single else "tokens", "doc_separator": separator}


@entry_point
def main(argv: Sequence[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m data.prepare", description=__doc__.split("\n\n")[0],
                       usage="python -m data.prepare [NAME] [--text PATH | --files FILE ... | --hf DATASET] [options]",
                       epilog="examples:\n" + __doc__.split("\n\n")[1])
    p.add_argument("name", nargs="?", help=f"a preset ({', '.join(PRESETS)}) or the output name for a source")
    src = p.add_argument_group("sources (instead of a preset)")
    src.add_argument("--text", metavar="PATH", help="a UTF-8 text file, or a folder of .txt files (one document each)")
    src.add_argument("--files", nargs="+", metavar="FILE",
                     help="local .txt/.parquet/.jsonl/.json/.csv files, maybe .gz/.bz2/.xz/.zst")
    src.add_argument("--hf", metavar="DATASET",
                     help="a dataset directory, or a Hugging Face hub dataset (network unless cached)")
    src.add_argument("--subset", help="dataset configuration")
    src.add_argument("--split", default="train", help="dataset split to read")
    src.add_argument("--revision", help="hub dataset branch, tag or commit (default: main)")
    src.add_argument("--text-column", default="text", help="column holding the text")
    src.add_argument("--streaming", action=Flag, help="stream the hub dataset (no full download)")
    p.add_argument("--tokenizer", type=Choice(TOKENIZERS), choices=TOKENIZERS, help="default: the preset's, else gpt2")
    p.add_argument("--val-fraction", type=number(0, 1, lo_open=True, hi_open=True), default=0.1,
                   help="share held out for val")
    p.add_argument("--out-root", default=str(DEFAULT_ROOT), help="where <name>/ is written")
    p.add_argument("--name", dest="out_name", metavar="NAME", help="output folder name (default: from the source)")
    p.add_argument("--num-proc", type=integer(lo=1), help="tokenizer threads (default: cores, max 8)")
    p.add_argument("--force", action=Flag, help="rebuild even if the outputs are up to date")
    p.add_argument("--quiet", action=Flag, help="no progress output")
    kw = vars(p.parse_args(argv))  # the other options are prepare()'s keyword arguments
    name, out_name, quiet = kw.pop("name"), kw.pop("out_name"), kw.pop("quiet")
    if empty := [f for f, v in (("NAME", name), ("--name", out_name), ("--out-root", kw["out_root"])) if v == ""]:
        p.error(f"{empty[0]} is empty; give a folder name, or leave it out for the default")
    if out_name and not (kw["text"] or kw["files"] or kw["hf"]):
        p.error("--name applies to --text/--files/--hf; a preset is written to <out-root>/<preset>")
    if name and out_name and name != out_name:
        p.error("give the output name once (NAME or --name)")
    prepare(out_name or name, verbose=not quiet, **kw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
