"""Loss spikes, piece by piece and without a training run: the detector's window and threshold, what the guard makes of
a verdict, the rows a rewind skips, which checkpoint it may go back to, the record and its lines, the data audit's
"every row once except the recorded ranges", the loop's jump over skipped rows, the curve's markers and the settings'
one-line refusals. The runs themselves are tests/pipeline/train/test_spikes.py (system tier)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from pipeline.config import ConfigError, load_config
from pipeline.train.audit_log import final_lines
from pipeline.train.spike_detector import REL_FLOOR, SpikeDetector, SpikeSettings
from pipeline.train.spike_guard import SpikeGuard
from pipeline.train.spike_record import (SpikeRecord, curve_markers, read_events, report_lines, rewinds_of,
                                         summary)
from pipeline.train.spike_rewind import Rewinder, skip_ranges, valid_checkpoint

CPU = torch.device("cpu")


def _step(detector: SpikeDetector, loss: float, norm: float = 1.0):
    """One step through the detector as the engine runs it: measure, one transfer, record what applied."""
    lt, nt = torch.tensor(loss), torch.tensor(norm)
    verdict = detector.verdict(detector.measure(lt, nt).tolist())
    if verdict.finite and not verdict.outlier:
        detector.record(lt, nt)
    return verdict


def test_the_detector_arms_after_its_warm_up_and_flags_six_deviations_of_loss_or_norm():
    d = SpikeDetector(SpikeSettings(window=4, warmup_steps=4, sigmas=6.0), CPU)
    window = [3.0, 3.2, 2.8, 3.0]
    for x in window:
        assert not _step(d, x).outlier  # not armed: nothing is an outlier yet
    assert d.armed
    sd, mean = float(np.std(window, ddof=1)), float(np.mean(window))
    big = _step(d, mean + 6 * sd * 1.01)
    assert big.outlier and big.loss_limit == pytest.approx(mean + 6 * sd, rel=1e-6)
    assert big.loss_mean == pytest.approx(mean, rel=1e-6)
    assert big.describe().startswith("loss 3.99 > limit 3.98 (mean 3 of the last 4 steps)")
    assert _step(d, 3.0, norm=50.0).outlier  # the gradient norm alone makes one
    assert d.count == 4, "an outlier entered the window"
    assert not _step(d, -1e9).outlier  # only upward spikes count
    d = SpikeDetector(SpikeSettings(window=4, warmup_steps=4, sigmas=6.0), CPU)
    for x in window:
        _step(d, x)
    assert not _step(d, mean + 6 * sd * 0.99).outlier and d.count == 5  # under the limit: it joins the window


def test_a_flat_window_uses_a_floor_deviation_and_a_non_finite_step_is_not_an_outlier():
    d = SpikeDetector(SpikeSettings(window=4, warmup_steps=2, sigmas=6.0), CPU)
    for _ in range(4):
        _step(d, 2.0)
    assert _step(d, 2.0 + 7 * REL_FLOOR * 2.0).outlier
    assert not _step(d, 2.0 + 5 * REL_FLOOR * 2.0).outlier  # noise on a flat curve
    v = _step(d, math.nan)
    assert not v.finite and not v.outlier


def test_the_detector_state_round_trips_and_another_window_size_warms_up_again():
    d = SpikeDetector(SpikeSettings(window=4, warmup_steps=2), CPU)
    for x in (1.0, 2.0, 3.0, 4.0, 5.0):
        _step(d, x)
    state = json.loads(json.dumps(d.state_dict()))  # as meta.json holds it
    e = SpikeDetector(SpikeSettings(window=4, warmup_steps=2), CPU)
    e.load_state_dict(state)
    assert e.count == 5 and torch.equal(e.losses, d.losses) and torch.equal(e.norms, d.norms)
    other = SpikeDetector(SpikeSettings(window=8, warmup_steps=2), CPU)
    other.load_state_dict(state)
    assert other.count == 0 and not other.armed


def _guard(**settings) -> SpikeGuard:
    g = SpikeGuard(SpikeSettings(window=4, warmup_steps=4, **settings), CPU)
    for x in (3.0, 3.1, 2.9, 3.0):
        _observe(g, x, 0)
    return g


def _observe(g: SpikeGuard, loss: float, step: int, norm: float = 1.0):
    lt, nt = torch.tensor(loss), torch.tensor(norm)
    v = g.detector.verdict(g.detector.measure(lt, nt).tolist())
    hold, due = g.observe(v, step)
    if v.finite and not v.outlier:
        g.detector.record(lt, nt)
    return hold, due


def test_repeated_outliers_are_skipped_and_call_for_a_rewind_to_before_the_first():
    g = _guard(rewind_outliers=3, rewind_window=10)
    assert _observe(g, 9.0, step=20) == (True, None)
    assert _observe(g, 3.0, step=20) == (False, None)
    assert _observe(g, 9.0, step=21)[0] and g.skips == 2
    hold, due = _observe(g, 9.0, step=21)
    assert hold and due is not None and due.before_step == 20 and "3 outliers within 10 steps" in due.reason


def test_outliers_further_apart_than_the_window_do_not_add_up():
    g = _guard(rewind_outliers=2, rewind_window=3)
    _observe(g, 9.0, step=10)
    for s in range(10, 13):
        _observe(g, 3.0, step=s)
    assert _observe(g, 9.0, step=13) == (True, None)
    assert _observe(g, 9.0, step=13)[1] is not None


def test_an_applied_spike_whose_loss_does_not_come_back_calls_for_a_rewind_and_one_that_does_not():
    g = _guard(action="apply", recover_steps=3, rewind_outliers=0)
    assert _observe(g, 9.0, step=30) == (False, None)  # applied, watched
    assert _observe(g, 3.2, step=31)[1] is None and _observe(g, 3.2, step=32)[1] is None
    due = _observe(g, 3.2, step=33)[1]
    assert due is not None and due.before_step == 30 and "spike applied at step 31" in due.reason
    g = _guard(action="apply", recover_steps=3, rewind_outliers=0)
    _observe(g, 9.0, step=30)
    _observe(g, 3.2, step=31)
    _observe(g, 2.9, step=32)  # back under the pre-spike mean: recovered
    assert g.watch is None and _observe(g, 3.2, step=33)[1] is None


def test_a_rewind_skips_from_the_checkpoint_through_the_spike_and_at_least_the_set_rows():
    assert skip_ranges(0, (0, 192), (0, 232), 64, 512) == [{"phase": 0, "epoch": 0, "start": 192, "end": 256}]
    assert skip_ranges(0, (0, 100), (0, 400), 64, 512) == [{"phase": 0, "epoch": 0, "start": 100, "end": 400}]
    # past an epoch's end: the rest of it, then the next epoch's first rows
    assert skip_ranges(1, (2, 480), (3, 16), 64, 512) == [{"phase": 1, "epoch": 2, "start": 480, "end": 512},
                                                            {"phase": 1, "epoch": 3, "start": 0, "end": 32}]
    assert skip_ranges(0, (0, 500), (0, 504), 64, 512) == [{"phase": 0, "epoch": 0, "start": 500, "end": 512},
                                                           {"phase": 0, "epoch": 1, "start": 0, "end": 52}]
    # a mixture's one endless stream: one epoch, no end
    assert skip_ranges(0, (0, 10_000), (0, 10_040), 64, None) == [{"phase": 0, "epoch": 0, "start": 10_000,
                                                                   "end": 10_064}]


def test_the_cursor_jumps_over_skipped_ranges_of_its_phase_and_epoch_only():
    g = SpikeGuard(SpikeSettings(), CPU)
    g.rewinds = [{"ranges": [{"phase": 0, "epoch": 0, "start": 64, "end": 128},
                             {"phase": 0, "epoch": 0, "start": 128, "end": 160}]},
                 {"ranges": [{"phase": 1, "epoch": 0, "start": 0, "end": 32}]}]
    assert g.jump(0, 0, 64) == 160 and g.jump(0, 0, 100) == 160  # ranges that meet are one jump
    assert g.jump(0, 0, 160) is None and g.jump(0, 1, 64) is None and g.jump(1, 0, 0) == 32


def _checkpoint(folder, name: str, step: int, rewinds: int, phase: int = 0, epoch: int = 0, cursor: int = 0):
    d = folder / name
    d.mkdir(parents=True)
    spikes = {"rewinds": [{"phase": phase, "to_step": 0, "ranges": []}] * rewinds}
    counters = {"step": step, "epoch": epoch, "cursor": cursor, "phase": phase, "spikes": spikes}
    (d / "w.bin").write_bytes(b"w")
    (d / "meta.json").write_text(json.dumps({"counters": counters, "files": {"w.bin": {"bytes": 1, "sha256": ""}}}))


def test_a_rewind_goes_back_to_the_newest_checkpoint_before_the_spike_on_the_runs_timeline(tmp_path):
    folder = tmp_path / "phase0"
    _checkpoint(folder, "step_000010", 10, 0, cursor=80)
    _checkpoint(folder, "step_000020", 20, 0, cursor=160)
    _checkpoint(folder, "step_000030", 30, 0, cursor=240)  # abandoned by the rewind below (30 > its target 20)
    _checkpoint(folder, "step_000025", 25, 1, cursor=296)  # written after that rewind: valid
    (folder / "step_000040").mkdir()  # no meta.json: incomplete
    history = [{"phase": 0, "at_step": 33, "to_step": 20, "ranges": []}]
    r = Rewinder(str(folder), epoch_rows=512)
    assert r.find(history, 0, 40)[0] == str(folder / "step_000025")
    assert r.find(history, 0, 24)[0] == str(folder / "step_000020")
    assert r.find(history, 0, 9) is None and r.find(history, 1, 40) is None
    assert r.find([], 0, 40)[0] == str(folder / "step_000030")  # no rewind: the newest
    assert not valid_checkpoint({"step": 30, "phase": 0}, history)
    assert valid_checkpoint({"step": 30, "phase": 1}, history)  # another phase's rewind
    assert Rewinder(str(tmp_path / "none"), 512).find([], 0, 40) is None


def _event(kind: str, step: int, attempt: int, timeline: int = 0, **extra):
    return {"kind": kind, "phase": 0, "step": step, "attempt": attempt, "timeline": timeline, "loss": 9.0,
            "line": f"spike: {kind} at {step}", **extra}


def test_the_record_keeps_one_event_per_step_replayed_and_sums_up_the_run(tmp_path):
    record = SpikeRecord(str(tmp_path / "spikes.json"))
    assert read_events(str(tmp_path)) == [] and report_lines([]) == ["spikes: none (no step was an outlier)"]
    assert record.add(_event("skip", 25, 25)) == 0
    rewind = {"phase": 0, "at_step": 27, "to_step": 24, "checkpoint": "c", "reason": "r",
              "ranges": [{"phase": 0, "epoch": 0, "start": 192, "end": 256}]}
    assert record.add(_event("rewind", 27, 29, rewind=rewind)) == 1
    assert SpikeRecord(str(tmp_path / "spikes.json")).add(_event("skip", 25, 25)) == 0  # a restart's replay
    assert record.add(_event("skip", 25, 25, timeline=1)) == 2  # the same step after the rewind: another event
    events = read_events(str(tmp_path))
    assert len(events) == 3 and rewinds_of(events) == [rewind]
    s = summary(events)
    assert (s["skipped_steps"], s["rewinds"], s["rows_skipped"], s["stopped"]) == (2, 1, 64, False)
    lines = report_lines(events)
    assert lines[0] == "spikes: 2 step(s) skipped, 0 outlier(s) applied, 1 rewind(s); 64 row(s) skipped"
    assert "  skipped: rows 192-255 of epoch 0 (phase 0)" in lines
    assert curve_markers(events)[1] == {"kind": "rewind", "step": 27, "loss": 9.0, "to_step": 24}


def test_every_row_once_except_the_skipped_ranges_in_the_audit():
    """The audit's lines of a rewound run: steps redone after a restart and the abandoned steps inside a skipped range
    are left out; what remains, with the skipped rows, is each row once. A row read in an abandoned step that is not
    inside a recorded range is caught."""
    order = np.random.default_rng(0).permutation(64)
    ranges = [{"phase": 0, "epoch": 0, "start": 16, "end": 32}]

    def line(cursor, **extra):
        return {"phase": 0, "epoch": 0, "cursor": cursor, "seq_ids": [int(i) for i in order[cursor - 8:cursor]],
                **extra}

    def every_row_once(ranges) -> bool:
        kept = final_lines(lines, ranges)
        consumed = [i for x in kept for i in x["seq_ids"]]
        consumed += [int(i) for r in ranges for i in order[r["start"]:r["end"]]]
        return sorted(consumed) == sorted(int(i) for i in order[:48])

    # a restart redid step 8; the rewind abandoned the (skipped) outlier step at 24 and went from 32 on
    lines = [line(8), line(16), line(24, skipped=True), line(8, again=True), line(16), line(40), line(48)]
    kept = final_lines(lines, ranges)
    assert [x["cursor"] for x in kept] == [8, 16, 40, 48] and kept[0].get("again")
    assert every_row_once(ranges)
    assert not every_row_once([])  # without the record, rows 24-31 were never read: the check fails


def test_the_loop_jumps_over_skipped_rows_of_a_one_cursor_stream():
    """The loop reads from the end of a recorded range when its cursor reaches it: an endless stream (a mixture's)
    and the positions its batches come from. No rewind happens here: the range comes with the engine's state."""
    from pipeline.train.engine import Engine
    from pipeline.train.loop import Hooks, fit

    cfg = load_config("test", {"data.seq_len": 16, "data.vocab_size": 256, "train.batch_size": 2, "train.max_steps": 4,
                               "train.log_every": 100, "train.eval_every": 100, "model.compile": "off"})
    engine = Engine(cfg, 64, CPU)
    engine.spikes.rewinds = [{"ranges": [{"phase": 0, "epoch": 0, "start": 4, "end": 10}]}]
    starts = []

    def batches(epoch, start):
        starts.append(start)
        for p in range(start, 10**6, 2):
            yield {"tokens": torch.full((2, 17), p % 60 + 4, dtype=torch.int64), "seq_id": torch.tensor([p, p + 1])}

    seen = []
    hooks = Hooks(on_step=lambda e, o, micro: seen.extend(int(i) for b in micro for i in b["seq_id"]))
    fit(engine, batches, None, hooks, progress=False)
    assert starts == [0, 10] and seen == [0, 1, 2, 3, 10, 11, 12, 13] and engine.cursor == 14


def test_the_spike_settings_are_refused_in_one_line():
    for key, value, words in (("train.spike_action", "maybe", "choose one of: skip, apply, off"),
                              ("train.spike_sigmas", 0, "must be > 0"), ("train.spike_window", 1, "must be >= 2"),
                              ("train.spike_warmup_steps", 1, ">= 2"), ("train.spike_skip_steps", 0, "> 0"),
                              ("train.spike_max_rewinds", -1, ">= 0")):
        with pytest.raises(ConfigError, match=words) as err:
            load_config("test", {key: value})
        assert key in str(err.value) and "\n" not in str(err.value)


def test_the_loss_curve_marks_the_spikes(tmp_path):
    from matplotlib.figure import Figure
    from PIL import Image

    from pipeline.tracking.curves import _mark_spikes, plot_training_curves
    from pipeline.tracking.names import TRAIN_LOSS

    markers = [{"kind": "skip", "step": 25, "loss": 6.0}, {"kind": "rewind", "step": 28, "loss": 6.1, "to_step": 24}]
    ax = Figure().subplots()
    assert _mark_spikes(ax, markers) and not _mark_spikes(Figure().subplots(), [])
    cross = [line for line in ax.lines if line.get_marker() == "x"]
    assert len(cross) == 1 and list(cross[0].get_xdata()) == [25.0] and list(cross[0].get_ydata()) == [6.0]
    assert [list(line.get_xdata()) for line in ax.lines if line.get_linestyle() == "--"] == [[28.0, 28.0]]
    arrows = [t for t in ax.texts if getattr(t, "arrow_patch", None) is not None]
    assert len(arrows) == 1 and arrows[0].xy[0] == 24.0 and arrows[0].xyann[0] == 28.0  # back to step 24
    history = [{"step": s, TRAIN_LOSS: 5.0 - s / 20} for s in range(1, 41)]
    plain = plot_training_curves(history, tmp_path / "plain.png")
    marked = plot_training_curves(history, tmp_path / "marked.png", spikes=markers)
    a, b = (np.asarray(Image.open(p).convert("RGB"), dtype=np.int16) for p in (plain, marked))
    assert a.shape == b.shape and (np.abs(a - b).sum(axis=2) > 0).sum() > 50


def test_a_stop_for_spent_rewinds_is_one_line_and_not_retried():
    """The run stops when a rewind is due and none is left: one recorded line naming the settings; Ray Train does not
    retry it (another attempt would meet the same spike at the same step)."""
    from pipeline.train.distributed.failure_policy import repeats_on_retry
    from pipeline.train.engine import Engine
    from pipeline.train.spike_guard import RewindDue
    from pipeline.train.spike_rewind import SpikeStop, rewind

    cfg = load_config("test", {"data.seq_len": 16, "data.vocab_size": 256, "model.compile": "off",
                               "train.spike_max_rewinds": 1})
    engine = Engine(cfg, 64, CPU)
    engine.spikes.rewinds = [{"phase": 0, "to_step": 0, "ranges": []}]
    verdict = engine.spikes.detector.verdict([1, 1, 9.0, 1.0, 3.0, 2.0, 2.5])
    events = []
    with pytest.raises(SpikeStop) as err:
        rewind(engine, RewindDue("3 outliers within 100 steps", 0, verdict), None, lambda e, ev: events.append(ev))
    line = str(err.value)
    assert "\n" not in line and "made its 1 rewind(s) (train.spike_max_rewinds)" in line
    assert "train.spike_action=off" in line and [e["kind"] for e in events] == ["stop"] and events[0]["line"] == line
    assert repeats_on_retry(err.value)


def test_the_run_record_gets_the_spike_summary_when_the_run_ends(tmp_path):
    """run.json's `spikes` (counts and the skipped rows), from the run's spikes.json, as a --no-ray run keeps it."""
    from pipeline.train.session.train_session import Phase, TrainSession

    cfg = load_config("test", {"run.root": str(tmp_path), "tracking.enabled": False})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    record = SpikeRecord(str(run_dir / "spikes.json"))
    record.add(_event("skip", 25, 25))
    record.add(_event("rewind", 27, 29, rewind={"phase": 0, "at_step": 27, "to_step": 24, "checkpoint": "c",
                                                 "reason": "r", "ranges": [{"phase": 0, "epoch": 0, "start": 192,
                                                                            "end": 256}]}))
    session = TrainSession(cfg, run_dir, [Phase(8)], use_ray=False)

    class NoRun:
        run_id = None

    session._finish(NoRun(), "FINISHED")
    spikes = json.loads((run_dir / "run.json").read_text())["spikes"]
    assert (spikes["skipped_steps"], spikes["rewinds"], spikes["rows_skipped"]) == (1, 1, 64)
    assert spikes["skipped_rows"] == [{"phase": 0, "epoch": 0, "start": 192, "end": 256}]
