"""Where corpus text comes from: a text file, a folder of .txt files, local data files, or the Hub.

A ``Source`` yields documents (strings) and describes itself for the manifest. Local sources
also know the sha256 of their raw bytes up front, so ``prepare`` can tell cheaply whether a
prepared dataset is still current. Non-text formats (parquet, jsonl/json, csv, hub datasets) go
through ``datasets.load_dataset``, imported only when needed.

Undecodable bytes in text files are replaced with U+FFFD and reported in one warning line with
their count (rejecting a large scraped corpus over a few bad bytes helps nobody).
"""

from __future__ import annotations

import codecs
import hashlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from errors import UserError

from .tokenizer import host_reachable

FILE_FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}
_LOCAL_FIX = "use local files instead: --files data.parquet|data.jsonl or --text corpus.txt"


@dataclass
class Source:
    label: str  # for messages: "corpus.txt", "hub dataset 'x'"
    description: dict[str, Any]  # JSON-safe; recorded in the manifest
    documents: Callable[[], Iterator[str]]  # a fresh pass over the documents on each call
    sha256: str | None = None  # of the raw bytes, for local sources
    total: int | None = None  # number of documents when known (progress bar)
    text: Callable[[], str] | None = None  # set for single-text sources (split by characters)


def hash_files(paths: Iterable[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


# UTF-32 LE first: its byte-order mark starts with UTF-16 LE's
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
         (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))


def text_encoding(data: bytes) -> str:
    """The encoding of a text file's bytes: its byte-order mark's; UTF-16 without one when most
    character pairs have a zero high byte (Latin text in UTF-16; UTF-8 text has no zero bytes,
    and decoding UTF-16 as UTF-8 would give half NUL characters); else UTF-8."""
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            return encoding
    head = data[: 1 << 16]  # 64 KiB tell as well as the whole file
    even, odd = head[0::2].count(0), head[1::2].count(0)
    if odd > len(head) // 4 > even:
        return "utf-16-le"
    if even > len(head) // 4 > odd:
        return "utf-16-be"
    return "utf-8"


def read_text_file(path: Path) -> str:
    data = path.read_bytes()
    encoding = text_encoding(data)
    if not encoding.startswith("utf-8"):
        print(f"note: {path} is {encoding.upper()} text, not UTF-8; decoding it as {encoding.upper()}",
              file=sys.stderr)
    try:
        return data.decode(encoding)
    except UnicodeDecodeError:
        text = data.decode(encoding, errors="replace")
        # U+FFFD that was already in the file is not a replacement; count only the new ones.
        bad = text.count("\ufffd") - data.decode(encoding, errors="ignore").count("\ufffd")
        print(f"warning: {path}: {bad} undecodable byte sequence(s) replaced with U+FFFD "
              f"(the file is not valid {encoding.upper()})", file=sys.stderr)
        return text


def text_source(path: str | os.PathLike) -> Source:
    """One .txt file (a single text, split by characters) or a folder of .txt files (documents)."""
    path = Path(path)
    if path.is_file():
        return Source(
            label=f"corpus {path}", description={"kind": "text", "path": str(path)},
            documents=lambda: iter([read_text_file(path)]),
            sha256=hash_files([path]), total=1, text=lambda: read_text_file(path),
        )
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not files:
            raise UserError(f"folder {path} has no .txt files; "
                            "put text files in it or point --text at a file")
        return Source(
            label=f"folder {path}",
            description={"kind": "text_folder", "path": str(path), "files": len(files)},
            documents=lambda: (read_text_file(p) for p in files),
            sha256=hash_files(files), total=len(files),
        )
    raise UserError(f"no such file or folder: {path}; give --text a .txt file or a folder of .txt files")


def _column_texts(ds: Any, column: str, where: str) -> Iterator[str]:
    """The ``column`` of each row of a datasets (Iterable)Dataset; skips empty cells."""
    columns = ds.column_names  # None for some streamed datasets: then checked on the first batch
    if columns is not None and column not in columns:
        raise UserError(f"{where} has no column {column!r} (columns: {', '.join(columns)}); "
                        "pick one with --text-column")
    it = iter(ds.iter(batch_size=1024))  # column batches: ~10x faster than a dict per row
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return
        except Exception as e:  # only the datasets reader runs inside next(); our code is outside
            raise UserError(f"could not read {where}: {_first_line(e)}; check the file/dataset") from e
        if column not in batch:
            raise UserError(f"{where} has no column {column!r} (columns: {', '.join(batch)}); "
                            "pick one with --text-column")
        for value in batch[column]:
            if value is None or value == "":
                continue
            if not isinstance(value, str):
                raise UserError(f"column {column!r} of {where} holds {type(value).__name__}, not text; "
                                "pick a text column with --text-column")
            yield value


def _first_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}".rstrip(": ")


def files_source(paths: Iterable[str | os.PathLike], text_column: str = "text") -> Source:
    """Local parquet/jsonl/json/csv files, read (streaming, no cache copy) by datasets."""
    files = [Path(p) for p in paths]
    if not files:
        raise UserError("--files needs at least one file")
    for p in files:
        if not p.is_file():
            raise UserError(f"no such file: {p}; check the path given to --files")
    kinds = {FILE_FORMATS.get(p.suffix.lower()) for p in files}
    if None in kinds:
        bad = next(p for p in files if p.suffix.lower() not in FILE_FORMATS)
        raise UserError(f"unsupported file type {bad.suffix or '(none)'} for {bad}; --files takes "
                        f"{', '.join(FILE_FORMATS)} (use --text for plain text)")
    if len(kinds) > 1:
        raise UserError("--files mixes formats (" + ", ".join(sorted(kinds)) + "); give one format per run")
    builder = kinds.pop()
    where = str(files[0]) if len(files) == 1 else f"{len(files)} {builder} files"

    def documents() -> Iterator[str]:
        import datasets

        try:
            ds = datasets.load_dataset(builder, data_files=[str(p) for p in files],
                                       split="train", streaming=True)
        except Exception as e:
            raise UserError(f"could not read {where}: {_first_line(e)}; check the files' format") from e
        return _column_texts(ds, text_column, where)

    return Source(
        label=where, description={"kind": "files", "format": builder, "paths": [str(p) for p in files],
                     "text_column": text_column},
        documents=documents, sha256=hash_files(files),
    )


def hub_source(name: str, subset: str | None = None, split: str = "train",
               text_column: str = "text", streaming: bool = False) -> Source:
    """A Hugging Face hub dataset; needs network unless HF_HUB_OFFLINE=1 and it is cached."""
    where = f"hub dataset {name!r}" + (f" ({subset})" if subset else "")

    def documents() -> Iterator[str]:
        host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
        offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
        # Without this probe, an offline load_dataset retries for ~25 s before failing.
        if not offline and not host_reachable(host):
            raise UserError(f"cannot reach {host} to load {where}: it needs network access; {_LOCAL_FIX} "
                            "(or set HF_HUB_OFFLINE=1 to use a copy in the Hugging Face cache)")
        import datasets

        try:
            ds = datasets.load_dataset(name, subset, split=split, streaming=streaming)
        except Exception as e:
            raise UserError(f"could not load {where}: {_first_line(e)}; it needs network access "
                            f"and a valid name/--subset/--split; {_LOCAL_FIX}") from e
        return _column_texts(ds, text_column, where)

    return Source(
        label=where, description={"kind": "hub", "name": name, "subset": subset, "split": split,
                     "text_column": text_column, "streaming": streaming},
        documents=documents,
    )
