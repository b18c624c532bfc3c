"""Where corpus text comes from; `datasets` does all the reading.

A ``Source`` yields documents (strings) and describes itself for the manifest. Local sources
also know the sha256 of their raw bytes up front, so ``prepare`` can tell cheaply whether a
prepared dataset is still current. Local files are streamed (no copy in the datasets cache);
compressed files (.gz, .bz2, .xz, .zst) are decompressed on the fly by datasets. Text is read
as UTF-8 (or UTF-16/32, recognised by a byte-order mark or by its zero bytes) with undecodable
bytes replaced by U+FFFD (rejecting a large scraped corpus over a few bad bytes helps nobody)
and universal newlines ("\\r\\n" becomes "\\n").
"""

from __future__ import annotations

import codecs
import hashlib
import itertools
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from errors import UserError

from .tokenizer import host_reachable

FORMATS = {".txt": "text", ".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")  # single-file compressions datasets reads (via fsspec)
# The text builder's options that make one file one document, read leniently.
_TEXT_OPTIONS = {"sample_by": "document", "encoding_errors": "replace"}


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


def split_name(path: Path) -> tuple[str, str]:
    """corpus.jsonl.gz -> ("corpus", ".jsonl"): the file name less its compression and format suffixes."""
    name = path.name
    compression = next((c for c in COMPRESSIONS if name.lower().endswith(c)), "")
    stem, ext = os.path.splitext(name[: len(name) - len(compression)])
    return stem, ext.lower()


def file_format(path: Path) -> str | None:
    """The datasets builder that reads a file ("text", "json", ...), None for an unknown type."""
    return FORMATS.get(split_name(path)[1])


def _first_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}".rstrip(": ")


def _open(where: str, fix: str, load: Callable[..., Any], *args: Any, offline: bool = True, **kwargs: Any) -> Any:
    """load(*args, **kwargs) from datasets; its failures become one line naming `where` and `fix`.

    offline sets datasets' own switch for the call: local data needs no hub, and so datasets also
    skips the download-count request it otherwise sends for every local file it reads."""
    import datasets

    saved = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = saved or offline
    try:
        return load(*args, **kwargs)
    except Exception as e:
        raise UserError(f"could not read {where}: {_first_line(e)}; {fix}") from e
    finally:
        datasets.config.HF_HUB_OFFLINE = saved


# UTF-32 LE first: its byte-order mark starts with UTF-16 LE's
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
         (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))


def text_encoding(path: Path) -> str:
    """A text file's encoding: its byte-order mark's; UTF-16 without one when most character
    pairs have a zero high byte (Latin text in UTF-16; UTF-8 text has no zero bytes, and reading
    UTF-16 as UTF-8 would give half NUL characters); else UTF-8. Compressed files: UTF-8."""
    if split_name(path)[0] + split_name(path)[1] != path.name:
        return "utf-8"
    with open(path, "rb") as f:
        head = f.read(1 << 16)  # 64 KiB tell as well as the whole file
    for bom, encoding in _BOMS:
        if head.startswith(bom):
            return encoding
    even, odd = head[0::2].count(0), head[1::2].count(0)
    if odd > len(head) // 4 > even:
        return "utf-16-le"
    if even > len(head) // 4 > odd:
        return "utf-16-be"
    return "utf-8"


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


def _read_files(builder: str, files: list[Path], column: str, where: str) -> Iterator[str]:
    import datasets

    if builder != "text":
        ds = _open(where, "check the files' format", datasets.load_dataset, builder,
                   data_files=[str(p) for p in files], split="train", streaming=True)
        return _column_texts(ds, column, where)
    return itertools.chain.from_iterable(_read_text(p, where) for p in files)


def _read_text(path: Path, where: str) -> Iterator[str]:
    """One text file as one document, in the encoding text_encoding finds."""
    import datasets

    encoding = text_encoding(path)
    if not encoding.startswith("utf-8"):
        print(f"note: {path} is {encoding.upper()} text, not UTF-8; decoding it as {encoding.upper()}",
              file=sys.stderr)
    ds = _open(where, "check the file", datasets.load_dataset, "text", data_files=[str(path)], split="train",
               streaming=True, encoding=encoding, **_TEXT_OPTIONS)
    return _column_texts(ds, "text", where)


def text_source(path: str | os.PathLike) -> Source:
    """One text file (a single text, split by characters) or a folder of text files (documents)."""
    path = Path(path)
    if path.is_file():
        where = f"corpus {path}"
        return Source(
            label=where, description={"kind": "text", "path": str(path)},
            documents=lambda: iter([_whole_text(path, where)]),
            sha256=hash_files([path]), total=1, text=lambda: _whole_text(path, where),
        )
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and file_format(p) == "text")
        if not files:
            raise UserError(f"folder {path} has no text files (.txt, or compressed .txt.gz ...); "
                            "put text files in it or point --text at a file")
        return Source(
            label=f"folder {path}",
            description={"kind": "text_folder", "path": str(path), "files": len(files)},
            documents=lambda: _read_files("text", files, "text", f"folder {path}"),
            sha256=hash_files(files), total=len(files),
        )
    raise UserError(f"no such file or folder: {path}; give --text a text file or a folder of text files")


def _whole_text(path: Path, where: str) -> str:
    return "".join(_read_files("text", [path], "text", where))  # one row: the whole file


def files_source(paths: Iterable[str | os.PathLike], text_column: str = "text") -> Source:
    """Local .txt (one document per file), parquet, jsonl/json or csv files, maybe compressed."""
    files = [Path(p) for p in paths]
    if not files:
        raise UserError("--files needs at least one file")
    for p in files:
        if not p.is_file():
            raise UserError(f"no such file: {p}; check the path given to --files")
    kinds = {file_format(p) for p in files}
    if None in kinds:
        bad = next(p for p in files if file_format(p) is None)
        raise UserError(f"unsupported file type {''.join(bad.suffixes[-2:]) or '(none)'} for {bad}; --files takes "
                        f"{', '.join(FORMATS)}, optionally compressed ({', '.join(COMPRESSIONS)})")
    if len(kinds) > 1:
        raise UserError("--files mixes formats (" + ", ".join(sorted(kinds)) + "); give one format per run")
    builder = kinds.pop()
    where = str(files[0]) if len(files) == 1 else f"{len(files)} {builder} files"
    return Source(
        label=where, description={"kind": "files", "format": builder, "paths": [str(p) for p in files],
                     "text_column": text_column},
        documents=lambda: _read_files(builder, files, text_column, where), sha256=hash_files(files),
    )


def dataset_source(name: str, subset: str | None = None, split: str = "train", text_column: str = "text",
                   streaming: bool = False, revision: str | None = None) -> Source:
    """A dataset directory on disk (data files, or `save_to_disk` output), else a Hugging Face hub
    dataset. Only a hub dataset asks the network, and only when it is not cached."""
    path = Path(name)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and ".cache" not in p.parts)
        where = f"dataset directory {path}"
        return Source(
            label=where, description={"kind": "dataset_dir", "path": str(path), "subset": subset,
                                      "split": split, "text_column": text_column},
            documents=lambda: _column_texts(_local_dataset(path, subset, split), text_column, where),
            sha256=hash_files(files),
        )
    where = f"hub dataset {name!r}" + (f" ({subset})" if subset else "")
    return Source(
        label=where, description={"kind": "hub", "name": name, "subset": subset, "split": split,
                                  "revision": revision, "text_column": text_column, "streaming": streaming},
        documents=lambda: _column_texts(_hub_dataset(name, subset, split, revision, streaming), text_column, where),
    )


def _local_dataset(path: Path, subset: str | None, split: str) -> Any:
    import datasets

    where, fix = f"dataset directory {path}", "check --subset/--split and the folder's data files"
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():  # save_to_disk output
        ds = _open(where, fix, datasets.load_from_disk, str(path))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise UserError(f"{where} has no split {split!r} (splits: {', '.join(ds)}); pick one with --split")
            ds = ds[split]
        return ds
    # streamed: read in place, without a copy in the datasets cache
    return _open(where, fix, datasets.load_dataset, str(path), subset, split=split, streaming=True)


def _hub_dataset(name: str, subset: str | None, split: str, revision: str | None, streaming: bool) -> Any:
    import datasets

    where = f"hub dataset {name!r}" + (f" ({subset})" if subset else "")
    fix = (f"where there is network, run `hf download {name} --repo-type dataset --local-dir data/hub/{name}` "
           f"(--include PATTERN for part of it) and pass --hf data/hub/{name}")
    host = urlparse(datasets.config.HF_ENDPOINT).hostname or "huggingface.co"
    # Offline, datasets retries for ~25 s before it falls back to its cache. So look first, and when
    # the hub is away ask datasets for its cached copy (of a dataset loaded before without --streaming).
    offline = datasets.config.HF_HUB_OFFLINE or not host_reachable(host)
    if offline and streaming:
        raise UserError(f"cannot reach {host} to stream {where}; {fix}")
    why = "it is not in the datasets cache and the hub cannot be reached" if offline else "check the name/--subset/--split/--revision"
    return _open(where, f"{why}; {fix}", datasets.load_dataset, name, subset, split=split, revision=revision,
                 streaming=streaming, offline=offline)
