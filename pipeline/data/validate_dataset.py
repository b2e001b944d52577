"""Validate a packed dataset against its manifest and print what it holds (`validate_dataset`).

    python pipeline/run.py validate runs/datasets/<hash>
    python pipeline/run.py validate s3://bucket/longtrain/datasets/<hash>

Checks, each failure a line naming the file and what is wrong:
  manifest present and readable; tokenizer.model sha256, vocab size and special ids as recorded;
  every shard present with the recorded sha256 and row count, readable (page checksums), schema as specified;
  token ids below vocab_size; every doc_start sits right after an EOS and every EOS inside a row starts a
  document; seq_ids unique and dense over all splits, each in the split its hash assigns; totals (sequences,
  tokens kept, EOS count, vocab used) as recorded; decode -> encode round trip of whole documents found in a
  sample of rows. Reported, not checked: how the dataset was deduplicated (its manifest) and which validation rows
  hold a document that also occurs in training (pipeline/data/contamination.py). Ray-free.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.data.dedup import summary_line
from pipeline.data.shards import DatasetError, Manifest, load_manifest, shard_schema
from pipeline.data.tokenizer import Tokenizer, TokenizerError, file_sha256
from pipeline.storage import absolute, is_file, join, read_bytes


@dataclass
class ValidationReport:
    dataset_dir: str
    errors: list[str] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.errors

    def raise_if_failed(self) -> None:
        if self.errors:
            raise DatasetError(f"dataset {self.dataset_dir!r} is invalid: " + "; ".join(self.errors))

    def format(self) -> str:
        s = self.stats
        lines = [f"dataset {self.dataset_dir}"]
        if "sequences" in s:
            dl = s.get("doc_length", {})
            c = s.get("counts", {})
            lines += [
                f"  sequences      {s['sequences']:,} (train {s['rows'].get('train', 0):,}, "
                f"val {s['rows'].get('val', 0):,}) of seq_len {s['seq_len']} + 1",
                f"  tokens         {s['tokens']:,} in shards, {c.get('tokens_total', 0):,} in the corpus stream",
                f"  packing        efficiency {s['packing_efficiency']:.4%} "
                f"({c.get('tokens_dropped_remainder', 0):,} tokens in the dropped final partial window)",
                f"  vocab used     {s['vocab_used']:,} of {s['vocab_size']:,} ids",
                f"  documents      {c.get('documents', 0):,} kept; {c.get('dropped_empty', 0):,} empty dropped; "
                f"{c.get('replaced_invalid_utf8', 0):,} invalid UTF-8 sequences replaced; "
                f"{c.get('nul_removed', 0):,} NULs removed",
                f"  bad records    {c.get('bad_records', 0):,} unreadable records skipped"
                + "".join(f"\n                   {f}: {b['count']:,} (first: {b['first']})"
                          for f, b in s.get("bad_records", {}).items()),
                f"  doc length     mean {dl.get('mean', 0):.1f} tokens, min {dl.get('min', 0)}, "
                f"p50 ~{dl.get('p50_approx', 0)}, p90 ~{dl.get('p90_approx', 0)}, p99 ~{dl.get('p99_approx', 0)}, "
                f"max {dl.get('max', 0)}",
                f"  round trip     {s.get('round_trip', 'not run')}",
                f"  dedup          {summary_line(s.get('dedup') or {})}",
            ]
            if "contamination" in s:
                lines.append(f"  contamination  {s['contamination'].line()}")
        lines.append("  OK" if self.ok else "  INVALID:\n" + "\n".join(f"    - {e}" for e in self.errors))
        return "\n".join(lines)


def validate_dataset(dataset_dir: Path | str, *, sample_windows: int = 16, contamination: bool = True
                     ) -> ValidationReport:
    """Check a dataset against its manifest; returns a report with any failures (never raises for bad data).
    `contamination`: also report the validation rows whose documents occur in training (pipeline/data/contamination.py;
    it decodes every document once), a finding, not a failure."""
    dataset_dir = absolute(dataset_dir)
    report = ValidationReport(dataset_dir)
    try:
        m = load_manifest(dataset_dir)
    except DatasetError as exc:
        report.errors.append(str(exc))
        return report
    tok = _check_tokenizer(dataset_dir, m, report.errors)
    scan = _Scan(m, tok, sample_windows)
    rows: dict[str, int] = {}
    for split, shards in m.shards.items():
        rows[split] = 0
        for shard in shards:
            err = scan.shard(join(dataset_dir, shard.file), split, shard.rows, shard.sha256)
            if err:
                report.errors.append(f"{shard.file}: {err}")
            rows[split] += shard.rows
    report.errors += scan.finish()
    total = sum(rows.values())
    c = m.counts
    expect = {"sequences": (c.get("sequences"), total), "tokens_kept": (c.get("tokens_kept"), total * m.window),
              "eos_in_shards": (c.get("eos_in_shards"), scan.eos),
              "vocab_used": (c.get("vocab_used"), int(np.count_nonzero(scan.token_counts)))}
    if not report.errors:  # totals only mean something when every shard was read
        for name, (recorded, found) in expect.items():
            if recorded is not None and recorded != found:
                report.errors.append(f"manifest counts.{name}={recorded} but the shards hold {found}")
    report.stats = {"sequences": total, "rows": rows, "seq_len": m.seq_len, "tokens": total * m.window,
                    "vocab_size": m.vocab_size, "vocab_used": int(np.count_nonzero(scan.token_counts)),
                    "packing_efficiency": m.packing_efficiency, "doc_length": m.doc_length, "counts": m.counts,
                    "bad_records": m.bad_records, "dedup": m.dedup,
                    "round_trip": scan.round_trip(tok, report.errors)}
    if contamination and tok is not None and not report.errors:
        from pipeline.data.contamination import contamination as check

        report.stats["contamination"] = check(dataset_dir, m, tok)
    return report


def _check_tokenizer(dataset_dir: str, m: Manifest, errors: list[str]) -> Tokenizer | None:
    path = join(dataset_dir, m.tokenizer_file)
    if not is_file(path):
        errors.append(f"{m.tokenizer_file} is missing; the dataset cannot be decoded: prepare it again")
        return None
    sha = file_sha256(path)
    if sha != m.tokenizer_sha256:
        errors.append(f"{m.tokenizer_file} sha256 {sha[:12]}... does not match the manifest's "
                      f"{m.tokenizer_sha256[:12]}...: the shards were tokenized with another tokenizer; restore "
                      "the original file or prepare the dataset again")
        return None
    try:
        tok = Tokenizer(path)
    except TokenizerError as exc:
        errors.append(str(exc))
        return None
    recorded = {"vocab_size": m.vocab_size, "pad_id": m.pad_id, "unk_id": m.unk_id, "bos_id": m.bos_id,
                "eos_id": m.eos_id}
    for name, value in recorded.items():
        if getattr(tok, name) != value:
            errors.append(f"tokenizer {name}={getattr(tok, name)} but the manifest records {value}")
    return tok


class _Scan:
    """Streams every row group once, accumulating what the global checks need."""

    def __init__(self, m: Manifest, tok: Tokenizer | None, sample_windows: int):
        self.m = m
        self.width = m.window
        self.n = int(m.counts.get("sequences", sum(m.rows(s) for s in m.shards)))
        self.seen = np.zeros(self.n, bool)
        self.duplicates = self.out_of_range = 0
        self.eos = 0
        self.token_counts = np.zeros(m.vocab_size, np.int64)
        # Round-trip samples: runs of consecutive seq_ids (consecutive windows are contiguous in the stream),
        # ~8k tokens each, so whole documents longer than one row can be checked too.
        run = max(2, -(-8192 // self.width))
        starts = np.unique(np.linspace(0, max(0, self.n - run), num=max(1, sample_windows // 2)).astype(np.int64))
        self.sample_runs = [np.arange(s, min(self.n, s + run)) for s in starts]
        self.sample_ids = np.unique(np.concatenate(self.sample_runs)) if self.n else np.zeros(0, np.int64)
        self.sample_rows: dict[int, np.ndarray] = {}
        rule = m.extra.get("split_rule")
        if rule:
            from pipeline.data.shard_plan import SplitRule

            self.rule = SplitRule(**rule)
        else:
            self.rule = None

    def shard(self, path: str, split: str, rows: int, sha256: str) -> str | None:
        try:  # one read (one download from object storage) for both the hash and the parse
            data = read_bytes(path)
        except FileNotFoundError:
            return "file is missing"
        if hashlib.sha256(data).hexdigest() != sha256:
            return "sha256 does not match the manifest (the file was changed, truncated or corrupted)"
        try:
            pf = pq.ParquetFile(pa.BufferReader(data), page_checksum_verification=True)
        except (OSError, pa.ArrowException) as exc:
            return f"not readable as Parquet ({str(exc).splitlines()[0]})"
        expected = shard_schema(self.m.seq_len, self.m.vocab_size)
        if not pf.schema_arrow.equals(expected):
            return f"schema {pf.schema_arrow} differs from the expected {expected}"
        if pf.metadata.num_rows != rows:
            return f"{pf.metadata.num_rows} rows but the manifest says {rows}"
        for g in range(pf.num_row_groups):
            try:
                err = self._row_group(pf.read_row_group(g), split)
            except (OSError, pa.ArrowException) as exc:
                err = f"row group {g} unreadable ({str(exc).splitlines()[0]})"
            if err:
                return f"row group {g}: {err}" if not err.startswith("row group") else err
        return None

    def _row_group(self, table: pa.Table, split: str) -> str | None:
        tokens = table.column("tokens").combine_chunks().flatten().to_numpy().reshape(-1, self.width)  # (R, T+1)
        if tokens.size and int(tokens.max()) >= self.m.vocab_size:
            return f"token id {int(tokens.max())} >= vocab_size {self.m.vocab_size}"
        ds = table.column("doc_starts").combine_chunks()
        lengths = pc.list_value_length(ds).fill_null(0).to_numpy()
        starts = pc.list_flatten(ds).to_numpy()
        rows, cols = np.nonzero(tokens[:, :-1] == self.m.eos_id)
        if len(starts) != len(cols) or not (np.array_equal(np.repeat(np.arange(len(tokens)), lengths), rows)
                                            and np.array_equal(starts, cols + 1)):
            return "doc_starts do not match the EOS positions (every boundary must follow an EOS)"
        seq = table.column("seq_id").to_numpy()
        inside = (seq >= 0) & (seq < self.n)
        self.out_of_range += int(np.count_nonzero(~inside))
        seq_in = seq[inside]
        self.duplicates += int(np.count_nonzero(self.seen[seq_in])) + len(seq_in) - len(np.unique(seq_in))
        self.seen[seq_in] = True
        if self.rule is not None and np.any(self.rule.is_val(seq_in) != (split == "val")):
            return f"rows whose seq_id hashes to the other split are in {split}"
        self.eos += int(np.count_nonzero(tokens == self.m.eos_id))
        self.token_counts += np.bincount(tokens.reshape(-1), minlength=self.m.vocab_size)[:self.m.vocab_size]
        for i in np.flatnonzero(np.isin(seq, self.sample_ids)):
            self.sample_rows[int(seq[i])] = tokens[i].astype(np.int64)
        return None

    def finish(self) -> list[str]:
        errors = []
        if self.out_of_range:
            errors.append(f"{self.out_of_range} seq_ids outside 0..{self.n - 1}")
        if self.duplicates:
            errors.append(f"{self.duplicates} duplicate seq_ids")
        missing = int(np.count_nonzero(~self.seen))
        if missing and not errors:
            errors.append(f"{missing} seq_ids of 0..{self.n - 1} are missing (seq_ids must be dense)")
        return errors

    def round_trip(self, tok: Tokenizer | None, errors: list[str]) -> str:
        """decode -> encode of every whole document (between two EOS) inside the sampled runs of rows."""
        if tok is None:
            return "skipped (no usable tokenizer)"
        checked = 0
        runs = [np.concatenate([self.sample_rows[int(i)] for i in r]) for r in self.sample_runs
                if all(int(i) in self.sample_rows for i in r)]
        for row in runs:
            ends = np.flatnonzero(row == self.m.eos_id)
            for a, b in zip(ends[:-1], ends[1:]):
                ids = row[a + 1:b].tolist()
                if not ids:
                    continue
                again = tok.encode(tok.decode(ids))
                checked += 1
                if again != ids:
                    errors.append(f"decode/encode round trip changed a document ({len(ids)} ids -> {len(again)}); "
                                  "the shards do not match the tokenizer")
                    return f"FAILED after {checked} documents"
        if checked == 0:
            return f"no whole document inside the {len(runs)} sampled runs of {self.sample_runs[0].size} rows"
        return f"ok on {checked} whole documents from {len(runs)} sampled runs of {self.sample_runs[0].size} rows"
