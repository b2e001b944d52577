"""Mixture of experts against dense on a CPU: quality at equal compute, balance, speed; and one MoE tier on a GPU.

    python bench/moe.py                      # the CPU comparison (nano vs nano-moe): ~20 minutes on 2 busy cores
    python bench/moe.py --steps 400          # shorter
    python bench/moe.py --smoke              # a few steps each: the plumbing
    python bench/moe.py --gpu --tier B-moe --seq-len 32768    # bench/gpu_check.py's moe_32k step (one GPU)

The CPU comparison. The built-in corpus (pipeline/data/builtin_corpus.py) tokenized with a 2,000-piece SentencePiece
model, packed into rows of 257 tokens (no document masking, so every model sees the same rows the same way), the
last 64 rows held out; four models trained on the same rows in the same order with the same schedule (AdamW, lr
3e-3, warmup 20, cosine to 0.1, batch 8, bf16 off) from the same seed:

    dense         tier nano (d_ff 192)
    moe_aux       nano-moe: 8 experts of 96, 2 per token (active MLP width 192 = nano's), balanced by the aux loss
    moe_bias      nano-moe balanced by the selection bias (model.moe_balance=bias) instead
    dense_total   nano with d_ff 768 (nano-wide, registered here): the MLP parameters nano-moe holds in all

so `dense` has moe_aux's active parameters (to the router's 1,024) and `dense_total` its total parameters. Reported:
each model's validation loss (mean over the held-out rows) and its ratio to dense's (goal: moe_aux <= 0.97); the
balance after warmup (moe/load_max, the worst layer's max/mean expert load over each 25-step window from step 100
on: goal <= 1.25, each method); tokens/s of training steps measured side by side (the engines take turns, one step
each, 12 rounds, median), MoE over dense at equal active parameters. Threads: --threads (default 1: the machine's
2 cores are shared, and two processes' OpenMP threads spinning on them would time the contention).

The GPU step (--gpu): one tier at --seq-len tokens, batch 1, bf16, compiled blocks, beside its dense twin (the tier
without -moe): tokens/s, MFU over the active parameters' FLOPs (the engine's train/mfu: executed expert FLOPs),
peak memory. Writes bench/results/moe-<device>-<date>.json (or moe_gpu-...).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import write_result  # noqa: E402
from pipeline.tracking import names  # noqa: E402

SEQ_LEN, VOCAB, BATCH, VAL_ROWS = 256, 2000, 8, 64
# the whole-model MoE metrics a window records (the per-layer ones are left out)
MOE_SUMMARY = (names.MOE_AUX_LOSS, names.MOE_Z_LOSS, names.MOE_LOAD_MAX, names.MOE_LOAD_MIN, names.MOE_DROPPED,
               names.MOE_BIAS_ABS_MAX)
WIDE = "nano-wide"  # nano with d_ff = 8 x 96: nano-moe's MLP parameters as one dense MLP
MODELS = {"dense": {"model.tier": "nano"},
          "moe_aux": {"model.tier": "nano-moe", "model.moe_balance": "aux"},
          "moe_bias": {"model.tier": "nano-moe", "model.moe_balance": "bias"},
          "dense_total": {"model.tier": WIDE}}


def register_wide_tier(num_experts: int = 0) -> None:
    """nano-wide: nano with the MLP parameters of nano-moe (with num_experts experts, when given) as one MLP."""
    from model.tiers import TIERS

    if WIDE not in TIERS:
        moe = TIERS["nano-moe"].moe
        experts = num_experts or moe.num_experts
        TIERS[WIDE] = dataclasses.replace(TIERS["nano"], name=WIDE, d_ff=experts * moe.expert_ffn)


def corpus_rows(seq_len: int, vocab: int, work: Path) -> torch.Tensor:
    """(rows, seq_len + 1) int64: the built-in corpus, tokenized and packed end to end (EOS between documents)."""
    from pipeline.data.builtin_corpus import builtin_document, builtin_items
    from pipeline.data.tokenizer import Tokenizer, train_tokenizer

    docs = [d for d in map(builtin_document, builtin_items()) if d]
    tok = Tokenizer(train_tokenizer(docs, vocab, work / "tokenizer.model", num_threads=1))
    stream = torch.tensor([t for ids in tok.encode_batch(docs) for t in ids + [tok.eos_id]], dtype=torch.int64)
    width = seq_len + 1
    return stream[: len(stream) // width * width].view(-1, width)


def make_engine(name: str, steps: int, seed: int, moe: dict):
    from pipeline.config import load_config
    from pipeline.train.engine import Engine

    settings = {**MODELS[name], **(moe if name.startswith("moe") else {})}
    cfg = load_config("cpu", {**settings, "data.seq_len": SEQ_LEN, "data.vocab_size": VOCAB,
                              "train.batch_size": BATCH, "train.max_steps": steps, "train.warmup_steps": 20,
                              "train.lr": 3e-3, "train.seed": seed, "model.doc_masking": False,
                              "model.compile": "off", "train.precision": "fp32"})
    return Engine(cfg, vocab_size=VOCAB, device=torch.device("cpu"))


def train_one(name: str, train: torch.Tensor, val: torch.Tensor, steps: int, seed: int, log_every: int,
              moe: dict) -> dict:
    from model.flops import active_param_count, param_count
    from pipeline.config import model_tier

    engine = make_engine(name, steps, seed, moe)
    tier = model_tier(engine.cfg)
    windows, t0 = [], time.perf_counter()
    for step in range(steps):
        rows = train[(step * BATCH) % (len(train) - BATCH):][:BATCH]
        engine.train_step([{"tokens": rows}])
        if (step + 1) % log_every == 0:
            m = engine.pull_train_metrics()
            windows.append({"step": step + 1, "train_loss": m[names.TRAIN_LOSS],
                            **{k: v for k, v in m.items() if k in MOE_SUMMARY}})
    seconds = time.perf_counter() - t0
    val_loss = engine.evaluate([{"tokens": val[i:i + BATCH]} for i in range(0, len(val), BATCH)])[names.VAL_LOSS]
    return {"engine": engine, "val_loss": val_loss, "train_seconds": seconds, "windows": windows,
            "params": param_count(tier, VOCAB), "active_params": active_param_count(tier, VOCAB),
            "settings": {**MODELS[name], **(moe if name.startswith("moe") else {})}}


def timed_steps(engines: dict, batch: torch.Tensor, rounds: int) -> dict[str, float]:
    """Median seconds of one training step of each engine, the engines taking turns (one step each per round)."""
    times: dict[str, list[float]] = {n: [] for n in engines}
    for _ in range(rounds):
        for name, engine in engines.items():
            t0 = time.perf_counter()
            engine.train_step([{"tokens": batch}])
            times[name].append(time.perf_counter() - t0)
    return {n: statistics.median(t) for n, t in times.items()}


def cpu_comparison(args) -> dict:
    register_wide_tier(args.experts)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-moe-") as tmp:
        rows = corpus_rows(SEQ_LEN, VOCAB, Path(tmp))
    train, val = rows[:-VAL_ROWS], rows[-VAL_ROWS:]
    print(f"built-in corpus: {rows.numel():,} tokens in {len(rows)} rows of {SEQ_LEN + 1}; {len(val)} held out; "
          f"{args.steps} steps x {BATCH} rows = {args.steps * BATCH / len(train):.2f} epochs", flush=True)
    results = {}
    moe = {"model.moe_aux_weight": args.aux_weight, "model.moe_bias_rate": args.bias_rate,
           **({"model.num_experts": args.experts} if args.experts else {})}
    for name in MODELS:
        r = train_one(name, train, val, args.steps, args.seed, args.log_every, moe)
        results[name] = r
        print(f"{name:12s} val loss {r['val_loss']:.4f}  params {r['params']:,} (active {r['active_params']:,})  "
              f"{r['train_seconds']:.0f} s", flush=True)
    engines = {n: results[n]["engine"] for n in ("dense", "moe_aux", "dense_total")}
    medians = timed_steps(engines, train[:BATCH], args.rounds)
    tokens = BATCH * SEQ_LEN
    speed = {n: tokens / s for n, s in medians.items()}
    dense = results["dense"]["val_loss"]
    after = args.steps // 2  # balance "after warmup": the second half of the run (the bias moves 1e-3 a step)
    balance = {}
    for name in ("moe_aux", "moe_bias"):
        late = [w[names.MOE_LOAD_MAX] for w in results[name]["windows"] if w["step"] > after]
        balance[name] = {"load_max_worst": max(late) if late else math.nan,
                         "load_max_mean": statistics.fmean(late) if late else math.nan, "windows_from_step": after,
                         "goal": 1.25}
    out = {
        "setup": {"seq_len": SEQ_LEN, "vocab": VOCAB, "batch": BATCH, "steps": args.steps, "threads": args.threads,
                  "val_rows": len(val), "train_rows": len(train), "seed": args.seed, "log_every": args.log_every,
                  "speed_rounds": args.rounds, "moe_aux_weight": args.aux_weight,
                  "moe_bias_rate": args.bias_rate, "num_experts": args.experts or None},
        "models": {n: {k: v for k, v in r.items() if k != "engine"} for n, r in results.items()},
        "quality": {n: {"val_loss": r["val_loss"], "over_dense": r["val_loss"] / dense} for n, r in results.items()},
        "quality_goal": {"moe_aux_over_dense_at_equal_active": 0.97},
        "balance": balance,
        "speed": {"tokens_per_s": speed, "step_s_median": medians,
                  "moe_over_dense_equal_active": speed["moe_aux"] / speed["dense"],
                  "moe_over_dense_equal_total": speed["moe_aux"] / speed["dense_total"]},
    }
    print(f"quality: moe_aux / dense val loss {out['quality']['moe_aux']['over_dense']:.4f} (goal <= 0.97); "
          f"moe_aux / dense_total {results['moe_aux']['val_loss'] / results['dense_total']['val_loss']:.4f}; "
          f"moe_bias / dense {out['quality']['moe_bias']['over_dense']:.4f}")
    for name, b in balance.items():
        print(f"balance {name}: max/mean load after step {after}: worst {b['load_max_worst']:.3f}, mean "
              f"{b['load_max_mean']:.3f} (goal <= 1.25)")
    print(f"speed: tokens/s dense {speed['dense']:,.0f}, moe {speed['moe_aux']:,.0f}, dense_total "
          f"{speed['dense_total']:,.0f}; moe / dense (equal active) {out['speed']['moe_over_dense_equal_active']:.3f}")
    return out


def gpu_step(args) -> dict:
    """One MoE tier and its dense twin at --seq-len on one device (bench/gpu_check.py's moe_32k step)."""
    from model.flops import active_param_count, param_count
    from pipeline.config import load_config, model_tier
    from pipeline.train.engine import Engine

    rows = {}
    for tier in (args.tier, args.tier.removesuffix("-moe")):
        cfg = load_config("gpu" if torch.cuda.is_available() else "cpu", {
            "model.tier": tier, "data.seq_len": args.seq_len, "data.vocab_size": 32000, "train.batch_size": 1,
            "model.doc_masking": False, "model.compile": args.compile})
        engine = Engine(cfg, vocab_size=32000)
        g = torch.Generator().manual_seed(0)
        batch = {"tokens": torch.randint(0, 32000, (1, args.seq_len + 1), generator=g)}
        for _ in range(args.warmup):
            engine.train_step([batch])
        engine.pull_train_metrics()
        for _ in range(args.steps):
            engine.train_step([batch])
        m = engine.pull_train_metrics()
        t = model_tier(cfg)
        rows[tier] = {"tokens_per_s": m[names.TRAIN_TOKENS_PER_S], "mfu": m.get(names.TRAIN_MFU, math.nan),
                      "peak_mem_gib": m[names.TRAIN_PEAK_MEM_GIB], "params": param_count(t, 32000),
                      "active_params": active_param_count(t, 32000),
                      "executed_flops_per_token": m[names.TRAIN_EXECUTED_FLOPS_PER_TOKEN],
                      "load_max": m.get(names.MOE_LOAD_MAX, math.nan)}
        print(f"{tier}: {m[names.TRAIN_TOKENS_PER_S]:,.0f} tokens/s, MFU {m.get(names.TRAIN_MFU, math.nan):.3f} "
              f"(active FLOPs), peak {m[names.TRAIN_PEAK_MEM_GIB]:.2f} GiB", flush=True)
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    moe, dense = rows[args.tier], rows[args.tier.removesuffix("-moe")]
    return {"setup": {"tier": args.tier, "seq_len": args.seq_len, "steps": args.steps, "warmup": args.warmup,
                      "compile": args.compile},
            "rows": rows, "moe_over_dense_tokens_per_s": moe["tokens_per_s"] / dense["tokens_per_s"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1600, help="optimizer steps per model (CPU) or timed steps (--gpu)")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--rounds", type=int, default=12, help="timed steps per model in the side-by-side speed phase")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--aux-weight", type=float, default=0.01, help="model.moe_aux_weight of moe_aux (default 0.01)")
    p.add_argument("--bias-rate", type=float, default=0.001, help="model.moe_bias_rate of moe_bias (default 0.001)")
    p.add_argument("--experts", type=int, default=0,
                   help="model.num_experts of the MoE models (default: nano-moe's 8; 2 per token, 96 wide either way, "
                        "so the active parameters stay dense's and the total grows; dense_total follows)")
    p.add_argument("--tag", default="", help="appended to the result's name (moe_<tag>-...json)")
    p.add_argument("--smoke", action="store_true", help="a few steps each: the plumbing, not the figures")
    p.add_argument("--gpu", action="store_true", help="the one-GPU step: --tier at --seq-len beside its dense twin")
    p.add_argument("--tier", default="B-moe")
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", default="auto", choices=("auto", "on", "off"))
    p.add_argument("--out", type=Path, default=None, help="results directory (default bench/results)")
    a = p.parse_args(argv)
    if a.gpu:
        if a.smoke:
            a.tier, a.seq_len, a.steps, a.warmup, a.compile = "nano-moe", 64, 2, 1, "off"
        if not a.tier.endswith("-moe"):
            p.error(f"--tier {a.tier}: choose a -moe tier (its dense twin is measured beside it)")
        path = write_result("moe_gpu", gpu_step(a), a.out)
    else:
        if a.smoke:
            a.steps, a.log_every, a.rounds = 8, 4, 2
        path = write_result("moe" + (f"_{a.tag}" if a.tag else ""), cpu_comparison(a), a.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
