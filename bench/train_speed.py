"""The training-speed table, measured: for each tier, seq_len, document-length distribution, attention
backend, activation-checkpointing setting and micro-batch: tokens/s, both MFU figures, the attention pairs
computed, peak memory, compile time and data-wait share. Ray-free; shards are read from disk. Writes
markdown and JSON under bench/results/.

    python bench/train_speed.py                                   # tiers A B C, seq 32768 and 4096
    python bench/train_speed.py --tiers B --seq-lens 32768 --batch-sizes 1 2 4 --ac none every_2 all
    python bench/train_speed.py --tiers A B C --seq-lens 32768 --batch-sizes 2 --doc-lens web 8192 \
        --attention flex varlen sdpa                              # the attention-backend comparison
    python bench/train_speed.py --smoke                           # nano on CPU, seconds
    python bench/train_speed.py --count-only --seq-lens 32768     # FLOPs per token only: no training, any host

Columns: `mfu` counts the FLOPs computed (matmuls + the within-document causal attention pairs of the rows
actually trained on); `mfu_causal_eq` counts every row's whole causal T^2/2 attention (the convention before
document-aware counting); `attn_pairs` is computed pairs over that T^2/2 (1.00 without document masking).
`--doc-lens` (pipeline/data/synthetic.py): web (log-normal, median 400 tokens, like web text), a geometric
mean such as 8192 (seq_len / 4 at 32k), lognormal:MEDIAN:SIGMA, manifest:DATASET_DIR. The plain-causal
backends `sdpa` and `cudnn` run without document masking (the unmasked baseline on the same rows); `flex`,
`varlen`, `dense` and `auto` with it (unless --no-doc-masking).

A configuration that runs out of memory is recorded as `oom` and the sweep goes on.
"""
from __future__ import annotations

import argparse
import gc
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import write_result  # noqa: E402
from bench.engine_throughput import measure  # noqa: E402
from pipeline.data.synthetic import parse_doc_lengths  # noqa: E402

COLUMNS = ("tier", "seq_len", "doc_len", "attention", "doc_masking", "batch_size", "activation_checkpointing",
           "compile", "status", "tokens_per_s", "mfu", "mfu_causal_equiv", "attn_pairs_frac", "peak_mem_gib",
           "step_time_s", "compile_s_estimate", "data_wait_frac")
HEADERS = {"activation_checkpointing": "ac", "mfu_causal_equiv": "mfu_causal_eq", "attn_pairs_frac": "attn_pairs",
           "compile_s_estimate": "compile_s", "data_wait_frac": "data_wait"}
PLAIN_CAUSAL = ("sdpa", "cudnn")  # attention backends that run without document masking here


def fmt(row: dict, key: str) -> str:
    v = row.get(key)
    if v is None:
        return "-"
    if key in ("mfu", "mfu_causal_equiv"):
        return "-" if v != v else f"{100 * v:.1f}%"
    if key == "attn_pairs_frac":
        return "-" if v != v else f"{v:.3f}"
    if key == "doc_masking":
        return "on" if v else "off"
    if key == "data_wait_frac":
        return f"{100 * v:.2f}%"
    if key == "tokens_per_s":
        return f"{v:,.0f}"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(HEADERS.get(c, c) for c in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(fmt(r, c) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def count_table(tiers: list[str], seq_lens: list[int], dists: list, vocab_size: int, rows: int = 64) -> list[dict]:
    """Executed vs causal-equivalent training FLOPs per token, counted on `rows` synthetic rows per distribution
    (no model runs): what the two MFU columns differ by at a given tokens/s."""
    from model.flops import (attention_flops_per_pair, flops_per_token, matmul_flops_per_token,
                             within_document_causal_pairs)
    from model.tiers import get_tier
    from pipeline.data.synthetic import synthetic_row

    out = []
    for seq_len, dist in itertools.product(seq_lens, dists):
        doc_ids = torch.from_numpy(np.stack([synthetic_row(i, seq_len, vocab_size, doc_lengths=dist)[1][:-1]
                                             for i in range(rows)]))
        pairs = int(within_document_causal_pairs(doc_ids))
        docs_per_row = float((doc_ids[:, -1] + 1).double().mean())
        for tier_name in tiers:
            tier = get_tier(tier_name)
            causal = flops_per_token(tier, seq_len, vocab_size)
            executed = (matmul_flops_per_token(tier, vocab_size) * rows * seq_len
                        + attention_flops_per_pair(tier) * pairs) / (rows * seq_len)
            out.append({"tier": tier_name, "seq_len": seq_len, "doc_len": dist.label, "docs_per_row": docs_per_row,
                        "attn_pairs_frac": pairs / (rows * seq_len * seq_len / 2),
                        "causal_equiv_gflop_per_token": causal / 1e9, "executed_gflop_per_token": executed / 1e9,
                        "executed_over_causal_equiv": executed / causal})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiers", nargs="+", default=["A", "B", "C"])
    p.add_argument("--seq-lens", nargs="+", type=int, default=[32768, 4096])
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--ac", nargs="+", default=["none"], help="activation checkpointing settings to try")
    p.add_argument("--attention", nargs="+", default=["auto"],
                   choices=("auto", "flex", "varlen", "cudnn", "sdpa", "dense"), help="model.attention backends")
    p.add_argument("--doc-lens", nargs="+", default=["web", "8192"],
                   help="document-length distributions of the synthetic rows (see pipeline/data/synthetic.py)")
    p.add_argument("--no-doc-masking", action="store_true", help="every backend without document masking")
    p.add_argument("--compile", default="auto", choices=("auto", "on", "off"))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--count-only", action="store_true",
                   help="print executed vs causal-equivalent FLOPs per token for the distributions; train nothing")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if a.smoke:
        a.tiers, a.seq_lens, a.batch_sizes, a.steps, a.warmup, a.vocab_size = ["nano"], [64], [1, 2], 2, 1, 512
        if a.doc_lens == ["web", "8192"]:
            a.doc_lens = ["web", "16"]  # 64-token rows: web documents are longer than a row, so add short ones
    dists = [parse_doc_lengths(d) for d in a.doc_lens]  # a bad spec fails here, before anything runs
    for d in dists:
        print(f"doc lengths {d.describe()}")
    if a.count_only:
        counts = count_table(a.tiers, a.seq_lens, dists, a.vocab_size)
        keys = list(counts[0])
        table = "\n".join(["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)] + [
            "| " + " | ".join(f"{r[k]:.3f}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |"
            for r in counts]) + "\n"
        print("\n" + table)
        path = write_result("flop_counts", {"rows": counts, "markdown": table,
                                            "doc_lengths": {d.label: d.describe() for d in dists}}, a.out)
        print(f"wrote {path}")
        return 0
    rows = []
    for tier, seq_len, dist, attention, ac in itertools.product(a.tiers, a.seq_lens, dists, a.attention, a.ac):
        doc_masking = not (a.no_doc_masking or attention in PLAIN_CAUSAL)
        for bs in a.batch_sizes:
            base = {"tier": tier, "seq_len": seq_len, "doc_len": dist.label, "attention": attention,
                    "doc_masking": doc_masking, "batch_size": bs, "activation_checkpointing": ac, "compile": a.compile}
            try:
                row = measure(tier, seq_len, bs, steps=a.steps, warmup=a.warmup, vocab_size=a.vocab_size,
                              compile_mode=a.compile, activation_checkpointing=ac, attention=attention,
                              doc_masking=doc_masking, doc_lengths=dist) | {"status": "ok"}
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
    path = write_result("train_speed", {"rows": rows, "markdown": table, "args": args,
                                        "doc_lengths": {d.label: d.describe() for d in dists}}, a.out)
    md = path.with_suffix(".md")
    legend = "".join(f"- doc_len {d.describe()}\n" for d in dists)
    md.write_text(f"# train_speed ({path.stem})\n\n{legend}\n{table}")
    print(f"wrote {path} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
