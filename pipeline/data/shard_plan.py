"""Where every window of the token stream goes, and writing the shards while the stream still grows.

    planner = ShardPlanner(val_fraction, seed, rows_per_shard)
    specs = planner.advance(windows_known)            # shards that became final; then planner.finish(...)
    ShardWriters(...).submit(spec, *segments.covering(...), rule)   # a Ray task writes each one

Window w is tokens [w*(T+1), (w+1)*(T+1)) of the stream, seq_id = w; SplitRule hashes (w, seed) to train
or val; shard k of a split holds that split's windows k*R .. (k+1)*R-1. See pipeline/data/pack.py for the
pipeline around it.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pyarrow as pa

from pipeline.data.shards import (DatasetError, rows_per_row_group, shard_schema, token_numpy_type, windows_table,
                                  write_shard)
from pipeline.storage import StorageError, exists, is_local, join, read_bytes, resolve

PARTS_DIR = "_parts"


@dataclass(frozen=True)
class SplitRule:
    """Window id -> split, from a hash of (id, seed): reproducible anywhere without a global table."""
    n_windows: int
    val_fraction: float
    seed: int
    force_last_val: bool = False

    def is_val(self, ids: np.ndarray) -> np.ndarray:
        x = np.asarray(ids, np.uint64) + np.uint64((self.seed * 0x9E3779B97F4A7C15 + 1) % (1 << 64))
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)  # splitmix64 finalizer
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
        val = (x >> np.uint64(11)).astype(np.float64) / float(1 << 53) < self.val_fraction
        if self.force_last_val:
            val |= np.asarray(ids) == self.n_windows - 1
        return val


class ShardPlanner:
    """Shards as the stream grows: shard k of a split = that split's windows k*R .. (k+1)*R-1, final once the
    split's window k*R+R (the first of shard k+1) is known. O(#shards) memory (one first-id per shard)."""

    def __init__(self, val_fraction: float, seed: int, rows_per_shard: int):
        self.rule = SplitRule(1 << 62, val_fraction, seed)  # n_windows only matters with force_last_val
        self.rows = rows_per_shard
        self.known = 0  # windows scanned so far
        self.counts = {"train": 0, "val": 0}
        self.firsts: dict[str, list[int]] = {"train": [], "val": []}  # first window id of each shard
        self.handed = {"train": 0, "val": 0}  # shards handed out

    def advance(self, n_known: int, chunk: int = 1 << 20) -> list[dict]:
        """Scan windows up to n_known; returns the specs of the shards that became final."""
        for c0 in range(self.known, n_known, chunk):
            ids = np.arange(c0, min(n_known, c0 + chunk))
            val = self.rule.is_val(ids)
            for split, sel in (("train", ids[~val]), ("val", ids[val])):
                self.firsts[split] += sel[(-self.counts[split]) % self.rows::self.rows].tolist()
                self.counts[split] += len(sel)
        self.known = max(self.known, n_known)
        return self._hand_out(final=False)

    def finish(self, n_windows: int, force_last_val: bool) -> list[dict]:
        """The remaining shards once the stream is complete (n_windows == windows scanned). force_last_val moves
        the last window from train to val (only when val got none): it only touches train's last shard."""
        assert n_windows == self.known
        if force_last_val and self.counts["val"] == 0 and n_windows:
            self.counts["train"] -= 1
            if self.firsts["train"] and self.firsts["train"][-1] == n_windows - 1:
                self.firsts["train"].pop()
            self.counts["val"], self.firsts["val"] = 1, [n_windows - 1]
        return self._hand_out(final=True)

    def lowest_pending(self) -> int:
        """The lowest window id a shard not yet handed out may contain."""
        return min([self.firsts[s][self.handed[s]] for s in self.firsts if self.handed[s] < len(self.firsts[s])]
                   + [self.known])

    def _hand_out(self, final: bool) -> list[dict]:
        specs = []
        for split in ("train", "val"):
            starts = self.firsts[split]
            while self.handed[split] + (0 if final else 1) < len(starts):
                k = self.handed[split]
                stop = starts[k + 1] if k + 1 < len(starts) else self.known
                specs.append({"split": split, "index": k, "file": f"{split}-{k:05d}.parquet", "first": starts[k],
                              "stop": stop, "rows": min(self.rows, self.counts[split] - k * self.rows)})
                self.handed[split] += 1
        return specs


def plan_shards(rule: SplitRule, rows_per_shard: int, chunk: int = 1 << 20) -> tuple[list[dict], dict[str, int]]:
    """Every shard spec {split, index, file, first, stop, rows} of a complete stream of rule.n_windows windows
    (what ShardPlanner hands out piecemeal, in split order); and the rows per split."""
    planner = ShardPlanner(rule.val_fraction, rule.seed, rows_per_shard)
    specs = planner.advance(rule.n_windows, chunk) + planner.finish(rule.n_windows, rule.force_last_val)
    specs.sort(key=lambda sp: (sp["split"] != "train", sp["index"]))
    return specs, dict(planner.counts)


class TokenStream:
    """A range of the corpus token stream, as segments (file, offset in the file, tokens) of part files laid end to
    end from global token `base`; reads any range without loading the rest. On a local disk the parts are
    memory-mapped; on object storage each part (one tokenizer batch, well under a MiB to a few MiB) is fetched
    whole on first use and the last few kept: a shard's windows come in increasing order, so every part is one
    GET, even for the val split's scattered windows."""

    KEEP_PARTS = 8

    def __init__(self, parts_dir: Path | str, segments: list[tuple[str, int, int]], base: int, dtype: np.dtype):
        self.parts_dir, self.dtype = str(parts_dir), np.dtype(dtype)
        self.local = is_local(self.parts_dir)
        self.segments = [sg for sg in segments if sg[2] > 0]
        self.offsets = base + np.concatenate([[0], np.cumsum([n for _, _, n in self.segments])]).astype(np.int64)
        self._parts: OrderedDict[str, np.ndarray] = OrderedDict()

    def _piece(self, file: str, offset: int, n: int) -> np.ndarray:
        part = self._parts.get(file)
        if part is None:
            where = join(self.parts_dir, file)
            part = (np.memmap(resolve(where)[1], dtype=self.dtype, mode="r") if self.local
                    else np.frombuffer(read_bytes(where), self.dtype))
            self._parts[file] = part
            if not self.local and len(self._parts) > self.KEEP_PARTS:
                self._parts.popitem(last=False)
        else:
            self._parts.move_to_end(file)
        return part[offset:offset + n]

    def read(self, start: int, stop: int) -> np.ndarray:
        out = []
        i = int(np.searchsorted(self.offsets, start, side="right") - 1)
        while start < stop:
            file, file_offset, _ = self.segments[i]
            take = min(stop, int(self.offsets[i + 1])) - start
            out.append(self._piece(file, file_offset + start - int(self.offsets[i]), take))
            start += take
            i += 1
        return np.concatenate(out) if len(out) != 1 else np.array(out[0])

    def windows(self, ids: np.ndarray, width: int) -> np.ndarray:
        """(len(ids), width) windows; each run of consecutive ids is one contiguous read."""
        breaks = np.flatnonzero(np.diff(ids) != 1) + 1
        runs = [self.read(int(r[0]) * width, (int(r[-1]) + 1) * width).reshape(-1, width)
                for r in np.split(ids, breaks) if len(r)]
        return np.concatenate(runs) if len(runs) != 1 else runs[0]


class SegmentIndex:
    """The driver's ordered list of batches (global start, file, offset, tokens), pruned as shards are handed
    out: only what pending shards can still need is kept."""

    def __init__(self) -> None:
        self.items: "deque[tuple[int, str, int, int]]" = deque()
        self.total = 0
        self.count = 0  # batches seen

    def append(self, file: str, offset: int, tokens: int) -> None:
        self.items.append((self.total, file, offset, tokens))
        self.total += tokens
        self.count += 1

    def covering(self, start: int, stop: int) -> tuple[list[tuple[str, int, int]], int]:
        """(segments, base): the batches overlapping tokens [start, stop), and the global start of the first."""
        got = [it for it in self.items if it[0] < stop and it[0] + it[3] > start]
        return [(f, o, n) for _, f, o, n in got], (got[0][0] if got else start)

    def drop_before(self, token: int) -> None:
        while self.items and self.items[0][0] + self.items[0][3] <= token:
            self.items.popleft()


def write_planned_shard(spec: dict, *, out_dir: str, segments: list, base: int, rule: dict, seq_len: int,
                        vocab_size: int, eos_id: int) -> dict:
    """Ray task: cut one planned shard's windows out of the parts and write it into the build directory
    `out_dir` (a path or a URI)."""
    dtype = token_numpy_type(vocab_size)
    stream = TokenStream(join(out_dir, PARTS_DIR), [tuple(sg) for sg in segments], base, dtype)
    split_rule = SplitRule(**rule)
    ids = np.arange(spec["first"], spec["stop"], dtype=np.int64)
    val = split_rule.is_val(ids)
    ids = ids[val] if spec["split"] == "val" else ids[~val]
    ids = ids[:spec["rows"]]
    group = rows_per_row_group(seq_len, vocab_size)
    used = np.zeros(vocab_size, bool)
    eos = 0

    def tables() -> Iterable[pa.Table]:
        nonlocal eos
        for i in range(0, len(ids), group):
            chunk = ids[i:i + group]
            windows = stream.windows(chunk, seq_len + 1)  # (rows, T+1)
            used[np.bincount(windows.reshape(-1), minlength=vocab_size) > 0] = True
            eos += int(np.count_nonzero(windows == eos_id))
            yield windows_table(windows, chunk, eos_id, vocab_size)

    try:
        info = write_shard(join(out_dir, spec["file"]), tables(), shard_schema(seq_len, vocab_size))
    except (OSError, StorageError):
        if _removed(join(out_dir, PARTS_DIR)):  # the build failed or was interrupted and is gone: nothing to write
            return {"split": spec["split"], "index": spec["index"], ABANDONED: True}
        raise
    return {"split": spec["split"], "index": spec["index"], "file": info.file, "rows": info.rows,
            "sha256": info.sha256, "eos": eos, "used": np.packbits(used).tobytes()}


ABANDONED = "abandoned"  # a writer's result when the build it wrote into had been removed under it


def _removed(where: str) -> bool:
    try:
        return not exists(where)
    except Exception:  # noqa: BLE001 -- a store that cannot say: the writer's own error is the better report
        return False


class ShardWriters:
    """Ray tasks writing handed-out shards while tokenization goes on; at most `in_flight` at a time (each
    holds its segment list; the results are small)."""

    def __init__(self, in_flight: int, **kw: Any):
        import ray

        self.remote = ray.remote(num_cpus=1, max_retries=2)(write_planned_shard)
        self.in_flight, self.kw = in_flight, kw
        self.pending: list = []
        self.done: list[dict] = []

    def submit(self, spec: dict, segments: list, base: int, rule: dict) -> None:
        import ray

        if len(self.pending) >= self.in_flight:
            ready, self.pending = ray.wait(self.pending, num_returns=len(self.pending) - self.in_flight + 1)
            self.done += _written(ray.get(ready))
        self.pending.append(self.remote.remote(spec, segments=segments, base=base, rule=rule, **self.kw))

    def results(self) -> list[dict]:
        import ray

        self.done += _written(ray.get(self.pending))
        self.pending = []
        return self.done

    def drain(self, wait_s: float = 120.0) -> None:
        """After a failure: wait (up to wait_s) until the writers still running have ended, so that none of them
        still reads the parts when the caller removes the build, and fetch their errors (a task whose error nobody
        fetched is printed by Ray as an "Unhandled error" traceback when the driver exits, after the one line).
        Each writes one shard and there are at most `in_flight`, so this is seconds; a writer still running after
        that finds the parts gone and ends without an error (write_planned_shard). Not ray.cancel: cancelling a
        task while its reply arrives crashes the driver's core worker in Ray ("Check failed: it !=
        submissible_tasks_.end() Tried to complete task that was not pending", ray-project/ray#54846)."""
        import ray

        if self.pending and wait_s > 0:
            ray.wait(self.pending, num_returns=len(self.pending), timeout=wait_s)
        for ref in self.pending:
            try:
                ray.get(ref, timeout=0)
            except Exception:  # noqa: BLE001 -- failed as the build failed, or still running: both expected
                pass
        self.pending = []


def _written(results: list[dict]) -> list[dict]:
    """The writers' results, refused in one line when a writer found the build directory gone while the build was
    still going on (only a failed or interrupted build removes it; here something else did)."""
    for r in results:
        if r.get(ABANDONED):
            raise DatasetError(f"the {r['split']} shard {r['index']}'s parts were removed while it was being written "
                               f"(another process deleted the build directory?); run prepare again")
    return results
