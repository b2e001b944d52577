"""Rewinding past a loss spike: back to the newest checkpoint from before it, the rows that led into it skipped (PaLM's
recipe: go back, skip a window of data, go on), a bounded number of times; and, at a restart, the same history
applied to whatever checkpoint the restart found. Ray-free: the loop (pipeline/train/loop.py) calls `rewind` when
the guard (pipeline/train/spike_guard.py) calls for one, the launchers call `reconcile` after their load.

    rewinder = Rewinder(folder=<the phase's checkpoint folder>, epoch_rows=manifest.rows("train"))
    event = rewind(engine, due, rewinder, on_spike)    # every rank, at the same step: same collectives, same order
    reconcile(engine, rewinds_of(read_events(run_store)), rewinder)   # after a (re)start's load

Every rank decides the same (the detector's numbers are the global loss and gradient norm), so every rank comes here
at the same step. Rank 0 lists the checkpoints and the others are told its choice (one broadcast); every rank then
loads it, a sharded (FSDP) checkpoint through the collective load of every resume. Which checkpoints may be gone
back to: one of this phase, at or before the step the spike met, and not written by a timeline a rewind abandoned
(a checkpoint that knew k rewinds is valid when its step is at or before the target of every later rewind of its
phase). The rows skipped are the positions of the data order from the checkpoint's cursor through the step that
called for the rewind, and at least train.spike_skip_steps steps' worth of rows (a global cursor, so a resume at
another worker count, an elastic resize and a mixture's one cursor skip the same rows).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from pipeline.train.spike_record import describe_range

if TYPE_CHECKING:
    from pipeline.train.engine import Engine, StepOutcome
    from pipeline.train.spike_guard import RewindDue


class SpikeStop(RuntimeError):
    """A rewind was due and could not be made (the rewinds are spent, or no checkpoint is from before the spike).
    Another attempt would meet the same spike at the same step: Ray Train does not retry it."""
    repeats_on_retry = True


def skip_ranges(phase: int, start: tuple[int, int], through: tuple[int, int], min_rows: int,
                epoch_rows: int | None) -> list[dict[str, int]]:
    """The row ranges a rewind skips: from `start` (the checkpoint's (epoch, cursor)) through `through` (the cursor
    after the step that called for it), extended to at least `min_rows` rows. `epoch_rows`: rows of the training
    split (an epoch's positions end there); None for a mixture's endless stream (one epoch)."""
    (e, c), (e_end, c_end) = start, through
    limit = math.inf if epoch_rows is None else epoch_rows
    out, left = [], min_rows
    for _ in range(e_end - e + 2 + (min_rows // epoch_rows if epoch_rows else 0)):
        covered = c_end if e == e_end else (limit if e < e_end else 0)
        stop = min(limit, max(covered, c + left))
        if stop > c:
            out.append({"phase": phase, "epoch": e, "start": int(c), "end": int(stop)})
            left -= stop - c
        if e >= e_end and (left <= 0 or epoch_rows is None):
            break
        e, c = e + 1, 0
    return out


def valid_checkpoint(counters: dict[str, Any], history: list[dict[str, Any]]) -> bool:
    """Whether a checkpoint (its meta.json counters) lies on the run's timeline: no rewind it did not know of went
    back to a step before its own in its phase."""
    known = len((counters.get("spikes") or {}).get("rewinds", []))
    phase, step = counters.get("phase", 0), counters["step"]
    return all(step <= r["to_step"] for r in history[known:] if r["phase"] == phase)


@dataclass
class Rewinder:
    """Where a fit's checkpoints are and how its data is counted, for `rewind` and `reconcile`."""
    folder: str  # this phase's checkpoint folder: <run>/checkpoints/phase<i>, or Ray Train's <storage>/phase<i>
    epoch_rows: int | None  # rows of the training split; None for a mixture (one endless stream)
    settle: Callable[[], None] | None = None  # before looking: the checkpoint uploads in flight finished (Ray Train)

    def find(self, history: list[dict[str, Any]], phase: int, before_step: float) -> tuple[str, dict] | None:
        """(location, counters) of the newest complete checkpoint of `phase` at or before `before_step` on the run's
        timeline (valid_checkpoint), or None. Rank 0 only: it lists the folder and reads each checkpoint's meta."""
        from pipeline.storage import join
        from pipeline.train.checkpoints.index import checkpoint_names, incomplete, read_meta

        try:
            names = checkpoint_names(self.folder)
        except (FileNotFoundError, NotADirectoryError):
            return None
        best = None
        for name in names:  # newest first; a redone step after a rewind has a newer name and a smaller step
            location = join(self.folder, name)
            meta = read_meta(location)
            if not meta or "counters" not in meta:
                continue
            c = meta["counters"]
            if c.get("phase", 0) != phase or c["step"] > before_step or not valid_checkpoint(c, history):
                continue
            if (best is None or c["step"] > best[1]["step"]) and incomplete(location) is None:
                best = (location, c)
        return best


def agreed(engine: "Engine", choose: Callable[[], Any]) -> Any:
    """`choose()` on rank 0, its answer handed to every rank (one broadcast; a collective every rank makes at the same
    step). An error on rank 0 reaches every rank as one line."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return choose()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box = [("ok", choose())]
        except Exception as exc:  # noqa: BLE001 -- every rank must leave the broadcast with it
            box = [("error", f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}")]
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        raise SpikeStop(f"spike: the rewind's checkpoint could not be chosen on rank 0: {value}")
    return value


# ------------------------------------------------------------------------------------------ events
def outlier_event(engine: "Engine", outcome: "StepOutcome") -> dict[str, Any]:
    """The record of one outlier step (kind skip or applied) with its console line."""
    guard, v = engine.spikes, outcome.spike
    s = guard.settings
    step = outcome.step + 1 if outcome.skipped else outcome.step  # the step it was (a skipped one did not count)
    if outcome.skipped:
        what = f"spike: step {step} skipped (no update)"
    else:
        what = f"spike: step {step} applied (train.spike_action=apply)"
        if s.recover_steps:
            what += f", watched for {s.recover_steps} steps"
    repeat = (f"; outlier {len(guard.outliers)} of {s.rewind_outliers} within {s.rewind_window} steps before a "
              f"rewind" if s.rewind_outliers else "")
    return {"kind": "skip" if outcome.skipped else "applied", "phase": engine.phase, "step": step,
            "attempt": guard.attempts, "timeline": len(guard.rewinds), **v.to_dict(),
            "line": f"{what}: {v.describe()}{repeat}"}


def _stop(engine: "Engine", due: "RewindDue", why: str, on_spike) -> SpikeStop:
    guard = engine.spikes
    line = (f"spike: a rewind was due at step {engine.step}, {due.reason}, but {why}; the run stopped (its "
            f"checkpoints are as they were). Look at the data it met (data audit: --audit-data), or raise "
            f"train.spike_sigmas or train.spike_max_rewinds, or turn detection off with train.spike_action=off")
    event = {"kind": "stop", "phase": engine.phase, "step": engine.step, "attempt": guard.attempts,
             "timeline": len(guard.rewinds), **due.verdict.to_dict(), "line": line}
    if on_spike is not None:
        on_spike(engine, event)
    return SpikeStop(line)


def rewind(engine: "Engine", due: "RewindDue", rewinder: Rewinder | None, on_spike=None) -> dict[str, Any]:
    """Go back to the newest checkpoint from before the spike, with its rows skipped: every rank, at the same step.
    Records the rewind (on_spike: the console line, MLflow, spikes.json on rank 0) before loading, so a restart
    during the load still applies it. Raises SpikeStop (one line, recorded too) when the rewinds are spent or there is
    no checkpoint to go back to. Returns the event."""
    guard = engine.spikes
    s = guard.settings
    if len(guard.rewinds) >= s.max_rewinds:
        raise _stop(engine, due, f"the run has made its {s.max_rewinds} rewind(s) (train.spike_max_rewinds)", on_spike)
    if rewinder is None:
        raise _stop(engine, due, "this run keeps no checkpoints to go back to", on_spike)
    if rewinder.settle is not None:
        rewinder.settle()
    found = agreed(engine, lambda: rewinder.find(guard.rewinds, engine.phase, due.before_step))
    if found is None:
        raise _stop(engine, due, f"no complete checkpoint of phase {engine.phase} is from step {due.before_step} or "
                    f"before in {rewinder.folder} (a checkpoint every train.checkpoint_every steps; the first is "
                    f"written at step {engine.cfg.train.checkpoint_every})", on_spike)
    location, c = found
    t = engine.cfg.train
    rows_per_step = t.batch_size * t.grad_accum * engine.data_world_size
    ranges = skip_ranges(engine.phase, (c["epoch"], c["cursor"]), (engine.epoch, engine.cursor),
                         s.skip_steps * rows_per_step, rewinder.epoch_rows)
    entry = {"phase": engine.phase, "at_step": engine.step, "to_step": c["step"], "checkpoint": location,
             "ranges": ranges, "reason": due.reason}
    rows = sum(r["end"] - r["start"] for r in ranges)
    line = (f"spike: rewind {len(guard.rewinds) + 1} of at most {s.max_rewinds} at step {engine.step}, {due.reason}: "
            f"back to step {c['step']} ({location}), skipping {'; '.join(describe_range(r) for r in ranges)}, "
            f"{rows:,} rows, and going on")
    event = {"kind": "rewind", "phase": engine.phase, "step": engine.step, "attempt": guard.attempts,
             "timeline": len(guard.rewinds), **due.verdict.to_dict(), "rewind": entry, "line": line}
    if on_spike is not None:
        on_spike(engine, event)
    history = [*guard.rewinds, entry]
    engine.load(location)
    guard.rewinds = history
    engine.train_metrics.reset()  # the abandoned steps' sums are not the next log window's
    return event


def reconcile(engine: "Engine", history: list[dict[str, Any]], rewinder: Rewinder | None, say=print, *,
              chosen: bool = False) -> None:
    """After a (re)start loaded its checkpoint: apply the rewinds the run's record holds and the checkpoint did not
    know of. A checkpoint such a rewind abandoned (written after its target, before it) is replaced by the newest
    valid one, loaded on every rank; either way the skipped rows are skipped when the cursor reaches them. `history`:
    the record's rewinds (pipeline/train/spike_record.py rewinds_of); every rank passes the same. `chosen`: the
    checkpoint is the one `--checkpoint` named: when a rewind abandoned it, the run goes on from it as it was (with
    the run's rewinds applied from there on), as asked."""
    guard = engine.spikes
    mine = guard.rewinds
    if len(history) <= len(mine) or history[:len(mine)] != mine:  # nothing new, or not this checkpoint's run
        return
    abandoned = [r for r in history[len(mine):] if r["phase"] == engine.phase and engine.step > r["to_step"]]
    if abandoned and chosen:
        if engine.rank == 0:
            say(f"resume: the rewind at step {abandoned[0]['at_step']} went back past this checkpoint (step "
                f"{engine.step}); training goes on from it as --checkpoint asks, past the rows that rewind skipped")
    elif abandoned:
        if rewinder is None:
            raise SpikeStop("spike: the checkpoint to resume from was abandoned by a rewind, and this run keeps no "
                            "checkpoints to go back to")
        found = agreed(engine, lambda: rewinder.find(history, engine.phase, math.inf))
        if found is None:
            raise SpikeStop(f"spike: the checkpoint to resume from (step {engine.step}) was abandoned by the rewind at "
                            f"step {abandoned[0]['at_step']}, and {rewinder.folder} holds no checkpoint the run's "
                            f"rewinds left valid; resume from a checkpoint of step {abandoned[0]['to_step']} or "
                            f"earlier with --checkpoint")
        was = engine.step
        engine.load(found[0])
        if engine.rank == 0:
            say(f"resume: the checkpoint of step {was} was written before the rewind at step "
                f"{abandoned[-1]['at_step']} went back to step {abandoned[-1]['to_step']}; resuming from {found[0]} "
                f"(step {engine.step}), the skipped rows skipped again")
    guard.rewinds = list(history)
