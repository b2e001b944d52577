"""How often does evaluation re-read the validation split from object storage? The requests a Ray-free training run
makes to an S3 server over N steps with an evaluation every few steps, counted by a proxy in front of the server
(bench/fault_proxy.py), with a new validation reader per evaluation ("before": the manifest, every shard's footer and
its row groups fetched again each time) against one reader kept for the run (pipeline/data/shards.py EvalSplit,
"after"), the two side by side in one run; and the run's wall clock with latency added to every request.

    python bench/eval_reads.py                          # nano, 150 steps, eval every 4, +50 ms per request
    python bench/eval_reads.py --latency-ms 0 --steps 300
    python bench/eval_reads.py --smoke

The dataset is synthetic rows of the real shard format (pipeline/data/synthetic.py) in a SeaweedFS started here,
several validation shards so each evaluation touches several files. Writes
bench/results/eval_reads_<tier>_s<steps>_e<eval_every>-<device>-<date>.json.
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
from bench.data_wait import upload  # noqa: E402
from bench.fault_proxy import FaultProxy  # noqa: E402
from bench.s3_server import SeaweedS3  # noqa: E402
from pipeline import storage  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.data.synthetic import write_synthetic_dataset  # noqa: E402


def one_run(cfg, dataset: str, side: str, proxy: FaultProxy) -> dict:
    """One Ray-free training run of cfg.train.max_steps steps; the requests it made, by kind, and its wall clock."""
    import torch

    from pipeline.data.shards import EvalSplit, ShardReader, eval_reader
    from pipeline.train.engine import Engine
    from pipeline.train.loop import EVAL_DATA_WAIT, Hooks, fit

    t = cfg.train
    engine = Engine(cfg, 2000, torch.device("cpu"))
    if side == "before":
        def val_batches():  # what every evaluation did before: a reader of its own
            return eval_reader(dataset, t.batch_size)
    else:
        val_batches = EvalSplit(dataset, t.batch_size)

    def train_batches(epoch: int, start: int):
        return ShardReader(dataset, "train", t.batch_size, seed=t.seed, epoch=epoch, start=start)

    waits: list[float] = []
    proxy.reset_log()
    t0 = time.perf_counter()
    fit(engine, train_batches, val_batches, Hooks(on_eval=lambda e, m: waits.append(m[EVAL_DATA_WAIT])),
        progress=False)
    wall = time.perf_counter() - t0
    val = proxy.requests(r" \S*/val-\d+\.parquet ")
    per_file: dict[str, int] = {}
    for r in val:
        name = r.line.split()[1].rsplit("/", 1)[-1]
        per_file[name] = per_file.get(name, 0) + (r.line.startswith("GET "))
    return {"evaluations": len(waits), "requests_total": proxy.count(),
            "manifest_gets": proxy.count(r"^GET \S*/manifest\.json "),
            "val_gets": sum(r.line.startswith("GET ") for r in val),
            "val_heads": sum(r.line.startswith("HEAD ") for r in val),
            "val_gets_per_file_max": max(per_file.values(), default=0),
            "train_gets": proxy.count(r"^GET \S*/train-\d+\.parquet "),
            "eval_data_wait_mean": statistics.fmean(waits) if waits else 0.0, "fit_seconds": wall}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tier", default="nano")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument("--eval-batches", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--latency-ms", type=float, default=50.0, help="added to every request by the proxy")
    p.add_argument("--val-rows", type=int, default=64)
    p.add_argument("--rows-per-shard", type=int, default=16)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if a.smoke:
        a.steps, a.eval_every, a.latency_ms = 12, 4, 10.0
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        server = SeaweedS3(tmp / "s3").start()
        proxy = FaultProxy("127.0.0.1", server.port).start()
        try:
            os.environ.update(server.env)
            bucket = server.create_bucket("longtrain-bench")
            os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint  # every read below is counted (and delayed) by the proxy
            write_synthetic_dataset(tmp / "ds", n_train=512, n_val=a.val_rows, seq_len=a.seq_len, vocab_size=2000,
                                    rows_per_shard=a.rows_per_shard)
            dataset = storage.join(bucket, "eval_reads")
            upload(tmp / "ds", dataset)
            cfg = load_config("cpu", {"model.tier": a.tier, "model.compile": "off", "data.seq_len": a.seq_len,
                                      "train.batch_size": a.batch_size, "train.max_steps": a.steps,
                                      "train.eval_every": a.eval_every, "train.eval_batches": a.eval_batches,
                                      "train.log_every": 10, "train.warmup_steps": 2,
                                      "eval.tasks": ""})  # the cpu preset's downstream task would read more
            proxy.latency(a.latency_ms / 1000)
            runs = {}
            for side in ("before", "after"):
                runs[side] = one_run(cfg, dataset, side, proxy)
                r = runs[side]
                print(f"{side:6s}: {r['evaluations']} evaluations; validation split {r['val_gets']} GETs "
                      f"({r['val_gets_per_file_max']} of one file at most), {r['val_heads']} HEADs; manifest "
                      f"{r['manifest_gets']} GETs; {r['requests_total']} requests in all; eval/data_wait "
                      f"{r['eval_data_wait_mean']:.2f}; {r['fit_seconds']:.1f} s", flush=True)
        finally:
            proxy.stop()
            server.stop()
    b, f = runs["before"], runs["after"]
    print(f"{a.steps} steps, an evaluation every {a.eval_every} ({b['evaluations']} in all), +{a.latency_ms:g} ms per "
          f"request: validation GETs {b['val_gets']} -> {f['val_gets']}, HEADs {b['val_heads']} -> {f['val_heads']}, "
          f"manifest GETs {b['manifest_gets']} -> {f['manifest_gets']}; wall clock {b['fit_seconds']:.1f} s -> "
          f"{f['fit_seconds']:.1f} s")
    args = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
    payload = {"runs": runs, "val_shards": -(-a.val_rows // a.rows_per_shard), "load_average": list(os.getloadavg()),
               "s3": "local SeaweedFS behind bench/fault_proxy.py (same machine)", "args": args}
    path = write_result(f"eval_reads_{a.tier}_s{a.steps}_e{a.eval_every}", payload, a.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
