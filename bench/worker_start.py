"""Start-up of Ray worker processes on a fresh local Ray: a job runtime_env against the same variable inherited
from the raylet's environment (how pipeline/ray_runtime.py's start_local_ray passes RAY_API_SERVER_ADDRESS).

With a job runtime_env, Ray starts each of the job's worker processes through its setup_worker.py, which
imports part of Ray and then execs the worker: one more Python start per process. Each round starts a fresh
local Ray per side (alternated) and times, after ray.init, one task and N actors answering a call: N + 1
worker processes started from nothing.

    python bench/worker_start.py                 # 7 actors, 3 rounds
    python bench/worker_start.py --actors 15 --rounds 5

Writes bench/results/worker_start-*.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import write_result  # noqa: E402

VAR, VALUE = "RAY_API_SERVER_ADDRESS", "http://127.0.0.1:1"

CHILD = """
import json, logging, os, sys, time
import ray
side, n = sys.argv[1], int(sys.argv[2])
kw = dict(num_cpus=n + 1, include_dashboard=False, logging_level=logging.ERROR,
          _system_config={"prestart_worker_first_driver": False})
if side == "runtime_env":
    ray.init(runtime_env={"env_vars": {VAR: VALUE}}, **kw)
else:
    os.environ[VAR] = VALUE
    ray.init(**kw)
    del os.environ[VAR]

@ray.remote
def probe():
    return os.environ.get(VAR)

@ray.remote
class Probe:
    def env(self):
        return os.environ.get(VAR)

t0 = time.perf_counter()
seen = [ray.get(probe.remote())] + ray.get([a.env.remote() for a in [Probe.remote() for _ in range(n)]])
dt = time.perf_counter() - t0
assert seen == [VALUE] * (n + 1), seen
print(json.dumps({"seconds": dt}))
ray.shutdown()
""".replace("VAR", repr(VAR)).replace("VALUE", repr(VALUE))

SIDES = ("runtime_env", "inherited")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--actors", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out-dir", type=Path, default=None)
    args = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", VAR)}
    times: dict[str, list[float]] = {s: [] for s in SIDES}
    for r in range(args.rounds):
        for side in SIDES if r % 2 == 0 else SIDES[::-1]:
            proc = subprocess.run([sys.executable, "-c", CHILD, side, str(args.actors)], env=env,
                                  capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                sys.exit(f"{side} round {r} failed:\n{proc.stderr[-3000:]}")
            times[side].append(json.loads(proc.stdout.strip().splitlines()[-1])["seconds"])
            print(f"round {r}  {side:12s} {times[side][-1]:6.2f} s for {args.actors + 1} worker processes", flush=True)
    med = {s: statistics.median(v) for s, v in times.items()}
    ratio = med["runtime_env"] / med["inherited"]
    print(f"median: runtime_env {med['runtime_env']:.2f} s, inherited {med['inherited']:.2f} s; "
          f"ratio (runtime_env / inherited) {ratio:.2f}")
    path = write_result("worker_start", {"shapes": {"actors": args.actors, "tasks": 1, "rounds": args.rounds},
                                         "seconds": times, "median_s": med, "ratio_runtime_env_over_inherited": ratio},
                        args.out_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
