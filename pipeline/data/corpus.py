"""Text sources, each a Ray Dataset of documents, and the driver's rule on their unreadable records.

    from pipeline.data.corpus import read_documents, describe_source
    ds = read_documents(cfg.data)        # ray.data.Dataset with a `text` column, in source order

Sources (`data.source`):
  builtin  text that ships with Python: pydoc_data's help topics and the docstrings of the standard library
           (one document per topic and per module, parsed with `ast` from the .py files, never imported);
           about 2 MB, no download (pipeline/data/builtin_corpus.py).
  files    `data.path` is a file, a directory (searched recursively) or a glob of .txt, .jsonl, .json, .parquet,
           on this machine or in object storage (s3://bucket/corpus/*.jsonl, gs://..., any pyarrow or fsspec
           URI: pipeline/storage.py), read by one Ray Data file datasource in sorted path order. .txt, .jsonl
           and .json files may be compressed (.gz, .bz2, .zst/.zstd: decompressed as they are read; the cache key
           lists them as any file). A directory's files of other types are not read, and the prepare summary
           names each of them. A .txt file is one document. A .jsonl file holds one JSON object per line and a
           .json file a list of objects; the document is the `data.text_column` field. Parquet: that column,
           string or binary.
  hf       a Hugging Face dataset through `datasets.load_dataset(data.hf_name, data.hf_config,
           split=data.hf_split, streaming=data.hf_streaming)` and `ray.data.from_huggingface` (streaming:
           a datasource reading the dataset's shards in parallel). With `data.path` set, it is passed as
           `data_files` (e.g. hf_name=json with local .jsonl files, as the tests do: no hub access here).

Every document is then cleaned inside the tokenizer actors (pipeline/data/cleaning.py: invalid UTF-8 replaced and
counted, NULs removed, empty documents dropped and counted). A corpus with no usable text is told so in one line by
pipeline/data/no_usable_text.py.

Bad records (a .jsonl line that is not JSON, a missing or non-string text field, a .json file that does
not parse, a non-text value in a column) are data, not exceptions: the reader emits them as rows with a
`bad_file` and a `bad_reason` (one line naming the file and line), the tokenizer actors count them per
file, and only the driver decides (`check_bad_records`, by data.on_bad_record and data.max_bad_fraction)
whether the prepare fails. Nothing is raised inside a Ray task for the data's fault, so the user sees our
one line instead of a Ray worker traceback, and Ray never retries what a retry cannot fix.
"""
from __future__ import annotations

import glob
import hashlib
import io
import json
import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import pyarrow as pa
from pyarrow.fs import FileType

from pipeline.data.builtin_corpus import BUILTIN_BLOCKS, builtin_items, builtin_module_files, read_builtin
from pipeline.data.cleaning import CleanStats, clean_batch, decode_utf8, fix_surrogates
from pipeline.storage import (StorageError, check_bucket, explained, info, is_local, is_uri, listdir, location_of,
                              open_input, resolve, scheme)
from pipeline.storage import glob as glob_files

if TYPE_CHECKING:
    import ray.data

    from pipeline.config import DataConfig

FILE_KINDS = {".txt": "txt", ".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}
# Whole-file compression of the streamed kinds (txt, jsonl, json), decompressed while read (pyarrow's codecs, as Ray
# Data's readers do). A compressed Parquet file is not read: Parquet compresses inside and needs random access.
COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd", ".zstd": "zstd"}
READS = ".txt, .jsonl, .json and .parquet; .txt, .jsonl and .json also compressed as .gz, .bz2 or .zst"
# What a data.path that names no corpus file is told (local or object storage).
MATCHES_NONE = ("matches no .txt, .jsonl, .json or .parquet files, nor .txt, .jsonl or .json files compressed as "
                ".gz, .bz2, .zst or .zstd")
BLOCK_BYTES = 1 << 20  # text per block the JSON reader yields: small blocks balance the tokenizer actors
DOC_COLUMN = "doc"  # every reader's record id inside its source: (file or shard index << 32) + row; < 2^DOC_ID_BITS
DOC_ID_BITS = 56
_PARQUET_BATCH_ROWS = 1024  # rows per block the Parquet reader yields


class DataSourceError(ValueError):
    """The corpus cannot be read as configured; the message names the file or setting and the fix."""


# ----------------------------------------------------------------------------------------------
# Bad records: the driver's decision

def check_bad_records(stats: CleanStats, on_bad_record: str, max_bad_fraction: float) -> None:
    """The driver's decision on unreadable records: DataSourceError (one line, the first bad record named)
    when data.on_bad_record=error and there is one, or when more than max_bad_fraction of records are bad."""
    if not stats.bad_records:
        return
    first = stats.first_bad_reason()
    if on_bad_record == "error":
        raise DataSourceError(f"{first} (data.on_bad_record=error; set it to skip to drop and count unreadable "
                              "records)")
    fraction = stats.bad_records / max(1, stats.records)
    if fraction > max_bad_fraction:
        raise DataSourceError(
            f"{stats.bad_records:,} of {stats.records:,} records ({fraction:.3%}) are unreadable, more than "
            f"data.max_bad_fraction={max_bad_fraction:g}; the first: {first}. Fix the data (or point data.path / "
            "data.text_column at the right files and field), or raise data.max_bad_fraction")


# ----------------------------------------------------------------------------------------------
# Local files

def file_kind(path: str) -> str | None:
    """txt / jsonl / json / parquet by the file's name (a compressed txt, jsonl or json by the name inside its
    compression suffix: corpus/part-1.jsonl.gz is jsonl); None for a file data.source=files does not read."""
    suffixes = [x.lower() for x in Path(path).suffixes]
    if suffixes and suffixes[-1] in COMPRESSIONS:
        kind = FILE_KINDS.get(suffixes[-2]) if len(suffixes) > 1 else None
        return kind if kind != "parquet" else None
    return FILE_KINDS.get(suffixes[-1]) if suffixes else None


def compression_of(path: str) -> str | None:
    """The codec of a compressed corpus file (pyarrow's name: gzip, bz2, zstd), else None."""
    suffix = Path(path).suffix.lower()
    return COMPRESSIONS.get(suffix)


def open_stream(path: str) -> Any:
    """A corpus file to read from its start, decompressed when it is compressed (a local path or a URI)."""
    raw = open_input(path)
    codec = compression_of(path)
    return pa.CompressedInputStream(raw, codec) if codec else raw


def skipped_files(path: str) -> list[str]:
    """The files a directory (or prefix) `path` holds that data.source=files does not read (hidden ones apart),
    sorted: what the prepare summary names, so no file is left out without a word. [] for a file or a glob (a glob
    names its files: one of a type not read is an error)."""
    if not path or any(c in path for c in "*?["):
        return []
    if is_uri(path) and not is_local(path):
        try:
            if info(path).type != FileType.Directory:
                return []
        except (StorageError, OSError):  # resolve_files has named the problem already, or will
            return []
        fs, base = resolve(path)
        return sorted(location_of(fs, f.path, path) for f in listdir(path, recursive=True)
                      if f.type == FileType.File and file_kind(f.path) is None
                      and not any(part.startswith(".") for part in f.path[len(base) + 1:].split("/")))
    p = Path(path[len("file://"):] if path.startswith("file://") else path).expanduser()
    if not p.is_dir():
        return []
    return sorted(str(m) for m in p.rglob("*") if (m.is_file() or m.is_symlink()) and file_kind(str(m)) is None
                  and not any(part.startswith(".") for part in m.relative_to(p).parts))


def resolve_files(path: str) -> list[str]:
    """The files `path` names (a file, a directory searched recursively, or a glob; a local path or a URI such
    as s3://bucket/corpus/*.jsonl), sorted, all of a supported type: absolute local paths or URIs. Raises
    DataSourceError when nothing usable matches, StorageError when the storage cannot be used."""
    if is_uri(path) and not is_local(path):
        files = _resolve_uri(path)
    else:
        files = [str(f) for f in _resolve_local(path[len("file://"):] if path.startswith("file://") else path)]
    bad = [f for f in files if file_kind(f) is None]
    if bad:
        raise DataSourceError(f"{bad[0]!r} has an unsupported type; data.source=files reads {READS}")
    return files


def _resolve_local(path: str) -> list[Path]:
    p = Path(path).expanduser()
    if any(c in path for c in "*?["):
        matches = [Path(m) for m in glob.glob(str(p), recursive=True)]
        files = sorted(m for m in matches if m.is_file() or m.is_symlink())
    elif p.is_dir():
        files = sorted(m for m in p.rglob("*") if (m.is_file() or m.is_symlink()) and file_kind(str(m)) is not None
                       and not any(part.startswith(".") for part in m.relative_to(p).parts))
    elif p.exists() or p.is_symlink():
        files = [p]
    else:
        raise DataSourceError(f"data.path={path!r} does not exist; give a file, a directory or a glob")
    if not files:
        raise DataSourceError(f"data.path={path!r} {MATCHES_NONE}")
    for f in files:
        try:
            with open(f, "rb") as fh:
                fh.read(1)
        except OSError as exc:
            raise DataSourceError(f"cannot read {str(f)!r}: {exc.strerror or exc}; fix its permissions or remove "
                                  "it from data.path") from None
    return files


def _resolve_uri(path: str) -> list[str]:
    """resolve_files for object storage: the bucket and credentials are checked first, so a missing bucket or
    denied access is named as such rather than as "no files"."""
    check_bucket(path, what="data.path")
    if any(c in path for c in "*?["):
        files = glob_files(path)
    else:
        kind = info(path).type
        if kind == FileType.File:
            files = [path]
        elif kind == FileType.Directory:
            fs, base = resolve(path)
            files = sorted(location_of(fs, f.path, path) for f in listdir(path, recursive=True)
                           if f.type == FileType.File and file_kind(f.path) is not None
                           and not any(part.startswith(".") for part in f.path[len(base) + 1:].split("/")))
        else:
            raise DataSourceError(f"data.path={path!r} does not exist: no object and no prefix of that name; check "
                                  "the URI (a file, a prefix or a glob such as s3://bucket/corpus/*.jsonl)")
    if not files:
        raise DataSourceError(f"data.path={path!r} {MATCHES_NONE}; check the URI "
                              "and the pattern (e.g. s3://bucket/corpus/*.jsonl)")
    with explained(files[0], "data.path"):  # listing is allowed; is reading? (a policy may grant one alone)
        with open_input(files[0]) as f:
            f.read_at(1, 0)
    return files


def check_parquet_column(files: list[str], column: str) -> None:
    import pyarrow.parquet as pq

    for f in files:
        try:
            schema = pq.read_schema(open_input(f))
        except (pa.ArrowException, OSError) as exc:
            raise DataSourceError(f"{str(f)!r} is not a readable Parquet file ({str(exc).splitlines()[0]})") from None
        if column not in schema.names:
            raise DataSourceError(f"{str(f)!r} has no column {column!r} (columns: {', '.join(schema.names)}); "
                                  "set data.text_column")
        t = schema.field(column).type
        if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
                or pa.types.is_large_binary(t) or pa.types.is_string_view(t)):
            raise DataSourceError(f"column {column!r} of {str(f)!r} is {t}, not text; set data.text_column to a "
                                  "string column")


def _doc_table(texts: list[str | None] | pa.Array, replaced: Any, bad: list[str | None] | None = None,
               path: str = "") -> pa.Table:
    """A reader block: text, replaced, and bad_file/bad_reason (null for readable records)."""
    text = texts if isinstance(texts, pa.Array) else pa.array(texts, pa.large_string())
    if bad is None or not any(b is not None for b in bad):
        files = reasons = pa.nulls(len(text), pa.string())
    else:
        files = pa.array([None if b is None else path for b in bad], pa.string())
        reasons = pa.array(bad, pa.string())
    return pa.table({"text": text, "replaced": pa.array(replaced, pa.int32()), "bad_file": files,
                     "bad_reason": reasons})


def with_doc_ids(block: pa.Table, first: int) -> pa.Table:
    """The block with a `doc` column: first, first + 1, ...: every record's id inside its source, in source order
    (what deduplication names documents by, pipeline/data/dedup.py; the same on every read)."""
    return block.append_column(DOC_COLUMN, pa.array(np.arange(first, first + block.num_rows, dtype=np.int64)))


def bad_record_table(path: str, reason: str) -> pa.Table:
    """One unreadable record of `path` as a reader block."""
    return _doc_table([None], [0], [reason], path)


def _field(obj: Any, column: str, where: str) -> tuple[str | None, int]:
    if not isinstance(obj, dict):
        raise DataSourceError(f"{where}: expected a JSON object with a {column!r} field, got {type(obj).__name__}")
    if column not in obj:
        keys = ", ".join(list(obj)[:8])
        raise DataSourceError(f"{where}: no {column!r} field (fields: {keys}); set data.text_column")
    v = obj[column]
    if v is None:
        return None, 0
    if not isinstance(v, str):
        raise DataSourceError(f"{where}: field {column!r} is {type(v).__name__}, not a string")
    return fix_surrogates(v)


def read_document_file(f: Any, path: str, kind: str, column: str) -> Iterator[pa.Table]:
    """Yield blocks {text, replaced} from one open file (binary stream) of kind txt/jsonl/json/parquet."""
    if kind == "parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(f).iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[column]):
            col = batch.column(0)
            if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
                try:  # Parquet does not guarantee valid UTF-8 in string columns
                    col.validate(full=True)
                    yield _doc_table(col.cast(pa.large_string()), np.zeros(len(col), np.int32), None, path)
                    continue
                except pa.ArrowInvalid:
                    col = col.cast(pa.large_binary() if pa.types.is_large_string(col.type) else pa.binary())
            got = [(None, 0) if b is None else decode_utf8(b) for b in col.cast(pa.large_binary()).to_pylist()]
            yield _doc_table([t for t, _ in got], [k for _, k in got], None, path)
        return
    if kind == "txt":
        text, n = decode_utf8(f.read())
        yield _doc_table([text], [n], None, path)
        return
    if kind == "json":
        text, n = decode_utf8(f.read())
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:  # the whole file is one unreadable record
            yield bad_record_table(path, f"{path}: not valid JSON ({exc}); .json files hold a list of objects")
            return
        rows = doc if isinstance(doc, list) else [doc]
        got = [_read_field(r, column, f"{path} item {i}") for i, r in enumerate(rows)]
        yield _doc_table([t for t, _, _ in got], [k + (n if i == 0 else 0) for i, (_, k, _) in enumerate(got)],
                         [b for _, _, b in got], path)
        return
    texts: list[str | None] = []
    counts: list[int] = []
    bad: list[str | None] = []
    size = 0
    for lineno, raw in enumerate(f, 1):
        if not raw.strip():
            continue
        line, n = decode_utf8(raw)
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            t, k, b = None, 0, (f"{path} line {lineno}: not valid JSON ({exc.msg}); .jsonl holds one object per "
                                "line")
        else:
            t, k, b = _read_field(obj, column, f"{path} line {lineno}")
        texts.append(t)
        counts.append(n + k)
        bad.append(b)
        size += len(raw)
        if size >= BLOCK_BYTES:
            yield _doc_table(texts, counts, bad, path)
            texts, counts, bad, size = [], [], [], 0
    if texts:
        yield _doc_table(texts, counts, bad, path)


def _read_field(obj: Any, column: str, where: str) -> tuple[str | None, int, str | None]:
    """(text, replaced, None) for a readable record, (None, 0, reason) for an unreadable one."""
    try:
        return (*_field(obj, column, where), None)
    except DataSourceError as exc:
        return None, 0, str(exc)


def _read_files(files: list[str], column: str) -> "ray.data.Dataset":
    """One Ray Data file datasource for every supported type, so the documents come in sorted-path order
    (a union of per-type readers would interleave their blocks). Ray's JSON readers cannot replace invalid
    UTF-8 and count it, nor name the offending line, hence this reader."""
    import ray.data
    from ray.data.datasource import FileBasedDatasource

    check_parquet_column([f for f in files if f.lower().endswith(".parquet")], column)
    fs, _ = resolve(files[0])  # one data.path: one filesystem; each read task opens it from its own environment
    prefix = f"{scheme(files[0])}://" if is_uri(files[0]) and not is_local(files[0]) else ""
    index = {resolve(f)[1]: i for i, f in enumerate(files)}  # a record's id: (its file's index << 32) + its row
    if len(files) >= 1 << (DOC_ID_BITS - 32):
        raise DataSourceError(f"data.path={files[0]!r}...: {len(files):,} files, more than the "
                              f"{1 << (DOC_ID_BITS - 32):,} one source may have; merge small files")

    class DocumentFileDatasource(FileBasedDatasource):
        def _open_input_source(self, filesystem, path: str, **open_args):
            if path.lower().endswith(".parquet"):  # Parquet needs random access (footer first)
                return filesystem.open_input_file(path)
            if compression_of(path):  # by our suffixes: Ray infers from Arrow's, which lack .zstd
                open_args = {**open_args, "compression": compression_of(path)}
            return super()._open_input_source(filesystem, path, **open_args)

        def _read_stream(self, f, path: str) -> Iterator[pa.Table]:
            kind = file_kind(path)
            first = index[path] << 32
            path = prefix + path  # what messages and the manifest name: the URI, not the bucket-relative key
            stream = f if kind == "parquet" else io.BufferedReader(_RawReader(f), 1 << 20)
            rows = 0
            try:
                for block in read_document_file(stream, path, kind, column):
                    yield with_doc_ids(block, first + rows)
                    rows += block.num_rows
            except (DataSourceError, pa.ArrowInvalid) as exc:  # corrupt content: data, never a Ray task error
                yield with_doc_ids(bad_record_table(path, f"{path}: cannot read the rest of the file "
                                                          f"({str(exc).splitlines()[0]})"), first + rows)

    # One read task per file: Ray Data would otherwise split each task's output into more blocks
    # (SplitBlocks) to reach its default parallelism, which only adds objects; our reader already yields
    # ~1 MB blocks, and one reader feeds many tokenizer actors (parsing JSON is ~30x cheaper than encoding).
    return ray.data.read_datasource(DocumentFileDatasource([resolve(f)[1] for f in files], filesystem=fs),
                                    override_num_blocks=len(files))


class _RawReader(io.RawIOBase):
    """Adapts a pyarrow NativeFile to io.RawIOBase so io.BufferedReader can iterate its lines."""

    def __init__(self, f: Any):
        self._f = f

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        data = self._f.read(len(b))
        b[:len(data)] = data
        return len(data)


# ----------------------------------------------------------------------------------------------
# Hugging Face

def _read_hf(d: "DataConfig") -> "ray.data.Dataset":
    import datasets
    import ray.data

    kwargs: dict[str, Any] = {"split": d.hf_split, "streaming": d.hf_streaming}
    if d.hf_config:
        kwargs["name"] = d.hf_config
    if d.path:
        kwargs["data_files"] = resolve_files(d.path)
    try:
        hfds = datasets.load_dataset(d.hf_name, **kwargs)
    except Exception as exc:  # datasets raises many types (FileNotFoundError, DatasetNotFoundError, ValueError...)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataSourceError(
            f"cannot load Hugging Face dataset {d.hf_name!r} (config={d.hf_config or None!r}, split={d.hf_split!r}): "
            f"{first}. Check data.hf_name/hf_config/hf_split; without network access use a local copy "
            "(data.path with hf_name=json|parquet|text) or data.source=files") from None
    columns = hfds.column_names
    if columns is not None and d.text_column not in columns:
        raise DataSourceError(f"Hugging Face dataset {d.hf_name!r} has no column {d.text_column!r} "
                              f"(columns: {', '.join(columns)}); set data.text_column")
    feature = (hfds.features or {}).get(d.text_column)
    if feature is not None and getattr(feature, "dtype", "string") not in ("string", "large_string", "binary"):
        raise DataSourceError(f"column {d.text_column!r} of {d.hf_name!r} is {feature}, not text; set "
                              "data.text_column")
    if isinstance(hfds, datasets.IterableDataset):
        # Ray 2.60's from_huggingface reads an IterableDataset in ONE task and needs `transformers`
        # installed; this datasource reads the dataset's own shards in parallel instead.
        ds = ray.data.read_datasource(_hf_stream_datasource(hfds, d.text_column))
    elif d.path or d.dedup != "none":
        # from_huggingface first probes the Hub for hosted Parquet by re-loading the builder by name, which
        # for a local builder (json, parquet, text) without data_files scans the working directory; skip
        # to what it then does anyway: the dataset's Arrow table (memory-mapped from the datasets cache), which also
        # numbers its rows for deduplication.
        # One block per ~1 MB of text, not one for the whole table: each block is a tokenizer task.
        table = hfds.with_format("arrow")[:]
        table = table.append_column(DOC_COLUMN, pa.array(np.arange(table.num_rows, dtype=np.int64)))
        step = max(1, table.num_rows * BLOCK_BYTES // max(1, table.nbytes))
        ds = ray.data.from_arrow([table.slice(i, step) for i in range(0, max(1, table.num_rows), step)])
    else:
        ds = ray.data.from_huggingface(hfds)
    numbered = isinstance(hfds, datasets.IterableDataset) or bool(d.path) or d.dedup != "none"
    ds = ds.select_columns([d.text_column, DOC_COLUMN] if numbered else [d.text_column])
    return ds.rename_columns({d.text_column: "text"}) if d.text_column != "text" else ds


def _hf_stream_datasource(hfds: Any, column: str):
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    class HFStreamDatasource(Datasource):
        """A streaming Hugging Face dataset, one read task per contiguous group of its shards (in order)."""

        def estimate_inmemory_data_size(self) -> None:
            return None

        def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None, data_context=None):
            n = max(1, min(parallelism, getattr(hfds, "num_shards", getattr(hfds, "n_shards", 1)) or 1))

            def read(index: int) -> Iterator[pa.Table]:
                part = hfds.shard(num_shards=n, index=index, contiguous=True) if n > 1 else hfds
                rows = 0
                for batch in part.iter(batch_size=4096):
                    block = pa.table({column: pa.array(batch[column], pa.large_string())})
                    yield with_doc_ids(block, (index << 32) + rows)
                    rows += block.num_rows

            meta = BlockMetadata(num_rows=None, size_bytes=None, input_files=None, exec_stats=None)
            return [ReadTask(lambda i=i: read(i), meta, per_task_row_limit=per_task_row_limit) for i in range(n)]

    return HFStreamDatasource()


# ----------------------------------------------------------------------------------------------
# Entry points

def describe_source(d: "DataConfig") -> dict[str, Any]:
    """What identifies the corpus in the cache key and the manifest; cheap (file sizes and mtimes, no reads)."""
    if d.source == "builtin":
        files = builtin_module_files()
        return {"kind": "builtin", "python": platform.python_version(), "modules": len(files),
                "bytes": sum(p.stat().st_size for p in files), "max_documents": d.max_documents}
    if d.source == "files":
        files = resolve_files(d.path)
        listing = file_listing(files)
        digest = hashlib.sha256(json.dumps(listing).encode()).hexdigest()
        return {"kind": "files", "path": d.path, "files": len(files), "bytes": sum(x[1] for x in listing),
                "listing_sha256": digest, "text_column": d.text_column, "max_documents": d.max_documents}
    if d.source == "hf":
        desc: dict[str, Any] = {"kind": "hf", "name": d.hf_name, "config": d.hf_config, "split": d.hf_split,
                                "streaming": d.hf_streaming, "text_column": d.text_column,
                                "max_documents": d.max_documents}
        if d.path:
            listing = file_listing(resolve_files(d.path))
            desc["data_files_sha256"] = hashlib.sha256(json.dumps(listing).encode()).hexdigest()
        return desc
    raise DataSourceError(f"data.source={d.source!r} has no corpus to prepare; use builtin, files or hf")


def file_listing(files: list[str]) -> list[tuple[str, int, int]]:
    """(location, size, mtime in ns) per file: what the cache key hashes. Local files by their resolved path."""
    if not is_uri(files[0]) or is_local(files[0]):
        return [(str(Path(f).resolve()), os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]
    fs, _ = resolve(files[0])
    with explained(files[0], "data.path"):
        infos = fs.get_file_info([resolve(f)[1] for f in files])
    return [(f, i.size, i.mtime_ns or 0) for f, i in zip(files, infos)]


def blocks_at_least(d: "DataConfig") -> int | None:
    """The blocks `read_documents(d)` yields, where they can be counted without reading the corpus (at most its first
    megabyte); None where not (a Hugging Face dataset from the Hub). A lower bound, except for local files cut by
    data.max_documents, where it is an estimate from the first block. Each block is at most one tokenizer task, so a
    pool of more actors than this leaves some idle (pipeline/data/pack.py)."""
    if d.source == "builtin":
        items = builtin_items()
        blocks = min(BUILTIN_BLOCKS, len(items))
        if d.max_documents:  # a block holds at most ceil(items / blocks) documents
            blocks = min(blocks, -(-d.max_documents // -(-len(items) // blocks)))
        return max(1, blocks)
    if d.source == "hf" and d.path and not d.max_documents:
        # _read_hf's ~1 MB slices of the loaded Arrow table, whose text is larger than Parquet files and at least
        # half the size of JSON ones: half the files' bytes in MB is a lower bound
        return max(1, sum(size for _, size, _ in file_listing(resolve_files(d.path))) // BLOCK_BYTES // 2)
    if d.source != "files":
        return None
    files = resolve_files(d.path)
    total, docs_per_block = 0, None
    # _read_files: txt and json one block, jsonl ~1 MB blocks, parquet 1,024 rows
    for f, size, _ in file_listing(files):
        kind = file_kind(f)
        if kind == "jsonl":  # compressed: its compressed size, fewer blocks than it yields (still a lower bound)
            total += max(1, size // BLOCK_BYTES)
            if docs_per_block is None:  # the first ~1 MB block of the first .jsonl: how many documents a block holds
                with open_stream(f) as fh:  # a local file or one ranged read of an object
                    docs_per_block = max(1, sum(1 for line in fh.read(BLOCK_BYTES).splitlines() if line.strip()))
        elif kind == "parquet":
            import pyarrow.parquet as pq

            total += max(1, -(-pq.read_metadata(open_input(f)).num_rows // _PARQUET_BATCH_ROWS))
            docs_per_block = docs_per_block or _PARQUET_BATCH_ROWS
        else:
            total += 1
            docs_per_block = docs_per_block or 1
    if d.max_documents and total > 1:  # the first max_documents documents fill this many blocks (an estimate)
        total = min(total, -(-d.max_documents // (docs_per_block or 1)))
    return total


def read_documents(d: "DataConfig") -> "ray.data.Dataset":
    """The configured source as a Ray Dataset with a `text` column (string or binary) and, for files read
    here, a `replaced` column (invalid UTF-8 already replaced). Order is the source order (preserve_order)."""
    if d.source == "builtin":
        ds = read_builtin()
    elif d.source == "files":
        ds = _read_files(resolve_files(d.path), d.text_column)
    elif d.source == "hf":
        ds = _read_hf(d)
    else:
        raise DataSourceError(f"data.source={d.source!r} has no corpus to prepare; use builtin, files or hf")
    if d.max_documents:
        ds = ds.limit(d.max_documents)
    # Same source, same order: the packed stream, the shards and the tokenizer sample are then reproducible.
    ds.context.execution_options.preserve_order = True
    return ds


class TextSample:
    """The first `max_bytes` of cleaned text of `ds` (in source order), for tokenizer training: iterate it once.
    Unreadable records are skipped (the main pass counts them), or with on_bad_record=error the first one fails
    here. `stats` counts what was read, so an empty sample can say why (`nothing_usable`)."""

    def __init__(self, ds: "ray.data.Dataset", max_bytes: int, on_bad_record: str = "skip"):
        self.ds, self.max_bytes, self.on_bad_record = ds, max_bytes, on_bad_record
        self.stats = CleanStats()

    def __iter__(self) -> Iterator[str]:
        seen = 0
        for batch in self.ds.iter_batches(batch_size=256, batch_format="pyarrow"):
            texts, stats = clean_batch(batch)
            self.stats.add(stats)
            if self.on_bad_record == "error":
                check_bad_records(stats, self.on_bad_record, 1.0)
            for t in texts:
                yield t
                seen += len(t)
                if seen >= self.max_bytes:
                    return


def sample_texts(ds: "ray.data.Dataset", max_bytes: int, on_bad_record: str = "skip") -> TextSample:
    """TextSample(ds, max_bytes, on_bad_record): an iterable of the sample's texts that keeps its counts."""
    return TextSample(ds, max_bytes, on_bad_record)
