"""Text cleaning: every document goes through it, in the tokenizer actors of the Ray pipeline and in the
single-process baseline alike (bench/data_throughput.py).

    from pipeline.data.cleaning import clean_texts
    texts, stats = clean_texts(["a\x00b", "  ", None, b"\xff ok"])   # ["ab", "\ufffd ok"], CleanStats(documents=2, ...)

Invalid UTF-8 is replaced with U+FFFD and counted, NUL characters are removed and counted, empty and whitespace-only
documents (and JSON nulls) are dropped and counted. Nothing is dropped silently. Unreadable records, which a reader
(pipeline/data/corpus.py) emits as rows with a `bad_file` and a `bad_reason`, are counted per file in
CleanStats.bad_files and skipped; the driver decides from the counts whether the prepare fails
(pipeline/data/corpus.py: check_bad_records). Imports nothing from the project.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa

_SURROGATES = re.compile("[\ud800-\udfff]")


@dataclass
class CleanStats:
    documents: int = 0  # kept (non-empty after cleaning)
    dropped_empty: int = 0  # empty, whitespace-only or null
    replaced_invalid_utf8: int = 0  # invalid UTF-8 sequences (and lone surrogates) replaced by U+FFFD
    nul_removed: int = 0  # NUL characters deleted
    text_chars: int = 0  # characters of the kept documents
    bad_records: int = 0  # unreadable records (see the module docstring), skipped
    bad_files: dict[str, list] = field(default_factory=dict)  # file -> [bad records, first reason]

    def add(self, other: "CleanStats") -> None:
        for k, v in asdict(other).items():
            if k not in ("bad_files", "bad_records"):  # count_bad adds those
                setattr(self, k, getattr(self, k) + v)
        for f, (n, reason) in other.bad_files.items():
            self.count_bad(f, reason, n)

    def count_bad(self, file: str, reason: str, n: int = 1) -> None:
        entry = self.bad_files.setdefault(file, [0, reason])  # the first reason seen (source order) is kept
        entry[0] += n
        self.bad_records += n

    @property
    def records(self) -> int:
        """Records read: kept documents, dropped empty ones and unreadable ones."""
        return self.documents + self.dropped_empty + self.bad_records

    def first_bad_reason(self) -> str:
        return next(iter(self.bad_files.values()))[1] if self.bad_files else ""


def decode_utf8(data: bytes) -> tuple[str, int]:
    """Decode with invalid sequences replaced by U+FFFD; returns (text, number replaced)."""
    text = data.decode("utf-8", "replace")
    if "\ufffd" not in text:
        return text, 0
    return text, text.count("\ufffd") - data.count(b"\xef\xbf\xbd")


def fix_surrogates(text: str) -> tuple[str, int]:
    """Lone surrogates (from JSON escapes like \\ud800) cannot be UTF-8 encoded: replace them, count them."""
    try:
        text.encode("utf-8")
        return text, 0
    except UnicodeEncodeError:
        return _SURROGATES.subn("\ufffd", text)


def _as_list(values: Any) -> list | None:
    if values is None:
        return None
    return values.to_pylist() if hasattr(values, "to_pylist") else list(values)


def clean_batch(batch: pa.Table, source: str = "the corpus", kept_rows: list[int] | None = None
                ) -> tuple[list[str], CleanStats]:
    """clean_texts over a reader's block: `text`, and where the reader added them `replaced`, `bad_file`
    and `bad_reason`."""
    names = batch.column_names
    bad = (batch.column("bad_file"), batch.column("bad_reason")) if "bad_reason" in names else None
    return clean_texts(batch.column("text"), batch.column("replaced") if "replaced" in names else None, bad, source,
                       kept_rows)


def clean_texts(column: pa.Array | pa.ChunkedArray | list, replaced: Any = None, bad: Any = None,
                source: str = "the corpus", kept_rows: list[int] | None = None) -> tuple[list[str], CleanStats]:
    """Clean one batch of documents. `column` is string or binary (nulls allowed); `replaced` optionally
    carries per-row counts of invalid UTF-8 already replaced by a reader; `bad` optionally (files, reasons)
    per row, a reason marking an unreadable record. Unreadable records and non-text values (counted against
    `source`) are counted in stats.bad_files and skipped. Returns (kept texts, stats); `kept_rows`, when given, gets
    the batch row of each kept text (deduplication follows documents by their rows' ids)."""
    stats = CleanStats()
    bad_files, bad_reasons = (_as_list(bad[0]), _as_list(bad[1])) if bad is not None else (None, None)
    if isinstance(column, (pa.Array, pa.ChunkedArray)):
        if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
            try:
                column.validate(full=True)  # Parquet/Arrow strings are not guaranteed to be valid UTF-8
            except pa.ArrowInvalid:
                column = column.cast(pa.large_binary() if pa.types.is_large_string(column.type) else pa.binary())
        values = column.to_pylist()
    else:
        values = list(column)
    if replaced is not None:
        stats.replaced_invalid_utf8 += int(sum(x or 0 for x in (replaced.to_pylist() if hasattr(replaced, "to_pylist")
                                                                  else replaced)))
    out: list[str] = []
    for i, v in enumerate(values):
        if bad_reasons is not None and bad_reasons[i] is not None:
            stats.count_bad(bad_files[i], bad_reasons[i])
            continue
        if v is None:
            stats.dropped_empty += 1
            continue
        if isinstance(v, (bytes, bytearray, memoryview)):
            v, n = decode_utf8(bytes(v))
            stats.replaced_invalid_utf8 += n
        elif not isinstance(v, str):
            stats.count_bad(source, f"{source}: a document is a {type(v).__name__}, not text; point "
                                    "data.text_column at a string column")
            continue
        if "\x00" in v:
            stats.nul_removed += v.count("\x00")
            v = v.replace("\x00", "")
        if not v or v.isspace():
            stats.dropped_empty += 1
            continue
        v, n = fix_surrogates(v)
        stats.replaced_invalid_utf8 += n
        stats.documents += 1
        stats.text_chars += len(v)
        out.append(v)
        if kept_rows is not None:
            kept_rows.append(i)
    return out, stats
