"""The bytes expert parallelism moves, measured against a byte model, and its step time against degree 1, on CPU.

    python bench/expert_exchange.py                                   # nano-moe, 4 gloo ranks, degrees 1, 2, 4
    python bench/expert_exchange.py --tier A-moe --seq-len 512 --batch 2
    python bench/expert_exchange.py --smoke                           # a few tokens: the plumbing

Each of --world processes (a gloo group on this machine, pipeline/train/distributed/process_group.py run_workers)
builds the same fp32 model from one seed, splits its experts over an expert group of each --degrees
(pipeline/train/distributed/expert_parallel.py: ExpertMesh, ExpertParallel.split, what the engine does) and runs
--steps forward and backward passes on its own --batch random rows of --seq-len tokens. Every call of
torch.distributed.all_to_all_single is counted (the counts exchange, the rows out, the outputs back, and in backward
the two reverse exchanges of the gradients, which torch.distributed.nn's autograd all-to-all makes with the same
function): the bytes this rank sends to the other ranks of its group, its own share (a copy) left out.

The byte model, per step and rank, before anything runs: with N = batch x seq_len tokens, k experts per token, D the
model width, b bytes per element, e the degree, E the experts and L the MoE layers, a routed row goes to another rank
with probability (e - 1) / e when the router spreads the load evenly, and each such row crosses four times (dispatch
and combine, forward and backward):

    bytes = L x (4 x N x k x (e - 1) / e x D x b  +  E x 8 x (e - 1) / e)     (the second term: the counts, int64)

Reported beside it: the same model fed with the router's own counts of each step (the rows whose expert lives on
another rank: what the exchange must move, so measured = routed exactly unless something else crosses), and the
measured bytes over the even-spread model (goal: within 10 %). Step time: the median of --steps steps (after one
warm-up), each degree against degree 1 on the same ranks. Writes bench/results/expert_exchange_<tier>-cpu-<date>.json.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import write_result  # noqa: E402

VOCAB = 512


def one_degree(rank: int, world: int, args: dict, degree: int) -> dict:
    import torch.distributed as dist

    from model.decoder import build_model
    from model.moe import moe_layers
    from model.tiers import get_mixer_tier
    from pipeline.train.distributed.expert_parallel import ExpertMesh, ExpertParallel

    torch.manual_seed(0)
    tier = get_mixer_tier(args["tier"], "attention")
    model = build_model(tier, VOCAB, mixer="attention")
    layers = moe_layers(model)
    mesh = ExpertMesh.build(degree, 1, "cpu", 300)
    split = ExpertParallel.split(mesh, model) if degree > 1 else None
    sent = {"bytes": 0, "calls": 0}
    original = dist.all_to_all_single

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        if group is not None and group is mesh.group:
            me = dist.get_rank(group)
            sizes = input_split_sizes
            if not sizes:
                sizes = [input.shape[0] // dist.get_world_size(group)] * dist.get_world_size(group)
            row = (input[0].numel() if input.dim() > 1 else 1) * input.element_size()
            sent["bytes"] += sum(s for r, s in enumerate(sizes) if r != me) * row
            sent["calls"] += 1
        return original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    # the router's rows for experts on other ranks: the per-expert counts each MoE layer hands its exchange
    routed = {"rows": 0}
    if split is not None:
        exchange = split.dispatch.exchange

        def recording(rows, counts):
            per = counts.numel() // degree
            me = split.dispatch.rank
            routed["rows"] += int(counts.sum()) - int(counts[me * per:(me + 1) * per].sum())
            return exchange(rows, counts)

        split.dispatch.exchange = recording
    dist.all_to_all_single = counting
    g = torch.Generator().manual_seed(1000 + rank)
    times, per_step_bytes, per_step_rows = [], [], []
    try:
        for step in range(args["steps"] + 1):
            tokens = torch.randint(0, VOCAB, (args["batch"], args["seq_len"]), generator=g)
            before, rows_before = sent["bytes"], routed["rows"]
            dist.barrier()
            t0 = time.perf_counter()
            hidden = model(tokens)
            loss = hidden.float().pow(2).mean()
            loss.backward()
            if split is not None:
                split.reduce_gradients()
            dist.barrier()
            if step > 0:  # the first is a warm-up
                times.append(time.perf_counter() - t0)
                per_step_bytes.append(sent["bytes"] - before)
                per_step_rows.append(routed["rows"] - rows_before)
            model.zero_grad(set_to_none=True)
    finally:
        dist.all_to_all_single = original
    spec = layers[0].spec
    D, b, e, E, L = tier.d_model, 4, degree, spec.num_experts, len(layers)
    N, k = args["batch"] * args["seq_len"], spec.experts_per_token
    even = L * (4 * N * k * (e - 1) / e * D * b + E * 8 * (e - 1) / e) if e > 1 else 0.0
    from_router = [4 * r * D * b + L * E * 8 * (e - 1) / e for r in per_step_rows] if e > 1 else [0.0] * len(times)
    measured = statistics.mean(per_step_bytes)
    return {"degree": degree, "median_step_s": statistics.median(times), "bytes_measured": measured,
            "bytes_model_even": even, "bytes_model_router": statistics.mean(from_router),
            "measured_over_even": measured / even if even else None,
            "measured_over_router": measured / statistics.mean(from_router) if e > 1 else None,
            "calls_per_step": sent["calls"] / max(1, args["steps"] + 1),
            "shape": {"tokens_per_rank": N, "experts_per_token": k, "d_model": D, "experts": E, "moe_layers": L,
                      "bytes_per_element": b}}


def worker(rank: int, world: int, args: dict) -> list[dict]:
    torch.set_num_threads(1)
    return [one_degree(rank, world, args, d) for d in args["degrees"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tier", default="nano-moe")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out-dir", default="")
    a = ap.parse_args()
    if a.smoke:
        a.seq_len, a.batch, a.steps, a.world, a.degrees = 16, 1, 1, 2, [1, 2]
    for d in a.degrees:
        if a.world % d:
            ap.error(f"--degrees {d} does not divide --world {a.world}")
    from pipeline.train.distributed.process_group import run_workers

    args = {"tier": a.tier, "degrees": a.degrees, "seq_len": a.seq_len, "batch": a.batch, "steps": a.steps}
    ranks = run_workers(worker, a.world, args, timeout_s=600)
    rows = []
    for i, d in enumerate(a.degrees):
        per_rank = [r[i] for r in ranks]
        row = {"degree": d, "median_step_s": max(r["median_step_s"] for r in per_rank),
               "bytes_measured_per_rank": [r["bytes_measured"] for r in per_rank],
               "bytes_model_even": per_rank[0]["bytes_model_even"],
               "bytes_model_router_per_rank": [r["bytes_model_router"] for r in per_rank],
               "shape": per_rank[0]["shape"]}
        if d > 1:
            total, even = sum(row["bytes_measured_per_rank"]), row["bytes_model_even"] * a.world
            row["measured_over_even"] = total / even
            row["measured_over_router"] = total / sum(row["bytes_model_router_per_rank"])
        rows.append(row)
    base = rows[0]["median_step_s"] if a.degrees[0] == 1 else None
    print(f"{a.tier}, {a.world} gloo ranks on CPU, {a.batch} x {a.seq_len} tokens a rank, {a.steps} steps")
    print("| degree | step (s) | vs degree 1 | MB sent a step, all ranks | byte model (even spread) | measured / model |"
          " measured / router's counts |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        total = sum(r["bytes_measured_per_rank"]) / 1e6
        model = r["bytes_model_even"] * a.world / 1e6
        ratio = f"{r['measured_over_even']:.3f}" if r["degree"] > 1 else "–"
        exact = f"{r['measured_over_router']:.4f}" if r["degree"] > 1 else "–"
        vs = f"{r['median_step_s'] / base:.2f}x" if base else "–"
        print(f"| {r['degree']} | {r['median_step_s']:.3f} | {vs} | {total:.2f} | {model:.2f} | {ratio} | {exact} |")
    name = "expert_exchange_smoke" if a.smoke else f"expert_exchange_{a.tier}"
    out = write_result(name, {"command": "python " + " ".join(sys.argv), "tier": a.tier, "world": a.world,
                              "seq_len": a.seq_len, "batch": a.batch, "steps": a.steps, "threads_per_rank": 1,
                              "goal": "all-to-all bytes within 10 % of the byte model", "rows": rows},
                       Path(a.out_dir) if a.out_dir else None)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
