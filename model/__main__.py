"""Print every tier of both model families with its exact parameter count and training FLOPs per token.

    python -m model                 # vocabulary of 32,000: attention tiers, resonance tiers, mixture-of-experts tiers
    python -m model --vocab 2000

Models are built on the meta device (no memory, no initialization time), so even tier D prints instantly. The
mixture-of-experts tiers (`<tier>-moe`, both families) get a table of their own: experts, k, expert width, and the
total parameters (what memory holds) beside the active ones (what a token computes, what FLOPs count).
"""
from __future__ import annotations

import argparse

import torch

from model.decoder import Decoder
from model.flops import active_param_count, flops_per_token, resonance_flops_per_token
from model.resonance import ResonanceLM
from model.tiers import MIXERS, RESONANCE_TIERS, TIERS, tiers_for

SEQ_LENS = (4096, 32768)


def tier_rows(vocab_size: int) -> list[dict]:
    rows = []
    for tier in (t for t in TIERS.values() if t.moe is None):
        with torch.device("meta"):
            model = Decoder(tier, vocab_size)
        row = {"tier": tier.name, "d_model": tier.d_model, "layers": tier.n_layers, "heads": tier.n_heads,
               "kv_heads": tier.n_kv_heads, "head_dim": tier.head_dim, "d_ff": tier.d_ff,
               "max_seq_len": tier.max_seq_len, "params": model.num_params(),
               "non_embedding": model.num_params(exclude_embedding=True)}
        for T in SEQ_LENS:
            row[f"flops_per_token@{T}"] = flops_per_token(tier, T, vocab_size)
        rows.append(row)
    return rows


def resonance_rows(vocab_size: int) -> list[dict]:
    rows = []
    for tier in (t for t in RESONANCE_TIERS.values() if t.moe is None):
        with torch.device("meta"):
            model = ResonanceLM(tier, vocab_size)
        row = {"tier": tier.name, "d_model": tier.d_model, "layers": tier.n_layers, "groups": tier.n_groups,
               "eigen": tier.n_eigen, "d_ff": tier.d_ff, "chunk": tier.chunk_size, "max_seq_len": tier.max_seq_len,
               "params": model.num_params(), "non_embedding": model.num_params(exclude_embedding=True)}
        for T in SEQ_LENS:
            row[f"flops_per_token@{T}"] = resonance_flops_per_token(tier, T, vocab_size)
        rows.append(row)
    return rows


def moe_rows(vocab_size: int) -> list[dict]:
    """Every mixture-of-experts tier of both families: its MoESpec, total and active parameters, FLOPs per token."""
    rows = []
    for mixer in MIXERS:
        for tier in (t for t in tiers_for(mixer).values() if t.moe is not None):
            with torch.device("meta"):
                model = (Decoder if mixer == "attention" else ResonanceLM)(tier, vocab_size)
            spec = tier.moe
            row = {"tier": tier.name, "mixer": mixer, "d_model": tier.d_model, "layers": tier.n_layers,
                   "experts": spec.num_experts, "k": spec.experts_per_token, "expert_ffn": spec.expert_ffn,
                   "shared": spec.shared_experts, "dense_first": spec.dense_first_layers,
                   "params": model.num_params(), "active": active_param_count(tier, vocab_size)}
            for T in SEQ_LENS:
                row[f"flops_per_token@{T}"] = (flops_per_token(tier, T, vocab_size) if mixer == "attention"
                                               else resonance_flops_per_token(tier, T, vocab_size))
            rows.append(row)
    return rows


def _print_table(table: list[list[str]]) -> None:
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m model", description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary size (default 32000)")
    args = parser.parse_args(argv)
    if args.vocab < 1:
        parser.error(f"--vocab={args.vocab} must be a positive vocabulary size")
    header = ["tier", "d_model", "layers", "heads", "kv_heads", "head_dim", "d_ff", "max_seq_len", "params",
              "non_embedding"] + [f"GFLOP/tok@{T}" for T in SEQ_LENS]
    table = [header]
    for r in tier_rows(args.vocab):
        table.append([r["tier"], str(r["d_model"]), str(r["layers"]), str(r["heads"]), str(r["kv_heads"]),
                      str(r["head_dim"]), str(r["d_ff"]), str(r["max_seq_len"]), f"{r['params']:,}",
                      f"{r['non_embedding']:,}"] + [f"{r[f'flops_per_token@{T}'] / 1e9:.3f}" for T in SEQ_LENS])
    print(f"vocab_size={args.vocab:,}  tied embeddings  (FLOPs: training fwd+bwd per token, causal attention)")
    _print_table(table)
    header = ["tier", "d_model", "layers", "groups", "eigen/group", "d_ff", "chunk", "max_seq_len", "params",
              "non_embedding"] + [f"GFLOP/tok@{T}" for T in SEQ_LENS]
    table = [header] + [[r["tier"]] + [str(r[k]) for k in ("d_model", "layers", "groups", "eigen", "d_ff", "chunk",
                                                             "max_seq_len")]
                        + [f"{r['params']:,}", f"{r['non_embedding']:,}"]
                        + [f"{r[f'flops_per_token@{T}'] / 1e9:.3f}" for T in SEQ_LENS] for r in resonance_rows(args.vocab)]
    print(f"\nmodel.mixer=resonance  vocab_size={args.vocab:,}  tied embeddings  "
          "(FLOPs: training fwd+bwd per token, chunked-scan core as with doc masking)")
    _print_table(table)
    header = ["tier", "mixer", "d_model", "layers", "experts", "k", "expert_ffn", "shared", "dense_first", "params",
              "active"] + [f"GFLOP/tok@{T}" for T in SEQ_LENS]
    table = [header] + [[r["tier"], r["mixer"]] + [str(r[k]) for k in ("d_model", "layers", "experts", "k",
                                                                       "expert_ffn", "shared", "dense_first")]
                        + [f"{r['params']:,}", f"{r['active']:,}"]
                        + [f"{r[f'flops_per_token@{T}'] / 1e9:.3f}" for T in SEQ_LENS] for r in moe_rows(args.vocab)]
    print(f"\nmixture of experts (model/moe.py)  vocab_size={args.vocab:,}  tied embeddings  (params: total, held in "
          "memory; active: what one token computes, counted by the FLOPs)")
    _print_table(table)


if __name__ == "__main__":
    main()
