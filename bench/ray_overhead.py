"""Step time of the Ray Train path against the Ray-free engine: same model, same shards, same steps,
measured the same way (the data audit's per-step timestamps, median interval after warm-up), in one
run with the two sides alternated. Goal: Ray Train / Ray-free <= 1.05.

Both sides compute with the same number of torch threads: a Ray Train worker gets `worker_cpus(cfg)`
CPUs and Ray sets its OMP_NUM_THREADS to that, so the Ray-free side is given the same count.

    python bench/ray_overhead.py                          # nano at seq_len 256, 1 worker, CPU
    python bench/ray_overhead.py --tier A --seq-len 2048 --steps 60 --repeat 3
    python bench/ray_overhead.py --smoke

Needs Ray (it measures Ray's overhead). Writes bench/results/ray_overhead_<tier>_s<seq>_b<batch>-*.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import write_result  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.data.synthetic import write_synthetic_dataset  # noqa: E402


def step_intervals(audit_file: Path, warmup: int) -> list[float]:
    recs = [json.loads(x) for x in audit_file.read_text().splitlines() if x.strip()]
    times = {r["step"]: r["time"] for r in recs}  # the surviving attempt of each step
    steps = sorted(times)
    return [times[b] - times[a] for a, b in zip(steps, steps[1:]) if a >= warmup]


def run_local(cfg, dataset: Path, run_dir: Path, warmup: int) -> list[float]:
    from pipeline.train.local import train_local

    train_local(cfg, dataset, run_dir, None, audit_data=True)
    return step_intervals(run_dir / "data_audit" / "rank_0.jsonl", warmup)


def run_ray(cfg, dataset: Path, run_dir: Path, warmup: int) -> list[float]:
    from pipeline.train.ray_train import run_training

    run_training(cfg, dataset, run_dir, audit_data=True)
    return step_intervals(run_dir / "data_audit" / "rank_0.jsonl", warmup)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tier", default="nano")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeat", type=int, default=3, help="alternate local / Ray this many times each")
    p.add_argument("--cpus-per-worker", type=int, default=0, help="ray.cpus_per_worker (0 = auto)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if a.smoke:
        a.seq_len, a.batch_size, a.steps, a.warmup, a.repeat = 32, 2, 8, 2, 1
    import ray
    import torch

    from pipeline.ray_runtime import ensure_ray, worker_cpus

    rows = {"local": [], "ray": []}
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_synthetic_dataset(tmp / "ds", n_train=a.steps * a.batch_size, n_val=a.batch_size, seq_len=a.seq_len,
                                vocab_size=2000)
        cfg = load_config("cpu", {"model.tier": a.tier, "data.seq_len": a.seq_len, "train.batch_size": a.batch_size,
                                  "train.max_steps": a.steps, "train.log_every": 10, "train.eval_every": 10**6,
                                  "train.checkpoint_every": 10**6, "train.sample_tokens": 0, "model.compile": "off",
                                  "tracking.enabled": False, "run.root": str(tmp),
                                  "ray.cpus_per_worker": a.cpus_per_worker})
        threads = worker_cpus(cfg)
        ensure_ray(None, cfg)
        torch.set_num_threads(threads)  # what the Ray Train worker computes with (its OMP_NUM_THREADS)
        for r in range(a.repeat):
            local = run_local(cfg, tmp / "ds", tmp / f"local{r}", a.warmup)
            remote = run_ray(cfg, tmp / "ds", tmp / f"ray{r}", a.warmup)
            ratios.append(statistics.median(remote) / statistics.median(local))
            print(f"repeat {r}: Ray-free {statistics.median(local) * 1e3:.1f} ms, "
                  f"Ray Train {statistics.median(remote) * 1e3:.1f} ms, ratio {ratios[-1]:.3f}", flush=True)
            rows["local"] += local
            rows["ray"] += remote
    med = {k: statistics.median(v) for k, v in rows.items()}
    ratio = med["ray"] / med["local"]
    print(f"{a.tier} seq_len={a.seq_len} batch={a.batch_size} threads={threads}: median step Ray-free "
          f"{med['local'] * 1e3:.1f} ms, Ray Train {med['ray'] * 1e3:.1f} ms, ratio {ratio:.3f} "
          f"(per repeat {min(ratios):.3f}-{max(ratios):.3f}; goal <= 1.05)")
    args = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
    payload = {"median_step_s": med, "ratio": ratio, "ratio_per_repeat": ratios, "torch_threads": threads,
               "samples": {k: len(v) for k, v in rows.items()}, "load_average": list(os.getloadavg()), "args": args}
    path = write_result(f"ray_overhead_{a.tier}_s{a.seq_len}_b{a.batch_size}", payload, a.out)
    print(f"wrote {path}")
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
