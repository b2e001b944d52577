"""A run's record of its loss spikes: every skip, rewind and stop, and the rows the rewinds skipped, in
`<run storage>/spikes.json` (beside run.json for a run on local disk). Rank 0 writes it as the events happen (before a
rewind loads anything, so a restart knows of it); a restart reads it (pipeline/train/spike_rewind.py reconcile), the
driver copies its summary into run.json and draws its events on the loss curve, and `validate RUN` lists it.
Imports neither torch nor Ray.

    record = SpikeRecord(join(run_storage, RECORD_FILE))
    index = record.add(event)              # {"kind": "skip" | "applied" | "rewind" | "stop", "phase", "step", ...}
    events = read_events(run_storage)      # [] when the run had none
    print("\\n".join(report_lines(events)))

An event is keyed by (kind, phase, timeline, attempt): timeline counts the rewinds before it, attempt the steps taken
or skipped along it. A restart that replays steps after its checkpoint meets the same outliers again at the same keys,
and the record keeps one event for each.
"""
from __future__ import annotations

import json
from typing import Any

RECORD_FILE = "spikes.json"
KINDS = ("skip", "applied", "rewind", "stop")


def _key(event: dict[str, Any]) -> tuple:
    return tuple(event.get(k) for k in ("kind", "phase", "timeline", "attempt"))


def read_events(run_store: str) -> list[dict[str, Any]]:
    """The events of the run whose storage is `run_store` (a path or URI), oldest first; [] when there are none."""
    from pipeline.storage import join, read_text

    try:
        return list(json.loads(read_text(join(run_store, RECORD_FILE))).get("events", []))
    except FileNotFoundError:
        return []


def rewinds_of(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The run's rewinds in order, each as the guard keeps it (pipeline/train/spike_guard.py `rewinds`)."""
    return [e["rewind"] for e in events if e.get("kind") == "rewind"]


class SpikeRecord:
    """Rank 0's writer of spikes.json: the whole file rewritten at each event (atomic: a temp file renamed, or one PUT
    on object storage); events are rare, the file small."""

    def __init__(self, location: str):
        self.location = location
        self.events: list[dict[str, Any]] | None = None  # read on first use

    def add(self, event: dict[str, Any]) -> int:
        """Record `event` (replacing one of the same key: a replayed step); returns its index in the run's list."""
        from pipeline.storage import read_text, write_text

        if self.events is None:
            try:
                self.events = list(json.loads(read_text(self.location)).get("events", []))
            except FileNotFoundError:
                self.events = []
        keys = [_key(e) for e in self.events]
        if _key(event) in keys:
            index = keys.index(_key(event))
            self.events[index] = event
        else:
            index = len(self.events)
            self.events.append(event)
        write_text(self.location, json.dumps({"events": self.events}, indent=1, sort_keys=True))
        return index


def describe_range(r: dict[str, int]) -> str:
    """`rows 800-2399 of epoch 0 (phase 0)`: positions in that epoch's order, as the data cursor counts them."""
    return f"rows {r['start']}-{r['end'] - 1} of epoch {r['epoch']} (phase {r['phase']})"


def summary(events: list[dict[str, Any]]) -> dict[str, Any]:
    """What run.json records under `spikes`: counts and every skipped range."""
    ranges = [r for rw in rewinds_of(events) for r in rw["ranges"]]
    return {"skipped_steps": sum(e["kind"] == "skip" for e in events),
            "applied_outliers": sum(e["kind"] == "applied" for e in events),
            "rewinds": sum(e["kind"] == "rewind" for e in events), "stopped": any(e["kind"] == "stop" for e in events),
            "skipped_rows": ranges, "rows_skipped": sum(r["end"] - r["start"] for r in ranges)}


def report_lines(events: list[dict[str, Any]]) -> list[str]:
    """`validate RUN`'s section: one line per event, then the skipped rows."""
    if not events:
        return ["spikes: none (no step was an outlier)"]
    s = summary(events)
    lines = [f"spikes: {s['skipped_steps']} step(s) skipped, {s['applied_outliers']} outlier(s) applied, "
             f"{s['rewinds']} rewind(s){', then the run stopped' if s['stopped'] else ''}; "
             f"{s['rows_skipped']:,} row(s) skipped"]
    lines += [f"  {e['line']}" for e in events]
    lines += [f"  skipped: {describe_range(r)}" for r in s["skipped_rows"]]
    return lines


def curve_markers(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events as the loss curve marks them (pipeline/tracking/curves.py): kind, step, loss; a rewind also the
    step it went back to."""
    out = []
    for e in events:
        marker = {"kind": e["kind"], "step": e["step"], "loss": e.get("loss")}
        if e["kind"] == "rewind":
            marker["to_step"] = e["rewind"]["to_step"]
        out.append(marker)
    return out
