"""The data audit: an append-only record of the seq_ids each step consumed (one JSON line per step and rank), so a
run's data order can be checked after the fact. Ray-free.

    audit = AuditLog(run_dir / "data_audit" / "rank_0.jsonl")     # or a URI on object storage
    audit.write(engine, outcome, micro)    # the loop's on_step hook (pipeline/train/loop.py standard_hooks)
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pipeline.train.engine import Engine, StepOutcome


def final_lines(lines: list[dict], ranges: list[dict]) -> list[dict]:
    """The audit lines of the steps a run kept: for each (phase, epoch, cursor, rank) the last line written (a restart
    or a rewind redid that step), less the steps inside a range of rows a rewind skipped (what it abandoned).
    `lines` in the order each rank wrote them (a line from several ranks' files carries `rank`); `ranges`: the run's
    skipped ranges (pipeline/train/spike_record.py summary's `skipped_rows`). "Every row once" is then: these lines'
    rows, and the skipped ranges' rows, are each row of the epoch once."""
    last: dict[tuple, dict] = {}
    for line in lines:
        last[(line["phase"], line["epoch"], line["cursor"], line.get("rank", 0))] = line

    def skipped(line: dict) -> bool:  # a step's rows end at its cursor; ranges begin at step boundaries
        return any(r["phase"] == line["phase"] and r["epoch"] == line["epoch"]
                   and r["start"] < line["cursor"] <= r["end"] for r in ranges)

    return [line for line in last.values() if not skipped(line)]


class AuditLog:
    """Append-only record of the seq_ids each step consumed (one JSON line per step), so a run's data order can
    be checked after the fact: exactly once per epoch, across restarts. Over a mixture each line also has `sources`
    and `passes` beside `seq_ids` (the row's source index in data.mixture and its pass over that source).

    On a local path every line is flushed as it is written. Object storage cannot append: the log is kept in
    memory and the whole object rewritten at `flush` (each checkpoint, and at the end), starting from what an
    earlier attempt of the same rank left; lines after the last flush belong to steps that a restart redoes."""

    def __init__(self, path: str | Path, extra: dict | None = None):
        from pipeline.storage import is_local, read_bytes, resolve

        self.path, self.extra = str(path), dict(extra or {})
        self._f, self._lines, self._dirty = None, [], False
        if is_local(self.path):
            local = Path(resolve(self.path)[1])
            local.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(local, "a", buffering=1)
        else:
            try:
                self._lines.append(read_bytes(self.path).decode())
            except FileNotFoundError:
                pass

    def write(self, engine: Engine, outcome: StepOutcome, micro: list[dict[str, torch.Tensor]]) -> None:
        import json
        import os

        ids = [int(i) for b in micro for i in b["seq_id"]]
        # A mixture's rows: seq_ids are per source dataset, so each row also names its source and pass
        mixed = {k: [int(i) for b in micro for i in b[k]] for k in ("source", "pass") if k in micro[0]}
        # cursor: the data cursor after the step (its rows are the positions just before it in the epoch's order)
        line = json.dumps({"step": engine.step, "time": time.time(), "skipped": outcome.skipped, "epoch": engine.epoch,
                           "cursor": engine.cursor, "phase": engine.phase, "pid": os.getpid(), **self.extra,
                           "seq_ids": ids,
                           **({"sources": mixed["source"], "passes": mixed["pass"]} if mixed else {})}) + "\n"
        if self._f is not None:
            self._f.write(line)
        else:
            self._lines.append(line)
            self._dirty = True

    def flush(self) -> None:
        if self._f is None and self._dirty:
            from pipeline.storage import write_text

            write_text(self.path, "".join(self._lines))
            self._dirty = False

    def close(self) -> None:
        self.flush()
        if self._f is not None:
            self._f.close()
