"""The driver's filter of lines Ray forwards from workers (pipeline/console.py): a worker's SystemExit from Ray's own
SIGTERM handler is dropped however the block arrives; every other line is passed on, in order."""
import time

from pipeline.console import _drop_sigterm_exit_blocks, _ForwardedLineFilter

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


def test_a_block_whose_rest_comes_seconds_later_is_still_dropped():
    """As a sweep's trial actor wrote it on a loaded machine: the first half of the block, then the rest more than
    3 s later (the default hold is 10 s)."""
    printed = []
    emit = _ForwardedLineFilter(printed.append)
    emit(batch(SIGTERM_BLOCK[:4]))
    time.sleep(3.5)
    emit(batch(SIGTERM_BLOCK[4:]))
    assert printed == []


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
    printed = []
    emit = _ForwardedLineFilter(printed.append, hold_s=0.2)
    emit(batch(REAL_BLOCK[:3]))  # the process was killed mid-write
    deadline = time.monotonic() + 10
    while not printed and time.monotonic() < deadline:
        time.sleep(0.05)
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
