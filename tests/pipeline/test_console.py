"""The console (pipeline/console.py): the plain progress lines and their eta, driven by a clock the tests set; and the
driver's filter of lines Ray forwards from workers: a worker's SystemExit from Ray's own SIGTERM handler is dropped
however the block arrives; every other line is passed on, in order."""
import pytest

from pipeline import console
from pipeline.console import ProgressLines, _drop_sigterm_exit_blocks, _ForwardedLineFilter


class FakeClock:
    """console.now(), moved by the test."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def fake_clock(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(console, "now", clock)
    monkeypatch.setenv(console.INTERACTIVE_ENV, "0")
    return clock


def printed_lines(capfd) -> list[str]:
    return capfd.readouterr().out.splitlines()


def test_the_training_lines_eta_is_the_mean_of_the_steps_after_the_first_from_when_the_second_began(fake_clock,
                                                                                                      capfd):
    """Step 1 takes 30 s (compiling, warming up), then its first metrics take 12 s more to log; the steps after it
    take 2 s each. The eta counts those 2 s alone: the 42 s before the second step began say nothing of the rest."""
    bar = ProgressLines("train nano", 6, "step", tenths=False)
    bar.begin()
    fake_clock.t += 30
    bar.update(1)
    fake_clock.t += 12  # the first log: MLflow's first metrics, before the line is printed
    bar.set_postfix(loss="5.000")
    for _ in range(5):
        bar.begin()
        fake_clock.t += 2
        bar.update(1)
        bar.set_postfix(loss="4.000")
    assert printed_lines(capfd) == [
        "train nano  step 1/6  loss 5.000  elapsed 0m42s  eta ?",
        "train nano  step 2/6  loss 4.000  elapsed 0m44s  eta 0m08s",
        "train nano  step 3/6  loss 4.000  elapsed 0m46s  eta 0m06s",
        "train nano  step 4/6  loss 4.000  elapsed 0m48s  eta 0m04s",
        "train nano  step 5/6  loss 4.000  elapsed 0m50s  eta 0m02s",
        "train nano  step 6/6  loss 4.000  elapsed 0m52s  eta 0m00s",
    ]


def test_without_begin_the_mean_starts_when_the_first_unit_ended_and_lines_come_at_each_tenth(fake_clock, capfd):
    """An evaluation's lines: printed by update itself at the first batch, at each tenth and at the end; it never
    calls begin(), so the mean runs from the end of the first batch."""
    bar = ProgressLines("eval 4x", 20, "batch")
    fake_clock.t += 9  # the first batch: the reads start
    bar.update(1)
    for _ in range(19):
        fake_clock.t += 1
        bar.update(1)
    lines = printed_lines(capfd)
    assert lines[0] == "eval 4x  batch 1/20  elapsed 0m09s  eta ?"
    assert lines[1] == "eval 4x  batch 2/20  elapsed 0m10s  eta 0m18s"  # (1 s / 1) x 18
    assert lines[2] == "eval 4x  batch 4/20  elapsed 0m12s  eta 0m16s"  # each tenth: 2 batches of 20
    assert lines[-1] == "eval 4x  batch 20/20  elapsed 0m28s  eta 0m00s"
    assert len(lines) == 11


def test_a_long_unit_still_gets_a_line_every_30_seconds(fake_clock, capfd):
    bar = ProgressLines("passkey", 1000, "batch")
    bar.update(1)
    fake_clock.t += console.PLAIN_PROGRESS_EVERY_S - 1
    bar.update(1)  # neither a tenth nor 30 s: no line
    fake_clock.t += 1
    bar.update(1)
    assert [ln.split("  ")[1] for ln in printed_lines(capfd)] == ["batch 1/1000", "batch 3/1000"]


def test_a_resumed_run_counts_from_its_step(fake_clock, capfd):
    bar = ProgressLines("train nano", 200, "step", initial=150, tenths=False)
    bar.begin()
    fake_clock.t += 20
    bar.update(1)
    bar.set_postfix()
    bar.begin()
    fake_clock.t += 1
    bar.update(1)
    bar.set_postfix()
    assert printed_lines(capfd) == ["train nano  step 151/200  elapsed 0m20s  eta ?",
                                    "train nano  step 152/200  elapsed 0m21s  eta 0m48s"]


def test_the_console_has_one_clock_format():
    assert [console.clock(s) for s in (0, 65.9, 7380)] == ["0m00s", "1m05s", "2h03m00s"]

SIGTERM_BLOCK = [
    "Exception ignored in: <function _SlowFinalizer.__del__ at 0x7f88944520c0>",
    "Traceback (most recent call last):",
    '  File "/x/tests/pipeline/test_ray_runtime.py", line 116, in __del__',
    "    time.sleep(5)",
    '  File "/x/site-packages/ray/_private/worker.py", line 1063, in sigterm_handler',
    "    raise_sys_exit_with_custom_error_message(",
    '  File "python/ray/_raylet.pyx", line 712, in ray._raylet.raise_sys_exit_with_custom_error_message',
    "SystemExit: 1",
]
REAL_BLOCK = [
    "Exception ignored in: <function Cache.__del__>",
    "Traceback (most recent call last):",
    '  File "cache.py", line 9, in __del__',
    "ValueError: closed twice",
]


def batch(lines, pid=3114):
    return {"ip": "127.0.0.1", "pid": pid, "is_err": True, "actor_name": "Ending", "lines": list(lines)}


def test_the_sigterm_block_is_dropped_and_every_other_line_kept_in_order():
    kept, still_open = _drop_sigterm_exit_blocks(["before"] + REAL_BLOCK + SIGTERM_BLOCK + ["after"])
    assert kept == ["before"] + REAL_BLOCK + ["after"] and still_open == []


def test_an_empty_line_inside_the_sigterm_block_does_not_end_it():
    block = SIGTERM_BLOCK[:4] + [""] + SIGTERM_BLOCK[4:]  # as one CI run printed such a block
    assert _drop_sigterm_exit_blocks(["before"] + block + ["after"]) == (["before", "after"], [])


def test_a_systemexit_not_raised_by_rays_handler_is_kept():
    own = SIGTERM_BLOCK[:4] + SIGTERM_BLOCK[-1:]  # SystemExit: 1 from the user's own code
    assert _drop_sigterm_exit_blocks(own) == (own, [])


def test_a_block_split_across_batches_is_held_then_dropped():
    printed = []
    emit = _ForwardedLineFilter(printed.append, hold_s=30)
    emit(batch(["first"] + SIGTERM_BLOCK[:5]))  # the log monitor read the file mid-block
    assert [b["lines"] for b in printed] == [["first"]]
    emit(batch(SIGTERM_BLOCK[5:] + ["last"]))
    assert [b["lines"] for b in printed] == [["first"], ["last"]]


def test_a_block_split_without_the_traceback_line_in_the_same_batch_is_still_recognised():
    printed = []
    emit = _ForwardedLineFilter(printed.append, hold_s=30)
    emit(batch(SIGTERM_BLOCK[:1]))
    emit(batch(SIGTERM_BLOCK[1:2]))
    emit(batch(SIGTERM_BLOCK[2:]))
    assert printed == []


class FakeTimer:
    """threading.Timer's interface; fires only when the test says the hold is over."""

    made: list["FakeTimer"] = []

    def __init__(self, seconds, function, args=()):
        self.seconds, self.function, self.args, self.cancelled, self.daemon = seconds, function, args, False, False
        FakeTimer.made.append(self)

    def start(self):
        pass

    def cancel(self):
        self.cancelled = True

    def fire(self):
        if not self.cancelled:
            self.function(*self.args)


def test_a_block_whose_rest_comes_within_the_hold_is_still_dropped():
    """As a sweep's trial actor wrote it on a loaded machine: the first half of the block, then the rest more than
    3 s later. The hold is 10 s; the rest comes before the timer fires, which it then never does."""
    printed, FakeTimer.made[:] = [], []
    emit = _ForwardedLineFilter(printed.append, timer=FakeTimer)
    emit(batch(SIGTERM_BLOCK[:4]))
    assert [t.seconds for t in FakeTimer.made] == [10.0] and printed == []
    emit(batch(SIGTERM_BLOCK[4:]))
    assert printed == [] and FakeTimer.made[0].cancelled


def test_what_is_still_held_at_exit_is_printed_by_flush():
    printed = []
    emit = _ForwardedLineFilter(printed.append, hold_s=60)
    emit(batch(REAL_BLOCK[:3]))
    assert printed == []
    emit.flush()
    assert [b["lines"] for b in printed] == [REAL_BLOCK[:3]]
    emit.flush()  # nothing held: nothing printed twice
    assert len(printed) == 1


def test_an_open_block_from_one_process_does_not_hold_another_processes_lines():
    printed = []
    emit = _ForwardedLineFilter(printed.append, hold_s=30)
    emit(batch(REAL_BLOCK[:2], pid=1))
    emit(batch(["other worker"], pid=2))
    emit(batch(REAL_BLOCK[2:], pid=1))
    assert [(b["pid"], b["lines"]) for b in printed] == [(2, ["other worker"]), (1, REAL_BLOCK)]


def test_a_block_whose_end_never_comes_is_printed_as_it_came():
    printed, FakeTimer.made[:] = [], []
    emit = _ForwardedLineFilter(printed.append, timer=FakeTimer)
    emit(batch(REAL_BLOCK[:3]))  # the process was killed mid-write
    assert printed == []
    FakeTimer.made[0].fire()  # the hold is over
    assert [b["lines"] for b in printed] == [REAL_BLOCK[:3]]


def test_the_real_timer_releases_a_held_block():
    """The same with threading.Timer itself (hold 0 s): what a real hold ends in, waited for by an event."""
    import threading

    released = threading.Event()
    printed = []

    def emit_and_signal(data):
        printed.append(data)
        released.set()

    emit = _ForwardedLineFilter(emit_and_signal, hold_s=0.0)
    emit(batch(REAL_BLOCK[:3]))
    assert released.wait(timeout=60), "the timer never released the held block"
    assert [b["lines"] for b in printed] == [REAL_BLOCK[:3]]


def test_harmless_gcs_lines_are_dropped_and_its_other_lines_kept():
    printed = []
    emit = _ForwardedLineFilter(printed.append)
    emit({"pid": "gcs_server", "is_err": True, "lines": ["[x] Failed to kill actor 1, Socket closed"]})
    emit({"pid": "gcs_server", "is_err": True, "lines": ["[x] Failed to kill actor 2", "a real GCS error"]})
    assert [b["lines"] for b in printed] == [["a real GCS error"]]


def test_the_placement_group_cleaners_lines_without_a_state_api_are_dropped_and_its_others_kept():
    """Without Ray's dashboard the cleaner says once a second that it cannot query the controller (140 lines of a
    GPU machine's default run); its other warnings, and the same words from the GCS, are passed on."""
    printed = []
    emit = _ForwardedLineFilter(printed.append)
    line = ("Failed to query Ray Train Controller actor state. State API may be temporarily unavailable. "
            "Continuing to monitor.")
    emit({**batch([line, line]), "actor_name": "PlacementGroupCleaner"})
    emit({**batch([line, "Failed to query placement group table: x. Continuing to monitor."]),
          "actor_name": "PlacementGroupCleaner"})
    emit({"pid": "gcs_server", "is_err": True, "lines": [line]})
    assert [b["lines"] for b in printed] == [["Failed to query placement group table: x. Continuing to monitor."],
                                             [line]]
