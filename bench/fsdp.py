"""FSDP against the unsharded engine, side by side on this machine's GPUs: tokens/s (all GPUs and per GPU), MFU on
the FLOPs executed and HFU (with the forward activation checkpointing recomputes), and peak memory per GPU measured
beside the memory model's prediction, for each tier:micro-batch at one activation-checkpointing setting.

    python bench/fsdp.py --cases D:2 E:1 --ac all                      # one H100: FSDP on a one-GPU group
    python bench/fsdp.py --cases E:1 F:1 --ac every_2 --workers 8      # one 8-GPU node: FSDP over 8, DDP beside it
    python bench/fsdp.py --smoke                                       # nano on CPU, seconds

Unsharded means the one-process engine on one GPU and DDP over --workers GPUs; a configuration that runs out of
memory is recorded as `oom` (a full copy of tier E or F usually is) and the others go on. On one GPU FSDP shards
over one worker: nothing is divided, but the blocks compute from bf16 copies gathered per block instead of
autocast's copies kept for the whole step, and its hooks, copies and checkpoint layout are what a cluster runs.
Ray-free: the workers are local processes under torch.distributed (pipeline/train/distributed/process_group.py). Writes
bench/results/fsdp-<device>-<date>.json.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import write_result  # noqa: E402
from bench.engine_throughput import measure  # noqa: E402

COLUMNS = ("tier", "batch_size", "activation_checkpointing", "parallel", "workers", "status", "tokens_per_s",
           "tokens_per_s_per_gpu", "mfu", "hfu", "peak_mem_gib", "predicted_peak_gib", "step_time_s")


def _worker(rank: int, world: int, kw: dict) -> dict:
    return measure(rank=rank, world_size=world, **kw)


def run_case(tier: str, batch: int, parallel: str, workers: int, kw: dict, data_dir: Path) -> dict:
    """One measured row; `oom` when any worker runs out of memory."""
    from pipeline.config import load_config
    from pipeline.train.memory.plan import GIB, estimate

    args = dict(kw, tier=tier, seq_len=kw["seq_len"], batch_size=batch, parallel=parallel, data_dir=str(data_dir))
    row = {"tier": tier, "batch_size": batch, "activation_checkpointing": kw["activation_checkpointing"],
           "parallel": parallel, "workers": workers, "seq_len": kw["seq_len"]}
    cfg = load_config("gpu" if torch.cuda.is_available() else "cpu", {
        "model.tier": tier, "data.seq_len": kw["seq_len"], "train.batch_size": batch,
        "model.activation_checkpointing": kw["activation_checkpointing"], "model.compile": kw["compile_mode"]})
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    est = estimate(cfg, kw["vocab_size"], workers=workers, parallel="ddp" if parallel == "none" else parallel,
                   device_type=device_type)
    row["predicted_peak_gib"] = est.total / GIB
    if not (data_dir / "manifest.json").exists():  # written once, here: the workers only read it
        from pipeline.data.synthetic import parse_doc_lengths, write_synthetic_dataset

        write_synthetic_dataset(data_dir, n_train=(kw["warmup"] + kw["steps"] + 3) * batch * workers, n_val=batch,
                                seq_len=kw["seq_len"], vocab_size=kw["vocab_size"],
                                doc_lengths=parse_doc_lengths(kw["doc_lengths"]))
    try:
        if workers == 1:
            row.update(measure(**{k: v for k, v in args.items() if k not in ("tier", "batch_size", "seq_len")},
                               tier=tier, seq_len=kw["seq_len"], batch_size=batch), status="ok")
        else:
            from pipeline.train.distributed.process_group import run_workers

            row.update(run_workers(_worker, workers, args)[0], status="ok")
    except Exception as exc:  # noqa: BLE001 -- an OOM (in this process or a worker's) is a result, not a failure
        if "out of memory" not in str(exc).lower() and not isinstance(exc, torch.OutOfMemoryError):
            raise
        row["status"] = "oom"
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return row


def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "-" if v != v else f"{v:,.0f}" if v >= 1000 else f"{v:.3f}"
    return str(v)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="+", default=["D:2", "E:1"], help="tier:micro-batch pairs")
    p.add_argument("--ac", default="all", help="model.activation_checkpointing for every case")
    p.add_argument("--workers", type=int, default=1, help="GPUs (local processes); 1 = FSDP on a one-GPU group")
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--compile", default="auto", choices=("auto", "on", "off"))
    p.add_argument("--doc-len", default="web")
    p.add_argument("--smoke", action="store_true", help="nano on CPU at 64 tokens, two steps")
    p.add_argument("--out", type=Path, default=None, help="results directory (default bench/results)")
    a = p.parse_args(argv)
    if a.smoke:
        a.cases, a.seq_len, a.steps, a.warmup, a.vocab_size = ["nano:2"], 64, 2, 1, 512
    cases = [(c.split(":")[0], int(c.split(":")[1])) for c in a.cases]
    kw = dict(seq_len=a.seq_len, steps=a.steps, warmup=a.warmup, vocab_size=a.vocab_size, compile_mode=a.compile,
              activation_checkpointing=a.ac, doc_lengths=a.doc_len)
    rows = []
    unsharded = "none" if a.workers == 1 else "ddp"
    with tempfile.TemporaryDirectory() as tmp:
        for i, (tier, batch) in enumerate(cases):
            data = Path(tmp) / f"data{i}"  # both modes read the same rows
            for mode in (unsharded, "fsdp"):
                row = run_case(tier, batch, mode, a.workers, kw, data)
                rows.append(row)
                print("  ".join(f"{c}={fmt(row.get(c))}" for c in COLUMNS), flush=True)
    ratios = {}
    for tier, batch in cases:
        base, sharded = (next(r for r in rows if (r["tier"], r["batch_size"], r["parallel"]) == (tier, batch, m))
                         for m in (unsharded, "fsdp"))
        if base["status"] == sharded["status"] == "ok":
            ratios[f"{tier}:{batch}"] = sharded["tokens_per_s"] / base["tokens_per_s"]
            print(f"{tier} batch {batch}: FSDP / {unsharded} tokens/s = {ratios[f'{tier}:{batch}']:.3f}, peak "
                  f"{sharded['peak_mem_gib']:.2f} vs {base['peak_mem_gib']:.2f} GiB")
    path = write_result("fsdp", {"rows": rows, "fsdp_over_unsharded_tokens_per_s": ratios,
                                 "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}},
                        a.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
