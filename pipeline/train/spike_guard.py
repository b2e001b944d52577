"""What a loss spike does to a run, decided on the host from the detector's verdict (pipeline/train/spike_detector.py):
skip the update, watch an applied spike, call for a rewind, and jump the data cursor over the rows a rewind skipped.
Ray-free, torch only through the detector; the engine owns one (`engine.spikes`) and its state is part of every
checkpoint (meta.json `counters.spikes`), so a resumed run decides as the run it continues.

    skip, due = engine.spikes.observe(verdict, step_before)   # in Engine.train_step, after the step's one sync
    end = engine.spikes.jump(phase, epoch, cursor)             # in the loop, before each batch: a skipped range?

Rules (train.spike_*; docs/training.md#loss-spikes):
  - an outlier applies no update (spike_action=skip) and is counted, or is applied and watched (apply);
  - spike_rewind_outliers outliers within spike_rewind_window steps (taken or skipped) call for a rewind to the
    newest checkpoint at or before the step the first of them met;
  - an applied spike after which the loss stays above the window's pre-spike mean for spike_recover_steps steps calls
    for a rewind to the newest checkpoint before it.
The rewind itself (find the checkpoint, agree on it across ranks, load it, skip the rows) is
pipeline/train/spike_rewind.py's. `rewinds` lists every rewind of the run, with the rows each skipped (`ranges`):
it is never rolled back by a rewind (the rest of the state is, with the weights).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pipeline.train.spike_detector import SpikeDetector, SpikeSettings, Verdict


@dataclass(frozen=True)
class RewindDue:
    """A rewind the guard calls for: to the newest checkpoint at or before `before_step`."""
    reason: str  # "3 outliers within 100 steps", "the loss stayed above ..."
    before_step: int  # optimizer steps the state had when the first outlier (or the applied spike) met it
    verdict: Verdict  # the step that called for it


class SpikeGuard:
    """One engine's spike state. `detector` is None when train.spike_action=off (then nothing here runs)."""

    def __init__(self, settings: SpikeSettings, device: torch.device):
        self.settings = settings
        self.detector = SpikeDetector(settings, device) if settings.enabled else None
        self.attempts = 0  # train_step calls observed (skipped ones included) along this timeline
        self.outliers: list[list[int]] = []  # [attempt, step before it] of outliers within the rewind window
        self.watch: dict[str, float] | None = None  # apply: {"level", "step", "above"} while a spike is watched
        self.skips = 0  # outlier steps that applied no update, along this timeline
        self.rewinds: list[dict[str, Any]] = []  # every rewind of the run (spike_rewind.py writes the entries)

    @property
    def enabled(self) -> bool:
        return self.detector is not None

    # ------------------------------------------------------------------------------------------ each step
    def observe(self, verdict: Verdict, step_before: int) -> tuple[bool, RewindDue | None]:
        """After the step's sync: (whether the update is skipped, a rewind due or None). `step_before`: optimizer
        steps taken before this one."""
        s = self.settings
        self.attempts += 1
        if not verdict.finite:  # the non-finite guard's (the engine counts it)
            return False, None
        due = None
        if verdict.outlier:
            self.outliers = [o for o in self.outliers if o[0] > self.attempts - s.rewind_window]
            self.outliers.append([self.attempts, step_before])
            if s.rewind_outliers and len(self.outliers) >= s.rewind_outliers:
                due = RewindDue(f"{len(self.outliers)} outliers within {s.rewind_window} steps "
                                f"(train.spike_rewind_outliers={s.rewind_outliers})", self.outliers[0][1], verdict)
            if s.action == "skip":
                self.skips += 1
                return True, due
            if s.recover_steps and self.watch is None:  # apply: watched from the next step on
                self.watch = {"level": verdict.loss_mean, "step": step_before + 1, "above": 0}
            return False, due
        if self.watch is not None:
            if verdict.loss > self.watch["level"]:
                self.watch["above"] += 1
                if self.watch["above"] >= s.recover_steps:
                    w, self.watch = self.watch, None
                    due = RewindDue(f"the loss stayed above its pre-spike mean {w['level']:.4g} for "
                                    f"{int(w['above'])} steps after the spike applied at step {int(w['step'])} "
                                    f"(train.spike_recover_steps={s.recover_steps})", int(w["step"]) - 1, verdict)
            else:
                self.watch = None  # recovered
        return False, due

    # ------------------------------------------------------------------------------------------ the data
    def ranges(self, phase: int | None = None) -> list[dict[str, int]]:
        """Every row range a rewind skipped ({"phase", "epoch", "start", "end"}: positions [start, end) of that
        epoch's order, as the data cursor counts them), of one phase or all."""
        return [r for rw in self.rewinds for r in rw["ranges"] if phase is None or r["phase"] == phase]

    def jump(self, phase: int, epoch: int, cursor: int) -> int | None:
        """Where the cursor goes when it stands inside a skipped range of (phase, epoch): the range's end (followed
        through ranges that meet), else None."""
        end = None
        moved = True
        while moved:
            moved = False
            for r in self.ranges(phase):
                if r["epoch"] == epoch and r["start"] <= (end if end is not None else cursor) < r["end"]:
                    end, moved = r["end"], True
        return end

    def new_phase(self) -> None:
        """A phase starts fresh: its data has a loss level of its own, so the window warms up again."""
        if self.detector is not None:
            self.detector.reset()
        self.outliers, self.watch = [], None

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"detector": self.detector.state_dict() if self.detector is not None else None,
                "attempts": self.attempts, "outliers": [list(o) for o in self.outliers], "watch": self.watch,
                "skips": self.skips, "rewinds": list(self.rewinds)}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """A checkpoint's state (None: one written before spikes were recorded: a fresh guard, no rewinds)."""
        state = state or {}
        if self.detector is not None:
            self.detector.load_state_dict(state.get("detector"))
        self.attempts = int(state.get("attempts", 0))
        self.outliers = [list(o) for o in state.get("outliers", [])]
        self.watch = state.get("watch")
        self.skips = int(state.get("skips", 0))
        self.rewinds = list(state.get("rewinds", []))
