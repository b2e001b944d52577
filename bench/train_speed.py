"""The batch-size / memory table, measured: for each tier and micro-batch, tokens/s, MFU (causal
attention counted), peak memory, compile time and data-wait share, at seq_len 32768 (and 4096 for
reference). Ray-free; shards are read from disk. Writes markdown and JSON under bench/results/.

    python bench/train_speed.py                                   # tiers A B C, seq 32768 and 4096
    python bench/train_speed.py --tiers B --seq-lens 32768 --batch-sizes 1 2 4 --ac none every_2 all
    python bench/train_speed.py --smoke                           # nano on CPU, seconds

A configuration that runs out of memory is recorded as `oom` and the sweep goes on.
"""
from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import write_result  # noqa: E402
from bench.engine_throughput import measure  # noqa: E402

COLUMNS = ("tier", "seq_len", "batch_size", "activation_checkpointing", "compile", "status", "tokens_per_s", "mfu",
           "peak_mem_gib", "step_time_s", "compile_s_estimate", "data_wait_frac")


def fmt(row: dict, key: str) -> str:
    v = row.get(key)
    if v is None:
        return "-"
    if key == "mfu":
        return "-" if v != v else f"{100 * v:.1f}%"
    if key == "data_wait_frac":
        return f"{100 * v:.2f}%"
    if key == "tokens_per_s":
        return f"{v:,.0f}"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(fmt(r, c) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiers", nargs="+", default=["A", "B", "C"])
    p.add_argument("--seq-lens", nargs="+", type=int, default=[32768, 4096])
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--ac", nargs="+", default=["none"], help="activation checkpointing settings to try")
    p.add_argument("--compile", default="auto", choices=("auto", "on", "off"))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if a.smoke:
        a.tiers, a.seq_lens, a.batch_sizes, a.steps, a.warmup, a.vocab_size = ["nano"], [64], [1, 2], 2, 1, 512
    rows = []
    for tier in a.tiers:
        for seq_len in a.seq_lens:
            for ac in a.ac:
                for bs in a.batch_sizes:
                    base = {"tier": tier, "seq_len": seq_len, "batch_size": bs, "activation_checkpointing": ac,
                            "compile": a.compile}
                    try:
                        row = measure(tier, seq_len, bs, steps=a.steps, warmup=a.warmup, vocab_size=a.vocab_size,
                                      compile_mode=a.compile, activation_checkpointing=ac) | {"status": "ok"}
                    except torch.OutOfMemoryError:
                        row = base | {"status": "oom"}
                        gc.collect()
                        if torch.cuda.is_available():
                            torch.cuda.empty_cache()
                    rows.append(row)
                    print(" | ".join(fmt(row, c) for c in COLUMNS), flush=True)
                    if row["status"] == "oom":
                        break  # larger batches at this setting cannot fit either
    table = markdown(rows)
    print("\n" + table)
    args = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
    path = write_result("train_speed", {"rows": rows, "markdown": table, "args": args},
                        a.out)
    md = path.with_suffix(".md")
    md.write_text(f"# train_speed ({path.stem})\n\n{table}")
    print(f"wrote {path} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
