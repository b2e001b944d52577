"""tests/cpu_by_process.py: the CPU a process spends between two samples goes to the kind it has."""
from __future__ import annotations

import os
import sys

from tests import cpu_by_process


def test_cpu_between_two_samples_goes_to_the_process_kind():
    me = str(os.getpid())
    mine = cpu_by_process.kind(me)
    assert mine is not None and mine != "kernel"
    sampler = cpu_by_process.Sampler()
    sampler.sample()  # the first sample counts nothing: what ran before is not the command's
    assert sampler.totals == {}
    start = os.times()
    while os.times().user - start.user < 0.2:  # CPU time, not wall-clock: 0.2 s of work whatever the load
        sum(i * i for i in range(10_000))
    sampler.sample()
    assert sampler.totals[mine] >= 0.2 - 2 / cpu_by_process.HZ


def test_a_gone_process_has_no_kind_and_no_command_gets_the_usage_line():
    assert cpu_by_process.kind("999999999") is None
    assert cpu_by_process.main(["out.json"]) == 2  # no command: the usage line


def test_it_runs_a_command_and_writes_its_table(tmp_path):
    """The command burns 0.3 s of CPU, then waits for a marker that the test writes once a sample has counted that
    much for its process: the table holds it (a process's last 2 s unsampled lose nothing here)."""
    import json

    out, marker = tmp_path / "cpu.json", tmp_path / "seen"
    code = ("import os, time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
            f"while not os.path.exists({str(marker)!r}): time.sleep(0.05)")

    kinds = []

    def on_sample(sampler, proc):
        if sum(cpu for (pid, _), cpu in sampler.last.items() if pid == str(proc.pid)) >= 0.3 and not kinds:
            kinds.append(cpu_by_process.kind(str(proc.pid)))  # the kind its seconds went to
            marker.touch()  # the command's own 0.3 s are in the totals

    rc, totals = cpu_by_process.run([sys.executable, "-c", code], out, on_sample)
    assert rc == 0 and json.loads(out.read_text()) == totals
    assert kinds and kinds[0] is not None and totals[kinds[0]] >= 0.3, (kinds, totals)
