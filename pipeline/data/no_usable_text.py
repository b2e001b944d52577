"""A corpus with no usable text, told in one line: before Ray starts when the first records can tell
(check_first_records), else once the whole corpus has been read (nothing_usable).

    from pipeline.data.no_usable_text import check_first_records, nothing_usable
    check_first_records(cfg.data)          # DataSourceError: "none of the first 3 records of ... is usable ..."
    raise DataSourceError(nothing_usable(cfg.data, stats))   # after a prepare that kept no document

Tests: tests/pipeline/data/test_no_usable_text.py and tests/pipeline/data/test_corpus.py.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa

from pipeline.data.cleaning import CleanStats
from pipeline.data.corpus import (BLOCK_BYTES, DataSourceError, check_parquet_column, file_listing, file_kind,
                                  open_stream, read_document_file, resolve_files)

if TYPE_CHECKING:
    from pipeline.config import DataConfig


def corpus_name(d: "DataConfig") -> str:
    """The corpus as a message names it."""
    if d.source == "files":
        return f"data.path={d.path!r}"
    if d.source == "hf":
        return f"Hugging Face dataset {d.hf_name}{f' ({d.hf_config})' if d.hf_config else ''}, split {d.hf_split}"
    return "the built-in corpus"


def nothing_usable(d: "DataConfig", stats: CleanStats) -> str:
    """One line for a corpus that gave no text at all: how many records, why none counted (the first unreadable
    one names its file, line and the fields it has), and what to set."""
    if not stats.records:
        return f"no text in {corpus_name(d)}: it holds no records (empty files?); point data.path at the corpus"
    parts = []
    if stats.bad_records:
        parts.append(f"{stats.bad_records:,} unreadable (the first: {stats.first_bad_reason()})")
    if stats.dropped_empty:
        parts.append(f"{stats.dropped_empty:,} empty or whitespace-only")
    return (f"no text in {corpus_name(d)}: {stats.records:,} records read, none with text: {'; '.join(parts)}; "
            f"check data.path and data.text_column={d.text_column!r}")


def check_first_records(d: "DataConfig") -> None:
    """Before Ray starts, in seconds instead of after it: a local or object-storage corpus (data.source=files)
    whose files are all empty, or whose first file with records has none with data.text_column among its first
    records (its first MiB), fails with one line naming the file, the field and the fields it has. The reads are
    one ranged read of one file (Parquet: its schema) and the listing the cache key makes anyway."""
    if d.source != "files":
        return
    files = resolve_files(d.path)
    listing = file_listing(files)
    nonempty = [f for f, size, _ in listing if size > 0]
    if not nonempty:
        names = ", ".join(Path(f).name for f in files[:3]) + (", ..." if len(files) > 3 else "")
        raise DataSourceError(f"no text in data.path={d.path!r}: its {len(files)} file(s) ({names}) are empty; "
                              "point data.path at the corpus")
    kind_of = {f: file_kind(f) for f in nonempty}
    first_parquet = next((f for f in nonempty if kind_of[f] == "parquet"), None)
    if first_parquet:
        check_parquet_column([first_parquet], d.text_column)
    first_json = next((f for f in nonempty if kind_of[f] in ("jsonl", "json")), None)
    if first_json is None:
        return
    with open_stream(first_json) as fh:
        head = fh.read(BLOCK_BYTES)
    if kind_of[first_json] == "json" and len(head) == BLOCK_BYTES:
        return  # a .json file is one document: its first MiB alone does not parse
    blocks = read_document_file(io.BytesIO(head), first_json, kind_of[first_json], d.text_column)
    table = pa.concat_tables(list(blocks)) if head.strip() else None
    if table is None or table.num_rows == 0:
        return
    if len(head) == BLOCK_BYTES and table.num_rows > 1:  # the last line may be cut at the MiB boundary
        table = table.slice(0, table.num_rows - 1)
    reasons = table.column("bad_reason").to_pylist()
    if all(r is not None for r in reasons):  # no record read there has the field
        raise DataSourceError(f"none of the first {len(reasons):,} records of {first_json} is usable (checked before "
                              f"any Ray work); the first: {reasons[0]}")
