"""bench/command_cpu.py: the CPU seconds of one pipeline/run.py command, by process (without Ray here: the command's
own process; the Ray case is what docs/tests.md reports)."""
from __future__ import annotations

import json
import os

import pytest

from bench import command_cpu


# In the quick tier again (docs/tests.md): `runs` no longer loads torch, so the two runs of it take ~1 s in all
def test_counts_the_command_process_and_writes_json(tmp_path, capsys):
    out = tmp_path / "cpu.json"
    assert command_cpu.main(["--no-ray", "--run-root", str(tmp_path / "runs"), "--out", str(out), "--settle-s", "0",
                             "--", "runs"]) == 0
    (row,) = json.loads(out.read_text())["runs"]  # one counted run after the uncounted one
    assert row["run"] == 1 and row["wall_s"] > 0
    # the command's own interpreter start and imports, counted exactly when it exited (`runs` loads neither torch nor
    # Ray: ~0.2 CPU-s, which the 0.25-s sampling of the tree may catch in part or not at all)
    assert 0 < row["command_cpu_s"] < row["wall_s"] * (os.cpu_count() or 1)
    printed = capsys.readouterr().out
    assert printed.startswith("run 1: wall ") and f"own process {row['command_cpu_s']:.2f} CPU-s, exact" in printed


def test_a_failing_command_is_one_error_naming_its_exit_code(tmp_path):
    with pytest.raises(SystemExit, match=r"^error: the command exited with 2: "):
        command_cpu.measure(["no-such-command"], root=tmp_path, ray=False, settle_s=0)


def test_no_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        command_cpu.main(["--no-ray"])
    assert "give the command after --" in capsys.readouterr().err
