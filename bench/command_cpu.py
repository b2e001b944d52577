"""CPU seconds of one `pipeline/run.py` command, by process, the way the system tests run their commands: in a
subprocess that joins a Ray this script started (as they join the session's Ray, tests/conftest.py `ray_address`).
Every process of the tree is sampled (bench/data_throughput.py `TreeCPU`): the command's own driver, the Ray
worker processes its job starts (Ray Train's controller, workers, placement-group cleaner ...) and Ray's daemons.
It shows where a system test's time goes on a small machine, where CPU, not waiting, is the limit (docs/tests.md).

    python bench/command_cpu.py -- train --preset test --train.max_steps=4 --tracking.enabled=false
    python bench/command_cpu.py --repeat 3 -- train --preset test --train.max_steps=4 --tracking.enabled=false
    python bench/command_cpu.py --no-ray -- --help          # no Ray: the command's own start-up alone

The command runs once first, uncounted (it prepares what it needs: a dataset, compiled bytecode), then `--repeat`
times counted, each with `--run.root` (a temporary directory unless given) and its own `--run.name` added when the
command is `train`. Prints, per counted run, the wall time and the CPU-s of each process kind (sampled every 0.25 s)
with the number of processes started during the run, and the command's own process exactly (its CPU time as the
kernel counted it when it exited, `command_cpu_s`); `--out FILE` writes the same as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.data_throughput import TreeCPU  # noqa: E402

TEST_ENV = {  # what tests/conftest.py sets for every Ray the tests start (Ray Train's controller polls faster ...)
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_METRICS_ENABLED": "0"}


def _command(args: list[str], root: Path, name: str, address: str) -> list[str]:
    cmd = [sys.executable, str(ROOT / "pipeline" / "run.py"), *args]
    if args and not args[0].startswith("-"):
        cmd.append(f"--run.root={root}")
        if args[0] == "train":
            cmd.append(f"--run.name={name}")
        if address:
            cmd += ["--address", address]
    return cmd


def measure(args: list[str], repeat: int = 1, root: Path | None = None, ray: bool = True,
            settle_s: float = 2.0) -> list[dict]:
    """One uncounted run, then `repeat` counted ones; a dict per counted run (see the module's docstring)."""
    for k, v in TEST_ENV.items():
        os.environ.setdefault(k, v)
    address = ""
    if ray:
        import ray as ray_mod

        from pipeline.ray_runtime import start_local_ray

        start_local_ray(num_cpus=8)  # as the tests' session Ray
        address = ray_mod.get_runtime_context().gcs_address
    root = root or Path(tempfile.mkdtemp(prefix="command-cpu-"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    rows = []
    try:
        for i in range(repeat + 1):
            cmd = _command(args, root, f"cpu{i}", address)
            tree = TreeCPU().start()
            t0 = time.monotonic()
            reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
            res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
            wall = time.monotonic() - t0
            # the command's own process exactly, as the kernel counted it when it was reaped (with whatever it reaped
            # itself); the tree's sampling misses a process's last 0.25 s, and all of a command shorter than that
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            own = (after.ru_utime - reaped.ru_utime) + (after.ru_stime - reaped.ru_stime)
            time.sleep(settle_s)  # the job's processes going away still count
            total = tree.stop()
            if res.returncode != 0:
                raise SystemExit(f"error: the command exited with {res.returncode}: {' '.join(cmd)}\n"
                                 f"{(res.stdout + res.stderr)[-3000:]}")
            if i == 0:
                continue  # the uncounted first run
            rows.append({"run": i, "wall_s": round(wall, 2), "cpu_s": round(total, 2), "command_cpu_s": round(own, 3),
                         "processes_started": tree.processes_started,
                         "started_cpu_s": round(tree.started_cpu_seconds, 2),
                         "by_kind": {k: round(v, 2) for k, v in sorted(tree.by_kind.items(), key=lambda kv: -kv[1])
                                     if v >= 0.05}})
    finally:
        if ray:
            import ray as ray_mod

            ray_mod.shutdown()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=1, help="counted runs (after one uncounted run)")
    p.add_argument("--run-root", type=Path, default=None, help="the commands' run.root (default: a temporary dir)")
    p.add_argument("--no-ray", action="store_true", help="start no Ray and pass no --address")
    p.add_argument("--settle-s", type=float, default=2.0,
                   help="seconds after each run that still count (its Ray processes going away)")
    p.add_argument("--out", type=Path, default=None, help="also write the figures as JSON")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then pipeline/run.py's arguments")
    ns = p.parse_args(argv)
    args = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    if not args:
        p.error("give the command after --, e.g. -- train --preset test --train.max_steps=4")
    if ns.repeat < 1:
        p.error("--repeat must be >= 1")
    rows = measure(args, ns.repeat, ns.run_root, ray=not ns.no_ray, settle_s=ns.settle_s)
    for row in rows:
        print(f"run {row['run']}: wall {row['wall_s']:.1f} s, CPU {row['cpu_s']:.1f} s "
              f"({row['processes_started']} processes started, {row['started_cpu_s']:.1f} CPU-s of them; the command's "
              f"own process {row['command_cpu_s']:.2f} CPU-s, exact)")
        for kind, cpu in row["by_kind"].items():
            print(f"  {cpu:6.2f} CPU-s  {kind}")
    if ns.out:
        ns.out.write_text(json.dumps({"command": args, "ray": not ns.no_ray, "cpus": os.cpu_count(),
                                      "runs": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
