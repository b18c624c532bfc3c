"""Documents of data files and Hugging Face datasets, read by `datasets`, for data.prepare.

--files takes parquet, jsonl, json, csv or txt (a file a document), maybe .gz, .bz2, .xz or .zst;
--hf a dataset's folder, a `save_to_disk` folder, or the name of a hub dataset, downloaded or
streamed. Local files are read as they are, asking nothing of the network.
"""

from pathlib import Path

from configs import UserError

FORMATS = {".txt": "text", ".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}
COMPRESSED = (".gz", ".bz2", ".xz", ".zst")


def column(load, name: str, where: str):
    """The non-empty texts in a column of the datasets (Iterable)Dataset that load() returns, read
    by batches of rows."""
    try:
        for batch in load().iter(batch_size=1024):
            if name not in batch:
                raise UserError(
                    f"{where} has no column {name!r} ({', '.join(batch)}); "
                    "pick one with --text-column"
                )
            for text in filter(None, batch[name]):
                if not isinstance(text, str):
                    raise UserError(
                        f"{where}: column {name!r} holds {type(text).__name__}s, not text"
                    )
                if "\x00" in text:  # between ASCII letters: UTF-16 or UTF-32 read as UTF-8
                    raise UnicodeError
                yield text
    except UnicodeError:  # UnicodeDecodeError too
        raise UserError(f"{where} is not UTF-8 (UTF-16? Latin-1?); save it as UTF-8") from None
    except UserError:
        raise
    except Exception as e:  # pyarrow's, pandas' or datasets' own, for a file empty or damaged
        why = (str(e) or type(e).__name__).splitlines()[0]
        raise UserError(f"cannot read {where} ({why}); check the file, or give another") from None


def documents(files=None, hf=None, subset=None, split="train", text_column="text", streaming=False):
    """(a function that reads the documents afresh, a description of the source)."""
    import datasets

    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False  # else reading a local file pings a server
    datasets.disable_progress_bars()  # data.prepare shows its own, after the source is checked
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors are ours to say
    if files:
        for f in files:
            if not Path(f).is_file():
                raise UserError(f"--files {f}: not a file")
        # A file's format is its suffix, less a compression's: x.jsonl.gz is json.
        suffixes = {
            Path(f.removesuffix(Path(f).suffix) if f.endswith(COMPRESSED) else f).suffix
            for f in files
        }
        if len(suffixes) > 1 or not suffixes <= FORMATS.keys():
            raise UserError(
                f"--files takes files of one format: {', '.join(FORMATS)}, maybe compressed"
            )
        builder = FORMATS[suffixes.pop()]
        options = {"sample_by": "document"} if builder == "text" else {}  # a .txt file: a document
        load = lambda: datasets.load_dataset(
            builder, data_files=list(files), split="train", streaming=True, **options
        )
        return lambda: column(load, text_column, files[0]), {
            "files": list(files),
            "text_column": text_column,
        }
    if (Path(hf) / "dataset_dict.json").is_file() or (Path(hf) / "state.json").is_file():
        # save_to_disk's folder: of a dataset of splits, or of one
        def load():
            ds = datasets.load_from_disk(hf)
            if not isinstance(ds, datasets.DatasetDict):
                if split not in ("train", str(ds.split)):  # "train": --split's default
                    raise UserError(f"--hf {hf} is a dataset of one split: leave --split out")
                return ds
            if split not in ds:
                raise UserError(
                    f"--hf {hf} has no split {split!r} ({', '.join(ds)}); pick one with --split"
                )
            return ds[split]
    else:
        load = lambda: datasets.load_dataset(hf, subset, split=split, streaming=streaming)
    try:
        load()  # now: a dataset that cannot be read is one line, before any work
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"cannot read --hf {hf}: {str(e).splitlines()[0]}") from None
    return lambda: column(load, text_column, hf), {
        "hf": hf,
        "subset": subset,
        "split": split,
        "text_column": text_column,
    }
