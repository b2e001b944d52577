"""A sweep's console: one compact line each time a trial's status changes, instead of Tune's status tables.

    tune: trial 5a1e2_00000 running (model.tier=nano train.batch_size=1)  [1 running, 2 pending]
    tune: trial 5a1e2_00000 finished: val/loss=6.0412 at step 4  [1 running, 1 pending, 1 done]
    tune: trial 5a1e2_00002 failed: oom (skipped: largest batch that fits is 4)  [3 done]

Tune's own reporter (RunConfig(verbose=1)) redraws a table of every trial at every change and every 30 s or so:
about 130 lines for a two-trial CPU sweep. pipeline/sweep/tune.py runs Tune silent (verbose=0) with this callback,
and prints the full table (pipeline/sweep/report.py) once, at the end.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Any

from ray.tune import Callback

def _params(config: dict[str, Any], searched: list[str]) -> str:
    shown = []
    for k in searched:
        v = config.get(k)
        shown.append(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}")
    return " ".join(shown)


def _counts(trials) -> str:
    c = Counter(str(t.status) for t in trials)
    done = c.pop("TERMINATED", 0) + c.pop("ERROR", 0)
    parts = [f"{c[s]} {s.lower()}" for s in ("RUNNING", "PENDING", "PAUSED") if c.get(s)]
    return ", ".join(parts + ([f"{done} done"] if done else []))


class StatusLines(Callback):
    """Tune callback (driver side): prints `tune: trial ID STATUS ...  [counts]` at each trial's start and end."""

    def __init__(self, metric: str, searched: list[str], status_key: str, reason_key: str):
        """`status_key`, `reason_key`: where a trial's final report puts its status and failure reason
        (pipeline/sweep/trial.py's STATUS_KEY and REASON_KEY)."""
        self.metric, self.searched = metric, list(searched)
        self.status_key, self.reason_key = status_key, reason_key
        self.lines: list[str] = []  # what was printed, in order

    def _say(self, trial, what: str, trials) -> None:
        line = f"tune: trial {trial.trial_id} {what}  [{_counts(trials)}]"
        self.lines.append(line)
        print(line, flush=True)

    def on_trial_start(self, iteration, trials, trial, **info) -> None:
        self._say(trial, f"running ({_params(trial.config, self.searched)})", trials)

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        last = trial.last_result or {}
        value = last.get(self.metric)
        shown = f"{self.metric}={value:.4f}" if isinstance(value, float) and math.isfinite(value) else "no metric"
        # the trial's own summary says ok; a trial the scheduler stopped ended on an ordinary report
        status = {"ok": "finished", None: "stopped early by the scheduler"}.get(last.get(self.status_key),
                                                                               last.get(self.status_key))
        self._say(trial, f"{status}: {shown} at step {last.get('step', '?')}", trials)

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        last = trial.last_result or {}
        reason = last.get(self.reason_key) or "see the table at the end"
        self._say(trial, f"failed: {last.get(self.status_key) or 'failed'} ({reason})", trials)
