"""Where corpus text comes from: a ``Source`` per kind, each read by `datasets`.

Local sources are hashed up front, so that a prepared dataset is cheap to check, and streamed, so that nothing
is copied into the datasets cache. Text files are read as UTF-8; bytes that are not UTF-8 become U+FFFD, since
a few of them in a large scraped corpus are no reason to refuse it.
"""

import contextlib
import hashlib
import logging
import os
import socket
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from configs.errors import UserError, first_line

FORMATS = {".txt": "text", ".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")  # the single-file compressions datasets reads, through fsspec


@dataclass
class Source:
    label: str  # what messages call it, e.g. "corpus corpus.txt" or "hub dataset 'x'"
    stem: str  # the dataset's default name, e.g. "corpus" for corpus.txt
    description: dict[str, Any]  # JSON-safe, recorded in the manifest
    documents: Callable[[], Iterator[str]]  # a fresh pass over the documents on each call
    sha256: str | None = None  # of the raw bytes, for local sources
    total: int | None = None  # the number of documents when known, for the progress bar
    single: bool = False  # one text, its one document split by characters


def hash_files(paths: Iterable[Path]) -> str:
    """The sha256 of the files' bytes. A .txt file with NUL bytes is refused: binary, or UTF-16, is not text."""
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
                if b"\0" in block and p.suffix.lower() == ".txt":
                    raise UserError(f"{p} has NUL bytes: binary, not text (or UTF-16: save it as UTF-8); "
                                    "take it out of the corpus")
    return h.hexdigest()


def split_name(path: Path) -> tuple[str, str]:
    """The file name less its compression, and its format suffix: corpus.jsonl.gz gives ("corpus", ".jsonl")."""
    compression = next((c for c in COMPRESSIONS if path.name.lower().endswith(c)), "")
    stem, ext = os.path.splitext(path.name[: len(path.name) - len(compression)])
    return stem, ext.lower()


@contextlib.contextmanager
def reading(where: str, fix: str, offline: bool = False) -> Iterator[Any]:
    """The datasets module, its failures turned into one line naming `where` and `fix`, its log (which would print
    the error first) silenced. offline=True keeps it off the hub, and off its download count per local file."""
    import datasets

    log, saved = logging.getLogger("datasets"), datasets.config.HF_HUB_OFFLINE
    level = log.level
    log.setLevel(logging.CRITICAL)
    datasets.config.HF_HUB_OFFLINE = saved or offline
    try:
        yield datasets
    except Exception as e:
        raise UserError(f"could not read {where}: {first_line(e)}; {fix}") from e
    finally:
        log.setLevel(level)
        datasets.config.HF_HUB_OFFLINE = saved


def _column_texts(ds: Any, column: str, where: str) -> Iterator[str]:
    """The non-empty ``column`` cells of a datasets (Iterable)Dataset, read in column batches (fast)."""
    batches = iter(ds.iter(batch_size=1024))
    while True:
        with reading(where, "check the file/dataset"):  # around the datasets reader only, not this code
            batch = next(batches, None)
        if batch is None:
            return
        if column not in batch:
            raise UserError(f"{where} has no column {column!r} (columns: {', '.join(batch)}); "
                            "pick one with --text-column")
        for value in filter(lambda v: v is not None and v != "", batch[column]):
            if not isinstance(value, str):
                raise UserError(f"column {column!r} of {where} holds {type(value).__name__}, not text; "
                                "pick a text column with --text-column")
            yield value


def _local_files(builder: str, files: list[Path], column: str, where: str) -> Iterator[str]:
    """The documents of local files of one format, streamed. A .txt file is one document, read as UTF-8."""
    text = {"encoding": "utf-8-sig", "encoding_errors": "replace", "sample_by": "document"} if builder == "text" else {}
    with reading(where, "check the files' format", offline=True) as datasets:
        ds = datasets.load_dataset(builder, data_files=[str(p) for p in files], split="train", streaming=True, **text)
    return _column_texts(ds, column, where)


def text_source(path: str | os.PathLike) -> Source:
    """One text file (a single text, split by characters) or a folder of text files (documents)."""
    path = Path(path)
    if not (single := path.is_file()) and not path.is_dir():
        what = (f"{path} is not a regular file (a device or a pipe)" if path.exists()
                else f"no such file or folder: {path}")
        raise UserError(f"{what}; give --text a text file or a folder of text files")
    files = [path] if single else sorted(p for p in path.rglob("*") if p.is_file() and split_name(p)[1] == ".txt")
    if not files:
        raise UserError(f"folder {path} has no text files (.txt, or compressed .txt.gz ...); "
                        "put text files in it or point --text at a file")
    where = f"{'corpus' if single else 'folder'} {path}"
    description = {"kind": "text", "path": str(path)} if single else {
        "kind": "text_folder", "path": str(path), "files": len(files)}
    return Source(where, split_name(path)[0] if single else path.resolve().name, description,
                  lambda: _local_files("text", files, "text", where), hash_files(files), len(files), single)


def files_source(paths: Iterable[str | os.PathLike], text_column: str) -> Source:
    """Local .txt (one document per file), parquet, jsonl/json or csv files, maybe compressed."""
    files = [Path(p) for p in paths]
    if p := next((p for p in files if not p.is_file()), None):
        raise UserError(f"{p} is a folder; give --text a folder, --files its files" if p.is_dir()
                        else f"no such file: {p}; check the path given to --files")
    if bad := next((p for p in files if split_name(p)[1] not in FORMATS), None):
        raise UserError(f"unsupported file type {''.join(bad.suffixes[-2:]) or '(none)'} for {bad}; --files takes "
                        f"{', '.join(FORMATS)}, optionally compressed ({', '.join(COMPRESSIONS)})")
    kinds = {FORMATS[split_name(p)[1]] for p in files}  # the datasets builder that reads each
    if len(kinds) > 1:
        raise UserError("--files mixes formats (" + ", ".join(sorted(kinds)) + "); give one format per run")
    builder = kinds.pop()
    if builder == "text" and text_column != "text":
        raise UserError("--text-column: .txt files have no columns (each file is one document); drop it")
    where = str(files[0]) if len(files) == 1 else f"{len(files)} {builder} files"
    description = {"kind": "files", "format": builder, "paths": [str(p) for p in files], "text_column": text_column}
    return Source(where, split_name(files[0])[0], description, lambda: _local_files(builder, files, text_column, where),
                  hash_files(files))


def dataset_source(name: str, subset: str | None, split: str, text_column: str, streaming: bool,
                   revision: str | None) -> Source:
    """A dataset directory on disk (data files, or `save_to_disk` output), else a Hugging Face hub dataset, which
    asks the network only when it is not cached."""
    path, common = Path(name), {"subset": subset, "split": split, "text_column": text_column}
    if path.is_file():  # else it would be taken for a hub id, with advice to download it
        raise UserError(f"--hf {name} is a file; --hf takes a dataset directory or hub id: give a text file to "
                        "--text, a parquet, jsonl, json or csv file to --files")
    if path.is_dir() and (local := [f for f, v in (("--revision", revision), ("--streaming", streaming)) if v]):
        raise UserError(f"{', '.join(local)}: for hub datasets; {name} is a local folder, read as it is; "
                        f"drop {'them' if len(local) > 1 else 'it'}")
    stem = (path.resolve().name if path.is_dir() else name.replace("/", "_")) + f"_{subset}" * bool(subset)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and ".cache" not in p.parts)
        where = f"dataset directory {path}"
        return Source(where, stem, {"kind": "dataset_dir", "path": str(path), **common},
                      lambda: _column_texts(_local_dataset(where, path, subset, split), text_column, where),
                      hash_files(files))
    where = f"hub dataset {name!r}" + (f" ({subset})" if subset else "")
    return Source(where, stem, {"kind": "hub", "name": name, **common, "revision": revision, "streaming": streaming},
                  lambda: _column_texts(hub_dataset(where, name, subset, split, revision, streaming),
                                        text_column, where))


def _local_dataset(where: str, path: Path, subset: str | None, split: str) -> Any:
    with reading(where, "check --subset/--split and the folder's data files", offline=True) as datasets:
        if not (path / "dataset_dict.json").is_file() and not (path / "state.json").is_file():  # no save_to_disk's
            return datasets.load_dataset(str(path), subset, split=split, streaming=True)
        ds = datasets.load_from_disk(str(path))
    if isinstance(ds, dict) and split not in ds:  # a DatasetDict, one Dataset per split
        raise UserError(f"{where} has no split {split!r} (splits: {', '.join(ds)}); pick one with --split")
    return ds[split] if isinstance(ds, dict) else ds


def host_reachable(host: str, port: int = 443) -> bool:
    try:
        with socket.create_connection((host, port), timeout=3.0):
            return True
    except OSError:
        return False


def hub_dataset(where: str, name: str, subset: str | None, split: str, revision: str | None, streaming: bool,
                fix: str = "") -> Any:
    """Offline, datasets retries for long before it falls back to its cache, so look first. When the hub is away,
    ask datasets for its cached copy, of a dataset loaded before without --streaming. fix says how to get it."""
    import datasets

    fix = fix or (f"where there is network, run `hf download {name} --repo-type dataset --local-dir data/hub/{name}` "
                  f"(--include PATTERN for part of it) and pass --hf data/hub/{name}")
    host = urlparse(datasets.config.HF_ENDPOINT).hostname or "huggingface.co"
    offline = datasets.config.HF_HUB_OFFLINE or not host_reachable(host)
    if offline and streaming:
        raise UserError(f"cannot reach {host} to stream {where}; {fix}")
    why = ("it is not in the datasets cache and the hub cannot be reached" if offline
           else "check the name/--subset/--split/--revision")
    with reading(where, f"{why}; {fix}", offline):
        return datasets.load_dataset(name, subset, split=split, revision=revision, streaming=streaming)
