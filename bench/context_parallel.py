#!/usr/bin/env python
"""Context parallelism against its degree: measured on this machine's CPU with gloo, and predicted for GPUs.

    python bench/context_parallel.py                                 # both families at cp 1, 2, 4 (~10 min, 2 cores)
    python bench/context_parallel.py --mixers attention --degrees 1 2 --steps 2
    python bench/context_parallel.py --smoke                         # the plumbing at its smallest
    python bench/context_parallel.py --predict-only                  # the GPU prediction alone, no run
    python bench/context_parallel.py --gpu-rows resonance:32768:1 resonance:131072:2 attention:32768:1 \
        attention:65536:2 --tier B --steps 5                         # 2+ GPUs: tokens/s and memory per GPU

Measured, for each family and degree d (a gloo group of d processes, data 1 x context d, DDP; cp = 1 one process
under a one-worker group, so that every degree keeps its gradients in DDP's buckets alike), on the same rows of web-
length documents (document masking on):
  step_s           the median training step after a warm-up step (forward, backward, the gradient all-reduce,
                   AdamW), each process with one torch thread (so cp = d uses d cores, and cp = 4 on two cores shares
                   them): with a gloo group up, two OpenMP threads in one process ran a step 5x slower than one (1.8 s
                   against 0.35 s, resonance nano at 4,096 tokens under DDP on one worker), gloo's threads taking the
                   second core from its barriers
  sent_bytes       what each rank wrote to its sockets during a step (/proc/self/io wchar: gloo's TCP pairs), beside
                   the byte model: pipeline/train/distributed/context_parallel.py bytes_per_step (the row split's
                   collectives) plus DDP's ring all-reduce of the fp32 gradients, 2 (d - 1) / d x 4 P; goal: within
                   10 %
  activation_peak  the most memory a step holds beyond the weights and AdamW's moments, per rank: the counted tensor
                   storage of a step (pipeline/train/memory/limit.py) less what is resident when it starts; goals: cp 2
                   at <= 0.65 x and cp 4 at <= 0.4 x of cp 1 (the gathered K and V are not kept for backward: model/
                   context.py attend_gathered)
Predicted: tier B at 131,072 tokens, one document, on H100s joined by NVLink at cp = 2, 4, 8: the bytes each GPU sends
per step for the row split (the same byte model, bf16, NCCL's ring) over an assumed NVLink bandwidth, against the
step's compute at the MFU tier B measured at 32k on one H100 (docs/benchmarks.md), plus an assumed latency per
collective, no overlap (the gathers are waited for): the overhead, for one document and for web-length documents; beside torchtitan's published FSDP + CP figures (its docs/performance.md, Table 2: Llama 3.1 8B
on 8 H100s, the sequence length growing with the degree, so per-GPU tokens/s there mixes the longer attention in).
On GPUs (--gpu-rows MIXER:SEQ_LEN:DEGREE ...): each row on DEGREE GPUs (NCCL, data 1 x context DEGREE, the engine as
configured on CUDA: bf16, compiled blocks, flex attention, the scan kernel), web-length documents: tokens/s per GPU
after --warmup steps and the peak memory per GPU (torch.cuda.max_memory_allocated); a row out of memory is `oom`, one
the config refuses (attention's tiers hold at most 32,768 tokens of a row per GPU) `refused` with its line.
Writes bench/results/context_parallel-<device>-<date>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import write_result  # noqa: E402

GOALS = {2: 0.65, 4: 0.4}  # activation peak at cp = d over cp = 1's
H100_BF16_PEAK = 989e12  # FLOP/s, dense bf16 (H100 SXM)
H100_TIER_B_MFU = 0.326  # executed MFU of tier B at 32,768 x 2 on one H100 (README, docs/benchmarks.md)
NVLINK_BYTES_PER_S = 360e9  # NCCL ring bus bandwidth on one 8-GPU H100 NVLink node (of 450 GB/s each way), assumed
NCCL_LATENCY_S = 20e-6  # per collective on NVLink, assumed
# torchtitan docs/performance.md, Table 2: FSDP + CP + torch.compile + Float8, Llama 3.1 8B, 8 H100s, local batch 1,
# full activation checkpointing; (FSDP, CP, sequence length, tokens/s per GPU)
TORCHTITAN_CP = [(8, 1, 32768, 3890), (4, 2, 65536, 2540), (2, 4, 131072, 1071), (1, 8, 262144, 548)]


def socket_bytes_written() -> int:
    """This process's bytes passed to write()/writev() (/proc/self/io wchar): gloo's TCP sends during a step."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no wchar line")


def resident_bytes(engine) -> int:
    """Bytes of the parameters, gradients and optimizer state alive now (each storage once)."""
    seen: dict[int, int] = {}
    tensors = [*engine.module.parameters(), *(p.grad for p in engine.module.parameters() if p.grad is not None)]
    tensors += [v for st in engine.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        storage = getattr(t, "_local_tensor", t).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _worker(rank: int, world: int, kw: dict) -> dict:
    from pipeline.config import load_config
    from pipeline.data.synthetic import synthetic_batches
    from pipeline.train.engine import Engine

    torch.set_num_threads(1)  # module docstring: OpenMP's barriers beside gloo's threads
    cfg = load_config("cpu", {"model.tier": kw["tier"], "model.mixer": kw["mixer"], "data.seq_len": kw["seq_len"],
                              "data.vocab_size": kw["vocab_size"], "train.batch_size": 1, "model.compile": "off",
                              "train.context_parallel_degree": world, "ray.num_workers": world,
                              "train.memory_limit_gib": 64.0, "train.max_bad_steps": 1000})
    engine = Engine(cfg, kw["vocab_size"], torch.device("cpu"), rank=rank, world_size=world, parallel="ddp")
    batches = synthetic_batches(n_sequences=kw["steps"] + 2, seq_len=kw["seq_len"], vocab_size=kw["vocab_size"],
                                batch_size=1, seed=7, doc_lengths="web")  # every rank the same rows
    limit, engine.memory_limit = engine.memory_limit, None
    engine.train_step([next(batches)])  # AdamW's state, DDP's buckets
    times, sent = [], []
    for _ in range(kw["steps"]):
        batch = next(batches)
        w0, t0 = socket_bytes_written(), time.perf_counter()
        engine.train_step([batch])
        times.append(time.perf_counter() - t0)
        sent.append(socket_bytes_written() - w0)
    engine.memory_limit = limit  # one more step, counting every tensor (slower: not timed)
    limit.reset_peak()
    resident = resident_bytes(engine)
    engine.train_step([next(batches)])
    split = engine.module.context
    return {"step_s": statistics.median(times), "sent_bytes": int(statistics.median(sent)),
            "activation_peak_bytes": int(limit.peak_bytes - resident), "resident_bytes": resident,
            "counted_sent_bytes_per_step": getattr(split, "sent_bytes", 0) // (kw["steps"] + 2),
            "threads": torch.get_num_threads(), "params": engine.n_params}


def _gpu_worker(rank: int, world: int, kw: dict) -> dict:
    from pipeline.config import load_config
    from pipeline.data.synthetic import synthetic_batches
    from pipeline.train.engine import Engine

    device = torch.device("cuda", rank % torch.cuda.device_count())
    cfg = load_config("gpu", {"model.tier": kw["tier"], "model.mixer": kw["mixer"], "data.seq_len": kw["seq_len"],
                              "data.min_rows": 0, "train.batch_size": 1, "train.grad_accum": 1,
                              "train.context_parallel_degree": world, "ray.num_workers": world})
    try:
        engine = Engine(cfg, 32000, device, rank=rank, world_size=world, parallel="ddp" if world > 1 else "none")
        batches = synthetic_batches(n_sequences=kw["warmup"] + kw["steps"], seq_len=kw["seq_len"], vocab_size=32000,
                                    batch_size=1, seed=7, doc_lengths="web")
        for _ in range(kw["warmup"]):
            engine.train_step([next(batches)])
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        for _ in range(kw["steps"]):
            engine.train_step([next(batches)])
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
    except torch.OutOfMemoryError:
        return {"status": "oom"}
    return {"status": "ok", "tokens_per_s_per_gpu": kw["steps"] * kw["seq_len"] / seconds / world,
            "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30}


def measure_gpu(spec: str, kw: dict) -> dict:
    """One --gpu-rows row, MIXER:SEQ_LEN:DEGREE, on DEGREE GPUs."""
    from pipeline.config import ConfigError, load_config
    from pipeline.train.distributed.process_group import run_workers

    mixer, seq_len, degree = spec.split(":")
    seq_len, degree = int(seq_len), int(degree)
    row = {"mixer": mixer, "seq_len": seq_len, "degree": degree, "tier": kw["tier"]}
    try:
        load_config("gpu", {"model.tier": kw["tier"], "model.mixer": mixer, "data.seq_len": seq_len,
                            "train.context_parallel_degree": degree, "ray.num_workers": degree})
    except ConfigError as exc:
        return {**row, "status": "refused", "reason": str(exc)}
    if degree > torch.cuda.device_count():
        return {**row, "status": "skipped", "reason": f"needs {degree} GPUs ({torch.cuda.device_count()} here)"}
    ranks = run_workers(_gpu_worker, degree, {**kw, "mixer": mixer, "seq_len": seq_len})
    if any(r["status"] != "ok" for r in ranks):
        return {**row, "status": "oom"}
    return {**row, "status": "ok", "tokens_per_s_per_gpu": min(r["tokens_per_s_per_gpu"] for r in ranks),
            "peak_mem_gib": max(r["peak_mem_gib"] for r in ranks)}


def byte_model(tier, mixer: str, seq_len: int, degree: int, params: int) -> dict[str, int]:
    """The bytes one rank sends per step on gloo: the row split's collectives and DDP's ring all-reduce."""
    from pipeline.train.distributed.context_parallel import bytes_per_step

    split = bytes_per_step(tier, mixer, 1, seq_len, degree, act_bytes=4, backend="gloo")
    ddp = 2 * (degree - 1) * 4 * params // degree
    return {"row_split": split["total"], "ddp_all_reduce": ddp, "total": split["total"] + ddp}


def measure(mixer: str, degree: int, kw: dict) -> dict:
    from model.tiers import get_mixer_tier
    from pipeline.train.distributed.process_group import run_workers

    ranks = run_workers(_worker, degree, {**kw, "mixer": mixer})
    tier = get_mixer_tier(kw["tier"], mixer)
    model = byte_model(tier, mixer, kw["seq_len"], degree, ranks[0]["params"])
    sent = max(r["sent_bytes"] for r in ranks)
    row = {"mixer": mixer, "degree": degree, "step_s": max(r["step_s"] for r in ranks),
           "sent_bytes_per_rank": [r["sent_bytes"] for r in ranks], "byte_model": model,
           "sent_over_model": sent / model["total"] if model["total"] else None,
           "activation_peak_bytes_per_rank": [r["activation_peak_bytes"] for r in ranks],
           "activation_peak_bytes": max(r["activation_peak_bytes"] for r in ranks),
           "resident_bytes": ranks[0]["resident_bytes"], "threads_per_process": ranks[0]["threads"]}
    print(f"  {mixer:<10} cp {degree}: step {row['step_s']:.3f} s  sent {sent / 2**20:8.2f} MiB/rank (model "
          f"{model['total'] / 2**20:8.2f} MiB: {row['sent_over_model'] or 0:.3f})  activation peak "
          f"{row['activation_peak_bytes'] / 2**20:8.1f} MiB", flush=True)
    return row


def predict(tier_name: str = "B", seq_len: int = 131072, degrees=(2, 4, 8)) -> list[dict]:
    """Tier B at 131k on H100s with NVLink (module docstring): compute per GPU at the measured 32k MFU, the row
    split's bytes per GPU over NVLINK_BYTES_PER_S plus NCCL_LATENCY_S per collective, not overlapped. Attention twice:
    one document (every causal pair: the most compute to hide behind) and web-length documents (pairs within
    documents only: the least)."""
    import numpy as np

    from model.flops import (attention_flops_per_pair, matmul_flops_per_token, resonance_flops_per_token,
                             within_document_causal_pairs)
    from model.tiers import get_mixer_tier
    from pipeline.data.synthetic import synthetic_row
    from pipeline.train.distributed.context_parallel import bytes_per_step

    web_docs = torch.from_numpy(np.asarray(synthetic_row(0, seq_len, 32000, 7, doc_lengths="web")[1][:seq_len]))
    out = []
    for mixer, docs in (("attention", "one document"), ("attention", "web documents"), ("resonance", "web documents")):
        tier = get_mixer_tier(tier_name, mixer)
        if mixer == "attention":
            pairs = seq_len * (seq_len + 1) // 2 if docs == "one document" else int(
                within_document_causal_pairs(web_docs[None]))
            flops = matmul_flops_per_token(tier, 32000) * seq_len + attention_flops_per_pair(tier) * pairs
            collectives = 6 * tier.n_layers  # K, V gathered forward and again backward, their gradients scattered
        else:
            flops = resonance_flops_per_token(tier, seq_len, 32000, form="kernel") * seq_len
            collectives = 2 * tier.n_layers  # one summary exchange each way
        for d in degrees:
            compute_s = flops / d / (H100_BF16_PEAK * H100_TIER_B_MFU)
            sent = bytes_per_step(tier, mixer, 1, seq_len, d, act_bytes=2, backend="nccl")["total"]
            comm_s = sent / NVLINK_BYTES_PER_S + collectives * NCCL_LATENCY_S
            out.append({"mixer": mixer, "documents": docs, "tier": tier_name, "seq_len": seq_len, "degree": d,
                        "compute_s": compute_s, "sent_bytes_per_gpu": sent, "collectives": collectives,
                        "comm_s": comm_s, "overhead": comm_s / compute_s})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mixers", nargs="+", default=["attention", "resonance"])
    p.add_argument("--degrees", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--tier", default="nano")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--vocab-size", type=int, default=2000)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="256-token rows, cp 1 and 2, one step: the plumbing")
    p.add_argument("--predict-only", action="store_true", help="only the GPU prediction")
    p.add_argument("--gpu-rows", nargs="+", default=[], metavar="MIXER:SEQ_LEN:DEGREE",
                   help="on CUDA: tokens/s and memory per GPU of each row instead of the CPU measurement")
    p.add_argument("--warmup", type=int, default=2, help="--gpu-rows: untimed steps first (compile, autotune)")
    p.add_argument("--out", help="write the JSON here (default bench/results/)")
    args = p.parse_args(argv)
    if args.smoke:
        args.seq_len, args.degrees, args.steps = 256, [1, 2], 1
    kw = {"tier": args.tier, "seq_len": args.seq_len, "vocab_size": args.vocab_size, "steps": args.steps,
          "cores": os.cpu_count() or 1}
    load_before = os.getloadavg()  # a shared machine's timings are only as good as its load: recorded
    rows, ratios, gpu_rows = [], [], []
    if args.gpu_rows:
        if not torch.cuda.is_available():
            p.error("--gpu-rows needs CUDA")
        kw["warmup"] = args.warmup
        for spec in args.gpu_rows:
            gpu_rows.append(measure_gpu(spec, kw))
            print(f"  {spec}: {json.dumps(gpu_rows[-1])}", flush=True)
    elif not args.predict_only:
        print(f"context parallelism on {kw['cores']} cores (gloo): tier {args.tier}, {args.seq_len:,}-token rows of "
              f"web-length documents, batch 1, {args.steps} timed steps", flush=True)
        for mixer in args.mixers:
            for d in args.degrees:
                rows.append(measure(mixer, d, kw))
            base = next((r for r in rows if r["mixer"] == mixer and r["degree"] == 1), None)
            for r in rows:
                if base is not None and r["mixer"] == mixer and r["degree"] > 1:
                    ratio = r["activation_peak_bytes"] / base["activation_peak_bytes"]
                    goal = GOALS.get(r["degree"])
                    ratios.append({"mixer": mixer, "degree": r["degree"], "activation_peak_over_cp1": ratio,
                                   "goal": goal, "meets_goal": None if goal is None else ratio <= goal,
                                   "step_time_over_cp1": r["step_s"] / base["step_s"],
                                   "sent_within_10pct_of_model": (r["sent_over_model"] is not None
                                                                  and abs(r["sent_over_model"] - 1) <= 0.1)})
                    print(f"  {mixer:<10} cp {r['degree']}: activation peak {ratio:.3f}x of cp 1 (goal <= "
                          f"{goal if goal else '-'}), step time {r['step_s'] / base['step_s']:.2f}x", flush=True)
    prediction = predict()
    print("predicted, tier B at 131,072 tokens on H100s over NVLink (the row split's traffic, not overlapped):")
    for r in prediction:
        print(f"  {r['mixer']:<10} {r['documents']:<14} cp {r['degree']}: compute {r['compute_s'] * 1e3:8.1f} ms/step/GPU, sends "
              f"{r['sent_bytes_per_gpu'] / 2**30:6.2f} GiB = {r['comm_s'] * 1e3:6.1f} ms: overhead {r['overhead']:.1%}")
    payload = {"shapes": {**kw, "mixers": args.mixers, "degrees": args.degrees, "batch_size": 1,
                          "doc_lengths": "web", "smoke": args.smoke},
               "load_average": {"before": load_before, "after": os.getloadavg()},
               "rows": rows, "ratios": ratios, "gpu_rows": gpu_rows, "goals": {"activation_peak_over_cp1": GOALS,
                                                          "sent_over_model": "within 10 %"},
               "prediction": {"assumptions": {"h100_bf16_peak_flops": H100_BF16_PEAK, "mfu": H100_TIER_B_MFU,
                                              "nvlink_bytes_per_s": NVLINK_BYTES_PER_S,
                                              "nccl_latency_s": NCCL_LATENCY_S, "overlap": "none"},
                              "rows": prediction},
               "torchtitan_published": {"source": "github.com/pytorch/torchtitan docs/performance.md, Table 2",
                                        "rows": [{"fsdp": f, "cp": c, "seq_len": s, "tokens_per_s_per_gpu": t}
                                                 for f, c, s, t in TORCHTITAN_CP]}}
    path = write_result("context_parallel", payload, Path(args.out) if args.out else None)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
