"""`python pipeline/run.py runs`: the runs under run.root, one line each, oldest first.

    python pipeline/run.py runs
    python pipeline/run.py runs --run.root=/data/runs

    run                   status    steps    val loss  how      last checkpoint
    nano-20261124-105551  finished  200/200    5.7108  ray      runs/nano-20261124-105551/ray/phase0/checkpoint_...

Everything comes from each run's run.json and its latest checkpoint's meta.json (step and the metrics of that
checkpoint's report), so listing reads one small file per run (an object on a bucket) and starts no Ray and no
MLflow. Statuses: running (or killed without a word), stopped (Ctrl+C: `--resume` continues it), finished, failed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.tracking.names import VAL_LOSS
from pipeline.train.session.run_dir import RUN_FILE, latest_of_run, read_run_file
from pipeline.train.session.resume import checkpoint_counters, trained_without_ray


@dataclass
class RunRow:
    name: str
    run_dir: Path
    status: str
    step: int | None  # the latest checkpoint's step (None: no checkpoint yet)
    total: int  # the steps the run trains to (every phase)
    val_loss: float | None  # at the latest checkpoint
    no_ray: bool
    checkpoint: str | None


def _val_loss(checkpoint: str | None) -> float | None:
    if not checkpoint:
        return None
    from pipeline.storage import join, read_text

    try:
        metrics = json.loads(read_text(join(checkpoint, "meta.json"))).get("metrics") or {}
    except (OSError, ValueError):
        return None
    return float(metrics[VAL_LOSS]) if VAL_LOSS in metrics else None


def list_runs(root: str | Path) -> list[RunRow]:
    """Every run directory under `root` (a run.json that parses), oldest record first."""
    rows = []
    files = sorted(Path(root).glob(f"*/{RUN_FILE}"), key=lambda f: f.stat().st_mtime)
    for f in files:
        try:
            record = read_run_file(f.parent)
        except (OSError, ValueError):
            continue  # not a run's record (a crash cannot leave half of one: it is written atomically)
        ckpt = latest_of_run(f.parent)[0]  # the newest complete, also of a run that crashed
        phases = record.get("phases") or [{"steps": (record.get("config") or {}).get("train.max_steps", 0)}]
        counters = checkpoint_counters(ckpt)
        rows.append(RunRow(f.parent.name, f.parent, str(record.get("status", "?")), counters.get("step"),
                           sum(int(p.get("steps", 0)) for p in phases), _val_loss(ckpt),
                           trained_without_ray(f.parent, record), ckpt))
    return rows


def format_runs(rows: list[RunRow], root: str | Path) -> str:
    if not rows:
        return f"no runs under {root} (run.root); `python pipeline/run.py train` makes one"
    table = [("run", "status", "steps", "val loss", "how", "last checkpoint")]
    for r in rows:
        steps = f"{r.step if r.step is not None else '-'}/{r.total}"
        loss = f"{r.val_loss:.4f}" if r.val_loss is not None else "-"
        table.append((r.name, r.status, steps, loss, "no-ray" if r.no_ray else "ray", r.checkpoint or "-"))
    widths = [max(len(row[i]) for row in table) for i in range(5)]
    lines = []
    for row in table:
        cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1]), row[2].rjust(widths[2]),
                 row[3].rjust(widths[3]), row[4].ljust(widths[4]), row[5]]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def runs_main(root: str | Path) -> int:
    print(format_runs(list_runs(root), root))
    return 0
