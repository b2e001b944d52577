"""What does storage latency cost training? The same Ray Train run (`python pipeline/run.py train`, the test preset,
N steps, a log step every 2 steps, a checkpoint every C steps, run.storage in S3) with nothing added to each S3 request and with +L ms added by a
proxy in front of the server (bench/fault_proxy.py), side by side in one run. Goal: training time with latency /
without <= 1.2.

    python bench/storage_latency.py                     # 150 steps, +50 ms per request, each side once
    python bench/storage_latency.py --checkpoint-every 50   # checkpoints apart
    python bench/storage_latency.py --repeat 2 --latency-ms 100
    python bench/storage_latency.py --upload async      # ray.checkpoint_upload=async (default: the run's default)
    python bench/storage_latency.py --smoke

Training time: from the first to the last train/loss the run logged (MLflow's timestamps, local store), so Ray's
start and the dataset's preparation are left out. The dataset is the built-in corpus prepared into the bucket once
(through the proxy, no latency). Requests to <run>/progress.json are counted too (rank 0's progress record). Writes
bench/results/storage_latency_s<steps>_l<ms>_c<checkpoint_every>-<device>-<date>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import write_result  # noqa: E402
from bench.fault_proxy import FaultProxy  # noqa: E402
from bench.s3_server import SeaweedS3  # noqa: E402
from pipeline.tracking.names import TRAIN_LOSS  # noqa: E402

RUN = [sys.executable, str(ROOT / "pipeline" / "run.py")]


def training_seconds(run_root: Path, run_name: str) -> tuple[float, int]:
    """(seconds from the first to the last train/loss logged, steps between them) of a finished run."""
    from mlflow.tracking import MlflowClient

    record = json.loads((run_root / run_name / "run.json").read_text())
    client = MlflowClient(f"sqlite:///{run_root / 'mlflow.db'}")
    history = sorted(client.get_metric_history(record["mlflow_run_id"], TRAIN_LOSS), key=lambda m: m.step)
    return (history[-1].timestamp - history[0].timestamp) / 1000, history[-1].step - history[0].step


def one_run(args: list[str], env: dict, proxy: FaultProxy, run_root: Path, name: str, latency_s: float) -> dict:
    proxy.clear()
    proxy.reset_log()
    if latency_s:
        proxy.latency(latency_s)
    t0 = time.perf_counter()
    proc = subprocess.run([*RUN, "train", *args, f"--run.name={name}"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1800)
    wall = time.perf_counter() - t0
    proxy.clear()
    if proc.returncode != 0:
        raise RuntimeError(f"train exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    seconds, steps = training_seconds(run_root, name)
    return {"latency_ms": latency_s * 1000, "training_seconds": seconds, "steps_timed": steps,
            "command_seconds": wall, "requests_total": proxy.count(),
            "progress_requests": proxy.count(r" \S*/progress\.json"),
            "checkpoint_requests": proxy.count(r" \S*/checkpoint_"),
            "shard_requests": proxy.count(r" \S*/(train|val)-\d+\.parquet"),
            "stop_requests": proxy.count(r" \S*/STOP[ ?]")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--latency-ms", type=float, default=50.0, help="added to every S3 request by the proxy")
    p.add_argument("--log-every", type=int, default=2, help="train.log_every (the test preset's)")
    p.add_argument("--checkpoint-every", type=int, default=4, help="train.checkpoint_every (the test preset's: 4)")
    p.add_argument("--upload", choices=("sync", "async"), default=None,
                   help="ray.checkpoint_upload for both sides (default: the run's own default)")
    p.add_argument("--repeat", type=int, default=1, help="alternate the two sides this many times each")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if a.smoke:
        a.steps, a.latency_ms = 20, 10.0
    runs: dict[str, list[dict]] = {"none": [], "latency": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        server = SeaweedS3(tmp / "s3").start()
        proxy = FaultProxy("127.0.0.1", server.port).start()
        try:
            bucket = server.create_bucket("longtrain-bench")
            # Every S3 client of the command and of its Ray workers (a local Ray it starts inherits this) goes
            # through the proxy.
            env = {**os.environ, **server.env, "AWS_ENDPOINT_URL": proxy.endpoint, "PYTHONPATH": str(ROOT)}
            run_root = tmp / "runs"
            common = ["--preset", "test", f"--run.root={run_root}", f"--run.storage={bucket}/store"]
            prep = subprocess.run([*RUN, "prepare", *common], cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=1800)
            if prep.returncode != 0:
                raise RuntimeError(f"prepare exited {prep.returncode}:\n{prep.stdout[-3000:]}\n{prep.stderr[-3000:]}")
            args = [*common, f"--train.max_steps={a.steps}", f"--train.log_every={a.log_every}",
                    f"--train.checkpoint_every={a.checkpoint_every}", "--train.sample_tokens=0"]
            if a.upload:
                args.append(f"--ray.checkpoint_upload={a.upload}")
            for i in range(a.repeat):
                for side, latency in (("none", 0.0), ("latency", a.latency_ms / 1000)):
                    r = one_run(args, env, proxy, run_root, f"{side}-{i}", latency)
                    runs[side].append(r)
                    print(f"+{r['latency_ms']:g} ms: training {r['training_seconds']:.1f} s ({r['steps_timed']} "
                          f"steps), command {r['command_seconds']:.1f} s; {r['requests_total']} requests, "
                          f"{r['progress_requests']} to progress.json, {r['checkpoint_requests']} to checkpoints, "
                          f"{r['shard_requests']} to shards", flush=True)
        finally:
            proxy.stop()
            server.stop()
    none = statistics.median(r["training_seconds"] for r in runs["none"])
    slow = statistics.median(r["training_seconds"] for r in runs["latency"])
    ratio = slow / none
    print(f"{a.steps} steps, a log step every {a.log_every}: training {none:.1f} s without added latency, {slow:.1f} s "
          f"with +{a.latency_ms:g} ms per request: {ratio:.2f}x (goal <= 1.2x)")
    payload = {"runs": runs, "training_seconds_none": none, "training_seconds_latency": slow, "ratio": ratio,
               "goal_ratio": 1.2, "load_average": list(os.getloadavg()),
               "s3": "local SeaweedFS behind bench/fault_proxy.py (same machine)",
               "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}}
    upload = f"_{a.upload}" if a.upload else ""
    path = write_result(f"storage_latency_s{a.steps}_l{a.latency_ms:g}_c{a.checkpoint_every}{upload}", payload, a.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
