"""Where a command's CPU goes, by kind of process: run it, sample every process of the machine every 2 s, and add each
process's CPU-time since the last sample to the kind it has now (Ray retitles a worker per task: `ray::IDLE`,
`ray::RayTrainWorker`, `ray::MapBatches`, ...). Linux only (/proc).

    .venv/bin/python tests/cpu_by_process.py cpu.json -- tests/suite.sh
    .venv/bin/python tests/cpu_by_process.py cpu.json -- .venv/bin/python -m pytest -q -m "not system"

Writes {kind: CPU seconds} (largest first) to the JSON file every minute and at the end, and prints the top 25. What
it cannot see: a process that starts and ends between two samples, and the last 2 s of any process; and a command
line that holds a known word anywhere (a path under pytest's temporary directory) counts under that word. Every
process of the machine counts, so run it on an otherwise idle machine. docs/tests.md has what it found on the whole
suite.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HZ = os.sysconf("SC_CLK_TCK")
PERIOD_S = 2.0
# Known commands, by a piece of their command line (first match wins); the rest by their first words.
KINDS = ("default_worker.py", "/raylet/raylet", "gcs_server", "dashboard/agent.py", "dashboard/dashboard.py",
         "runtime_env/agent", "log_monitor", "autoscaler/_private/monitor.py", "weed", "mlflow server", "uvicorn",
         "pytest", "pipeline/run.py", "pip", "ray start", "tests.pipeline.hosts")


def kind(pid: str) -> str | None:
    """The kind of process `pid` is now, or None once it is gone."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
    if not cmd:
        return "kernel"
    if cmd.startswith("ray::"):
        return "ray::" + re.split(r"[\s(]", cmd[5:], maxsplit=1)[0]
    hit = next((k for k in KINDS if k in cmd), None)
    if hit == "default_worker.py":
        return "ray worker starting"  # not yet retitled: the interpreter, `import ray`, connecting
    if hit:
        return hit
    return f"{comm}: {' '.join(Path(w).name for w in cmd.split()[:2])}"


class Sampler:
    def __init__(self) -> None:
        self.last: dict[tuple[str, str], float] = {}  # (pid, start time) -> CPU seconds at the last sample
        self.totals: dict[str, float] = {}
        self.first = True

    def sample(self) -> None:
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            cpu = (int(fields[11]) + int(fields[12])) / HZ  # utime + stime
            key = (pid, fields[19])  # a pid reused later is another process
            before = self.last.get(key, cpu if self.first else 0.0)  # what ran before the command is not counted
            self.last[key] = cpu
            if cpu > before and (k := kind(pid)) is not None:
                self.totals[k] = self.totals.get(k, 0.0) + cpu - before
        self.first = False

    def write(self, path: Path) -> dict[str, float]:
        out = {k: round(v, 1) for k, v in sorted(self.totals.items(), key=lambda kv: -kv[1])}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=1))
        tmp.replace(path)
        return out


def run(command: list[str], out: Path, on_sample=None) -> tuple[int, dict[str, float]]:
    """Run `command`, sampling until it ends; (its exit code, the totals written to `out`). `on_sample(sampler,
    proc)` is called after each sample."""
    sampler = Sampler()
    sampler.sample()
    proc = subprocess.Popen(command)
    written = time.monotonic()
    while proc.poll() is None:
        time.sleep(PERIOD_S)
        sampler.sample()
        if on_sample is not None:
            on_sample(sampler, proc)
        if time.monotonic() - written > 60:
            sampler.write(out)
            written = time.monotonic()
    sampler.sample()
    return proc.returncode, sampler.write(out)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: cpu_by_process.py OUT.json -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    code, totals = run(argv[2:], Path(argv[0]))
    total = sum(totals.values()) or 1.0
    for k, v in list(totals.items())[:25]:
        print(f"{v:9.1f} s  {100 * v / total:5.1f} %  {k}")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
