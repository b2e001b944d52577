"""Training step time with the downstream tasks scored beside it (eval.tasks, Ray Train's validation hook) against
none, side by side: the same Ray Train run (2 workers of 1 CPU each, the scoring task on a third CPU slot) with and
without eval.tasks, alternated over rounds. JSON to bench/results/tasks_beside_training-*.json.

    python bench/tasks_beside_training.py                     # 2 rounds of 60 steps, a checkpoint every 10
    python bench/tasks_beside_training.py --rounds 3 --steps 80 --workers 2 --eval-cpus 1

The step time is read from the run's own record: train/loss is logged at every step (rank 0, MLflow), and a step's
time is the gap between its timestamp and the previous step's. Two figures: the median step time over the whole
run (after its first 5 steps), and the median over the steps logged while a checkpoint was being scored (each
scoring's span: its eval/<task>/seconds before its scores were logged). Ratios are against the run without tasks.
Resource split: each worker reserves 1 CPU (torch threads 1), the scoring task eval.cpus; the local Ray has more
logical CPUs than that (pipeline/ray_runtime.py), and the machine's physical cores are reported beside the figures:
on fewer physical cores than workers + scoring, the three processes share them.
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


def run_once(cfg, run_dir: Path) -> dict:
    """One training session; returns its step timestamps and the scorings' spans (ms)."""
    from mlflow.tracking import MlflowClient

    from pipeline.tracking.names import TRAIN_LOSS, task_metric, task_seconds
    from pipeline.train.session.train_session import TrainSession, load_phases

    run_dir.mkdir(parents=True)
    TrainSession(cfg, run_dir, load_phases(None, cfg)).run()
    client = MlflowClient(tracking_uri=cfg.tracking.tracking_uri)
    run_id = json.loads((run_dir / "run.json").read_text())["mlflow_run_id"]
    steps = sorted((m.step, m.timestamp) for m in client.get_metric_history(run_id, TRAIN_LOSS))
    spans = []
    if cfg.eval.tasks:
        seconds = {m.step: m.value for m in client.get_metric_history(run_id, task_seconds("builtin_cloze"))}
        for m in client.get_metric_history(run_id, task_metric("builtin_cloze", "acc")):
            spans.append((m.timestamp - 1000 * seconds.get(m.step, 0.0), m.timestamp, m.step))
    return {"steps": steps, "spans": spans}


def step_times(record: dict, skip: int = 5) -> tuple[list[float], list[float]]:
    """(every step's time after the first `skip`, the steps' times logged inside a scoring span), seconds."""
    steps = record["steps"]
    all_, during = [], []
    for (s0, t0), (s1, t1) in zip(steps, steps[1:]):
        if s1 != s0 + 1 or s1 <= skip:
            continue
        all_.append((t1 - t0) / 1000)
        if any(a <= t0 and t1 <= b for a, b, _ in record["spans"]):
            during.append((t1 - t0) / 1000)
    return all_, during


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--eval-cpus", type=float, default=1.0)
    p.add_argument("--limit", type=float, default=40, help="cloze items scored per checkpoint")
    args = p.parse_args(argv)
    from pipeline.ray_runtime import start_local_ray
    from tests.pipeline.train.hf_helpers import build_dataset

    work = Path(tempfile.mkdtemp(prefix="bench-tasks-beside-"))
    start_local_ray(num_cpus=args.workers + int(args.eval_cpus + 0.999) + 2)
    base, _ = build_dataset(work / "data", seq_len=256, overrides={
        "run.root": str(work / "runs"), "tracking.tracking_uri": f"sqlite:///{work / 'mlflow.db'}",
        "train.max_steps": args.steps, "train.log_every": 1, "train.eval_every": args.steps,
        "train.checkpoint_every": args.checkpoint_every, "train.sample_tokens": 0, "train.batch_size": 4,
        "ray.num_workers": args.workers, "ray.cpus_per_worker": 1, "tracking.system_metrics": False,
        "eval.cpus": args.eval_cpus, "eval.limit": args.limit})
    variants = {"none": base, "tasks": base.replace({"eval.tasks": "builtin_cloze"})}
    records: dict[str, list[dict]] = {k: [] for k in variants}
    for r in range(args.rounds):
        for name, cfg in variants.items():
            records[name].append(run_once(cfg, work / "runs" / f"{name}-{r}"))
    figures = {}
    for name in variants:
        all_ = [t for rec in records[name] for t in step_times(rec)[0]]
        during = [t for rec in records[name] for t in step_times(rec)[1]]
        figures[name] = {"median_step_s": statistics.median(all_), "steps": len(all_),
                         "median_step_s_while_scoring": statistics.median(during) if during else None,
                         "steps_while_scoring": len(during),
                         "scorings": [len(rec["spans"]) for rec in records[name]]}
    none = figures["none"]["median_step_s"]
    figures["ratio_whole_run"] = figures["tasks"]["median_step_s"] / none
    if figures["tasks"]["median_step_s_while_scoring"]:
        figures["ratio_while_scoring"] = figures["tasks"]["median_step_s_while_scoring"] / none
    print(f"step time: none {none * 1000:.0f} ms; with tasks beside {figures['tasks']['median_step_s'] * 1000:.0f} ms "
          f"({figures['ratio_whole_run']:.3f}x over the run"
          + (f", {figures['ratio_while_scoring']:.3f}x on the {figures['tasks']['steps_while_scoring']} steps logged "
             f"while a checkpoint was scored" if "ratio_while_scoring" in figures else "") + ")")
    shapes = {"workers": args.workers, "cpus_per_worker": 1, "eval_cpus": args.eval_cpus, "steps": args.steps,
              "checkpoint_every": args.checkpoint_every, "cloze_items_per_scoring": args.limit,
              "tier": base.model.tier, "seq_len": base.data.seq_len, "batch_size": base.train.batch_size,
              "rounds": args.rounds, "physical_cores": os.cpu_count()}
    return write_result("tasks_beside_training", {"shapes": shapes, "figures": figures,
                                                  "goal": "step time with tasks beside <= 1.03x none (2 workers, "
                                                          "scoring on a third CPU slot)"})


if __name__ == "__main__":
    main()
