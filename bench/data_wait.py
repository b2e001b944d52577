"""Does reading shards from object storage keep training fed, and does mixing sources cost the step anything? The
`train/data_wait` share of a Ray Train run (the fraction of the training loop's wall-clock time spent waiting for
the next batch, pipeline/train/loop.py) reading one dataset from an S3 server against reading the same bytes from
local disk, and reading a mixture of three local datasets (0.5 / 0.3 / 0.2 by tokens, pipeline/data/mixture.py)
against the one dataset, the sides alternated in one run.

    python bench/data_wait.py                                   # nano on CPU; S3 = a SeaweedFS started here
    python bench/data_wait.py --sides local,mixture             # one source against a 3-source mixture only
    python bench/data_wait.py --storage s3://my-bucket/bench    # a real bucket (credentials from the environment)
    python bench/data_wait.py --tier B --seq-len 32768 --batch-size 1 --steps 60   # on a GPU
    python bench/data_wait.py --smoke

The dataset is synthetic rows of the real shard format (pipeline/data/synthetic.py), larger than a worker's
row-group cache by default, so the S3 side keeps fetching (ranged GETs of ~1 MiB row groups) through the run. The
mixture's three sources are synthetic datasets of a third of those rows each (other seeds), on local disk.
Ray Train's checkpoints stay on local disk on both sides: only the data path differs. Each run tracks to
MLFLOW_TRACKING_URI, else a throwaway MLflow store; the share is read from its `train/data_wait` history: the first logging window
(the stream's start-up) apart from the steady state (the mean of the later windows). The local S3 server
shares this machine's cores with training: on a cluster the object store is elsewhere.
Writes bench/results/data_wait_<tier>_s<seq>_b<batch>-<device>-<date>.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import write_result  # noqa: E402
from pipeline import storage  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.data.synthetic import write_synthetic_dataset  # noqa: E402
from pipeline.tracking.names import TRAIN_DATA_WAIT, TRAIN_TOKENS_PER_S  # noqa: E402

CACHE_MIB = 128  # ShardReader's default row-group cache per reader (pipeline/data/shards.py)


def upload(local: Path, target: str) -> int:
    """Copy a dataset directory to `target` (manifest last, as prepare publishes); returns the bytes copied."""
    files = sorted(f for f in local.rglob("*") if f.is_file())
    files.sort(key=lambda f: f.name == "manifest.json")
    for f in files:
        storage.write_bytes(storage.join(target, f.relative_to(local).as_posix()), f.read_bytes())
    return sum(f.stat().st_size for f in files)


MIXTURE_WEIGHTS = (0.5, 0.3, 0.2)


def write_mixture(tmp: Path, rows: int, a, cfg) -> tuple[str, str]:
    """Three synthetic datasets of rows // 3 rows each and the mixture naming them; (mixture dir, data.mixture)."""
    import json

    from pipeline.data.mixture_prepare import prepare_mixture

    sources = []
    for i, w in enumerate(MIXTURE_WEIGHTS):
        write_synthetic_dataset(tmp / f"mix{i}", n_train=rows // 3, n_val=4 * a.batch_size, seq_len=a.seq_len,
                                vocab_size=2000, seed=10 + i, rows_per_shard=a.rows_per_shard)
        sources.append({"name": f"src{i}", "weight": w, "dataset_dir": str(tmp / f"mix{i}")})
    mixture = json.dumps(sources)
    return str(prepare_mixture(cfg.replace({"data.mixture": mixture}))), mixture


def one_run(cfg, dataset: str, run_dir: Path, name: str) -> dict:
    """One Ray Train run; its data-wait and throughput per logging window, from its MLflow history."""
    from pipeline.tracking.tracker import open_tracker
    from pipeline.train.ray_train import run_training

    tracker = open_tracker(cfg, run_name=name)
    t0 = time.perf_counter()
    run_training(cfg, dataset, run_dir, mlflow_run_id=tracker.run_id)
    wall = time.perf_counter() - t0
    tracker.finish("FINISHED")
    history = {m: [x.value for x in sorted(tracker.client.get_metric_history(tracker.run_id, m), key=lambda x: x.step)]
               for m in (TRAIN_DATA_WAIT, TRAIN_TOKENS_PER_S)}
    wait, tps = history[TRAIN_DATA_WAIT], history[TRAIN_TOKENS_PER_S]
    return {"startup_window_data_wait": wait[0], "steady_data_wait": statistics.fmean(wait[1:]),
            "steady_tokens_per_s": statistics.fmean(tps[1:]), "windows": wait, "fit_seconds": wall}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tier", default="nano")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--log-every", type=int, default=10, help="the logging window: one data_wait figure each")
    p.add_argument("--rows", type=int, default=0, help="training rows (default: twice the reader's cache)")
    p.add_argument("--rows-per-shard", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=2, help="alternate the sides this many times each")
    p.add_argument("--storage", default="", help="a bucket prefix to use instead of starting a local SeaweedFS")
    p.add_argument("--sides", default="local,s3,mixture",
                   help="what to alternate: local (one dataset on disk), s3 (the same in a bucket), mixture (three "
                        "local datasets mixed 0.5/0.3/0.2)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if a.smoke:
        a.seq_len, a.batch_size, a.steps, a.log_every, a.rows, a.rows_per_shard, a.repeat = 64, 2, 12, 4, 512, 128, 1
    sides = [x.strip() for x in a.sides.split(",") if x.strip()]
    if not sides or set(sides) - {"local", "s3", "mixture"} or "local" not in sides:
        p.error(f"--sides {a.sides!r}: choose from local, s3, mixture, local included (the others are compared to it)")
    import ray

    from pipeline.ray_runtime import ensure_ray

    server = None
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        try:
            if not a.storage and "s3" in sides:  # before Ray starts: its workers inherit the endpoint and key
                from bench.s3_server import SeaweedS3

                server = SeaweedS3(tmp / "s3").start()
                os.environ.update(server.env)
                a.storage = server.create_bucket("longtrain-bench") + "/data_wait"
            row_bytes = (a.seq_len + 1) * 2
            rows = a.rows or 2 * CACHE_MIB * 2**20 // row_bytes
            write_synthetic_dataset(tmp / "ds", n_train=rows, n_val=4 * a.batch_size, seq_len=a.seq_len,
                                    vocab_size=2000, rows_per_shard=a.rows_per_shard)
            nbytes = sum(f.stat().st_size for f in (tmp / "ds").rglob("*") if f.is_file())
            datasets = {"local": str(tmp / "ds")}
            if "s3" in sides:
                remote = storage.join(a.storage, f"ds-{os.getpid()}")
                upload(tmp / "ds", remote)
                datasets["s3"] = remote
            cfg = load_config("cpu", {"model.tier": a.tier, "data.seq_len": a.seq_len, "train.batch_size": a.batch_size,
                                      "train.max_steps": a.steps, "train.log_every": a.log_every,
                                      "train.eval_every": 10**6, "train.checkpoint_every": 10**6,
                                      "train.sample_tokens": 0, "run.root": str(tmp / "runs"),
                                      "tracking.tracking_uri": os.environ.get("MLFLOW_TRACKING_URI")
                                      or f"sqlite:///{tmp / 'mlflow.db'}",
                                      "tracking.system_metrics": False, "tracking.experiment": "data_wait"})
            configs = {side: cfg for side in sides}
            if "mixture" in sides:
                datasets["mixture"], mixture = write_mixture(tmp, rows, a, cfg)
                configs["mixture"] = cfg.replace({"data.mixture": mixture})
            ensure_ray(None, cfg)
            runs: dict[str, list[dict]] = {side: [] for side in sides}
            for r in range(a.repeat):
                for side in sides:
                    got = one_run(configs[side], datasets[side], tmp / "runs" / f"{side}{r}", f"{side}-{r}")
                    runs[side].append(got)
                    print(f"repeat {r} {side:5s}: data_wait {got['steady_data_wait']:.2%} steady, "
                          f"{got['startup_window_data_wait']:.1%} in the first window; "
                          f"{got['steady_tokens_per_s']:,.0f} tokens/s", flush=True)
        finally:
            if server is not None:
                server.stop()
            elif "remote" in locals():  # a real bucket: leave nothing behind
                storage.delete(remote)
            ray.shutdown()
    summary = {side: {k: statistics.median(x[k] for x in got) for k in
                      ("steady_data_wait", "startup_window_data_wait", "steady_tokens_per_s", "fit_seconds")}
               for side, got in runs.items()}
    local = summary["local"]
    payload: dict = {}
    head = (f"{a.tier} seq_len={a.seq_len} batch={a.batch_size}, {rows:,} rows ({nbytes / 2**20:.0f} MiB, reader cache "
            f"{CACHE_MIB} MiB)")
    if "s3" in sides:
        ratio = summary["s3"]["steady_tokens_per_s"] / local["steady_tokens_per_s"]
        payload.update(tokens_per_s_ratio_s3_over_local=ratio,
                       s3="local SeaweedFS (same machine)" if server else a.storage)
        print(f"{head}: data_wait steady {local['steady_data_wait']:.2%} local disk vs "
              f"{summary['s3']['steady_data_wait']:.2%} S3 ({'local SeaweedFS' if server else a.storage}); first "
              f"window {local['startup_window_data_wait']:.1%} vs {summary['s3']['startup_window_data_wait']:.1%}; "
              f"tokens/s S3 / local {ratio:.3f}")
    if "mixture" in sides:
        mix = summary["mixture"]
        ratio = mix["steady_tokens_per_s"] / local["steady_tokens_per_s"]
        gap_pp = 100 * (mix["steady_data_wait"] - local["steady_data_wait"])
        payload.update(tokens_per_s_ratio_mixture_over_local=ratio, data_wait_pp_mixture_minus_local=gap_pp,
                       mixture_weights=list(MIXTURE_WEIGHTS))
        print(f"{head}: data_wait steady {local['steady_data_wait']:.2%} one dataset vs {mix['steady_data_wait']:.2%} "
              f"a 3-source mixture (0.5/0.3/0.2; {gap_pp:+.2f} percentage points); first window "
              f"{local['startup_window_data_wait']:.1%} vs {mix['startup_window_data_wait']:.1%}; tokens/s mixture / "
              f"one dataset {ratio:.3f}")
    args = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
    payload.update({"summary": summary, "runs": runs, "rows": rows, "sides": sides,
                    "dataset_mib": round(nbytes / 2**20, 1), "reader_cache_mib": CACHE_MIB,
                    "load_average": list(os.getloadavg()), "args": args})
    path = write_result(f"data_wait_{a.tier}_s{a.seq_len}_b{a.batch_size}", payload, a.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
