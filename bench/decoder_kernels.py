"""Decoder-head kernels vs torch, side by side in one run, with the bytes each kernel moves.

    python bench/decoder_kernels.py                            # GPU: {4096, 32768} tokens x {768, 1024} hidden x 32000, bf16
    python bench/decoder_kernels.py --tokens 4096 --hidden 768 --iters 50
    python bench/decoder_kernels.py --smoke --out /tmp/results # tiny shapes on CPU in seconds (used by a test)

Cross-entropy, forward + backward of the summed loss w.r.t. hidden and weight, per shape:
    eager     full (N, V) logits + F.cross_entropy(logits.float())      (the nanoGPT / torchtitan recipe)
    compiled  torch.compile of that same eager function
    fused     cuda_ops.linear_cross_entropy (Numba kernel on GPU; the torch reference where numba cannot run)
    chunked   cuda_ops.linear_cross_entropy(backend="reference"): the same chunking in torch ops only
Sampling at 1 x 32,000, 64 x 32,000 and 256 x 128,256 fp32 logits, temperature 1, top-p 0.9:
    sampler     cuda_ops.sampling.Sampler called on new logits (copied into its buffer, then the kernel chain)
    torch_sort  softmax -> sort -> cumsum -> mask -> multinomial top-p (Hugging Face's TopPLogitsWarper recipe)
and the sampler's kernels alone on logits already in its buffer (what generation does).

Where the time goes (CUDA only; `profile` in each row of the JSON, the six largest printed): the fused CE call and
the sampler call run --profile-iters times under torch.profiler, and every kernel's GPU time per call is listed
(CUPTI sees the Numba kernels too), with the gap between the call's wall time and the sum of its kernels (launch
latency, host work the GPU waited for).

Bytes moved (the traffic model; `kernels` in the JSON, one table on stdout): for every kernel the bytes it must
read and write by construction (what a perfect cache would still move), the achieved GB/s and share of the
device's peak bandwidth (pipeline/train/memory/hardware.py's table) next to its measured time, and the time that traffic
would take at 3 TB/s. For the fused cross-entropy: the logits chunk written by cuBLAS, read once (the staged row
kernel: rows up to 32,768 bf16 logits held in registers) or twice and written once by the row kernel in the input
dtype, the gradient read by two matmuls, the weight read by every chunk's
matmuls and the fp32 grad_weight accumulator read and written by each chunk after the first. For the sampler:
one read of the logits (the floor) and the most its launches may read (every launch but the last reads the rows:
an upper bound, since rows that finish early skip theirs, and the search rounds re-read mostly from L2). Matmul FLOPs are printed beside the bytes: those matmuls are bound by compute, not bytes.

Timing: CUDA events around each call (perf_counter on CPU), `--warmup` untimed calls, median of `--iters`.
The first call of each method is timed on its own and reported apart (first_call_ms): it includes Numba's
kernel compilation and torch.compile's tracing/codegen. Peak memory is measured as in bench/decoder_memory.py.
Ratios are torch time / cuda_ops time (> 1: cuda_ops faster) and torch peak / fused peak.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import write_result  # noqa: E402
from bench.decoder_memory import MiB, full_logits_loss, fwd_bwd, make_inputs, peak_extra_bytes  # noqa: E402
from cuda_ops import cross_entropy, sampling  # noqa: E402
from cuda_ops.dispatch import resolve_backend  # noqa: E402
from pipeline.train.memory.hardware import peak_memory_bandwidth  # noqa: E402

REFERENCE_BANDWIDTH = 3e12  # bytes/s: "the time its traffic would take at 3 TB/s"
SAMPLING_SHAPES = [(1, 32000), (64, 32000), (256, 128256)]


def time_calls_ms(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in pairs:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) for start, end in pairs]
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def first_call_ms(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def profile_kernels(fn: Callable[[], object], device: torch.device, iters: int) -> list[dict]:
    """GPU time per call of every kernel fn launches, largest first (CUDA; [] elsewhere or with iters 0)."""
    if device.type != "cuda" or iters <= 0:
        return []
    fn()
    torch.cuda.synchronize(device)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize(device)
    rows = [{"kernel": e.key[:120], "us_per_call": e.self_device_time_total / iters, "calls_per_call": e.count / iters}
            for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
    return sorted(rows, key=lambda r: -r["us_per_call"])


def bench_method(loss_fn, hidden, weight, targets, device, warmup, iters) -> dict:
    def step():
        hidden.grad = weight.grad = None
        loss_fn(hidden, weight, targets).backward()

    hidden.requires_grad_()
    weight.requires_grad_()
    first = first_call_ms(step, device)
    times = time_calls_ms(step, device, warmup, iters)
    peak = peak_extra_bytes(fwd_bwd(loss_fn, hidden, weight, targets), device)
    return {"first_call_ms": first, "median_ms": statistics.median(times), "min_ms": min(times), "peak_bytes": peak}


def ce_traffic(N: int, D: int, V: int, dtype: torch.dtype, rows: int, backend: str, staged: bool = False) -> dict:
    """Bytes and FLOPs of the fused cross-entropy's kernels, forward + backward, by construction (module doc)."""
    e = torch.finfo(dtype).bits // 8  # input dtype
    le = 4 if backend == "reference" or dtype == torch.float32 else e  # logits chunk dtype
    c = -(-N // rows)  # chunks
    acc = 0 if c == 1 else (2 * c - 1) * V * D * 4  # fp32 grad_weight accumulator traffic (several chunks)
    return {
        "logits_matmul": {"bytes": N * D * e + c * V * D * e + N * V * le, "flops": 2 * N * V * D},
        "rowwise_kernel": {"bytes": (2 if staged else 3) * N * V * le + N * 16, "flops": 0},
        "grad_h_matmul": {"bytes": N * V * le + c * V * D * e + N * D * e, "flops": 2 * N * V * D},
        "grad_w_matmul": {"bytes": N * V * le + N * D * e + acc + V * D * e, "flops": 2 * N * V * D},
        "chunks": c, "rows_per_chunk": rows,
    }


def kernel_row(name: str, shape: str, ms: float, nbytes: int, peak_bw: float | None, flops: int = 0) -> dict:
    """One line of the per-kernel table: time, model bytes, achieved GB/s, % of peak, time at 3 TB/s."""
    gbps = nbytes / (ms * 1e-3) / 1e9 if ms > 0 else 0.0
    return {"kernel": name, "shape": shape, "median_ms": ms, "bytes": nbytes, "gb_per_s": gbps,
            "pct_of_peak_bw": None if peak_bw is None else 100 * nbytes / (ms * 1e-3) / peak_bw,
            "ms_at_3tbps": nbytes / REFERENCE_BANDWIDTH * 1e3, "flops": flops}


def bench_rowwise(rows: int, vocab: int, dtype: torch.dtype, device, backend: str, args) -> dict:
    """The row-wise CE kernel alone on one (rows, V) chunk in the logits dtype the fused path uses."""
    logits_dtype = torch.float32 if backend == "reference" or dtype == torch.float32 else dtype
    g = torch.Generator(device=device).manual_seed(1)
    buf = (torch.randn(rows, vocab, device=device, generator=g) * 3).to(logits_dtype)
    targets = torch.randint(0, vocab, (rows,), device=device, generator=g)
    loss_rows = torch.empty(rows, device=device)
    correct = torch.empty(rows, dtype=torch.int32, device=device)
    res = {"rows": rows, "logits_dtype": str(logits_dtype).split(".")[-1]}
    if backend == "reference":
        fn = lambda: cross_entropy._rowwise_reference(buf, targets, -100, 0.0, True, loss_rows, correct)  # noqa: E731
        times = time_calls_ms(fn, device, args.warmup, args.iters)
        return {**res, "median_ms": statistics.median(times), "bytes": 3 * rows * vocab * buf.element_size()}
    # the kernel training runs (staged where the row fits: read once, written once) and the two-read one, each on
    # its own copy of the chunk (the kernel overwrites logits with gradients)
    words = cross_entropy._storage_view(buf)[0].shape[1]
    staged = cross_entropy.rowwise_plan(words)[1] > 0
    for name, flag in (("staged" if staged else "two_read", None), ("two_read_forced", False)):
        fresh = buf.clone()
        fn = lambda: cross_entropy._rowwise_numba(fresh, targets, -100, 0.0, True, loss_rows, correct,  # noqa: E731
                                                  staged=flag)
        times = time_calls_ms(fn, device, args.warmup, args.iters)
        passes = 2 if name == "staged" else 3
        res[name] = {"median_ms": statistics.median(times), "bytes": passes * rows * vocab * buf.element_size()}
    first = res["staged" if staged else "two_read"]
    return {**res, "median_ms": first["median_ms"], "bytes": first["bytes"] + rows * 16, "staged": staged}


def bench_cross_entropy(tokens, hidden_size, vocab, dtype, device, args) -> dict:
    hidden, weight, targets = make_inputs(tokens, hidden_size, vocab, dtype, device)
    fused_backend = resolve_backend(device, args.backend)
    logits_dtype = torch.float32 if fused_backend == "reference" or dtype == torch.float32 else dtype
    rows = (args.chunk_size or cross_entropy.auto_chunk_rows(tokens, vocab, logits_dtype, device))
    methods = {
        "eager": full_logits_loss,
        "compiled": torch.compile(full_logits_loss, backend=args.compile_backend, dynamic=False),
        "fused": lambda h, w, t: cross_entropy.linear_cross_entropy(
            h, w, t, chunk_size=args.chunk_size, backend=fused_backend).loss_sum,
        "chunked": lambda h, w, t: cross_entropy.linear_cross_entropy(
            h, w, t, chunk_size=args.chunk_size, backend="reference").loss_sum,
    }
    res = {name: bench_method(fn, hidden, weight, targets, device, args.warmup, args.iters)
           for name, fn in methods.items()}
    fused = res["fused"]
    ratios = {f"{name}_time_over_fused": res[name]["median_ms"] / fused["median_ms"] for name in res if name != "fused"}
    ratios.update({f"{name}_peak_over_fused": res[name]["peak_bytes"] / max(fused["peak_bytes"], 1)
                   for name in res if name != "fused"})
    rowwise = bench_rowwise(min(rows, tokens), vocab, dtype, device, fused_backend, args)
    traffic = ce_traffic(tokens, hidden_size, vocab, dtype, min(rows, tokens), fused_backend,
                         bool(rowwise.get("staged")))

    def fused_step():
        hidden.grad = weight.grad = None
        methods["fused"](hidden, weight, targets).backward()
    profile = profile_kernels(fused_step, device, args.profile_iters)
    return {"profile": profile,
            "shape": {"tokens": tokens, "hidden": hidden_size, "vocab": vocab, "dtype": str(dtype).split(".")[-1],
                      "chunk_size": args.chunk_size, "rows_per_chunk": min(rows, tokens)},
            "fused_backend": fused_backend, "methods": res, "ratios": ratios, "traffic": traffic,
            "rowwise": rowwise}


def torch_top_p(logits: torch.Tensor, top_p: float, temperature: float, generator: torch.Generator) -> torch.Tensor:
    """The usual sort-based nucleus sampling (as in Hugging Face's TopPLogitsWarper + multinomial). (B, V) -> (B,)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)               # (B, V)
    sorted_p, sorted_idx = probs.sort(dim=-1, descending=True)                # (B, V), (B, V)
    cum = sorted_p.cumsum(dim=-1)
    sorted_p = sorted_p.masked_fill(cum - sorted_p > top_p, 0.0)             # smallest prefix with mass >= top_p
    pick = torch.multinomial(sorted_p, 1, generator=generator)               # (B, 1), multinomial renormalises
    return sorted_idx.gather(-1, pick).squeeze(-1)                            # (B,)


def bench_sampling(batch, vocab, device, args) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(batch, vocab, device=device, generator=g) * 3         # (B, V) fp32
    backend = resolve_backend(device, args.backend)
    sampler = sampling.Sampler(batch, vocab, device=device, temperature=1.0, top_p=0.9, seed=1234, backend=backend)
    in_place = sampler.logits if backend == "numba" else logits               # the kernels alone: no copy

    res = {}
    for name, fn in (("sampler", lambda: sampler(logits)), ("sampler_kernels", lambda: sampler(in_place)),
                     ("torch_sort", lambda: torch_top_p(logits, 0.9, 1.0, g))):
        first = first_call_ms(fn, device)
        times = time_calls_ms(fn, device, args.warmup, args.iters)
        res[name] = {"first_call_ms": first, "median_ms": statistics.median(times), "min_ms": min(times)}
    launches = getattr(sampler, "n_launches", 0)
    return {"shape": {"batch": batch, "vocab": vocab, "top_p": 0.9, "temperature": 1.0}, "backend": backend,
            "splits": getattr(getattr(sampler, "plan", None), "S", None), "launches": launches,
            "bytes_one_read": batch * vocab * 4, "bytes_at_most": max(launches - 1, 1) * batch * vocab * 4,
            "profile": profile_kernels(lambda: sampler(in_place), device, args.profile_iters), "methods": res,
            "ratios": {"torch_sort_time_over_sampler": res["torch_sort"]["median_ms"] / res["sampler"]["median_ms"]}}


def print_profile(what: str, profile: list[dict], wall_ms: float, top: int = 6) -> None:
    if not profile:
        return
    gpu_ms = sum(r["us_per_call"] for r in profile) / 1e3
    print(f"  {what}: kernels {gpu_ms:.3f} ms of {wall_ms:.3f} ms a call (gap {wall_ms - gpu_ms:.3f})")
    for r in profile[:top]:
        print(f"    {r['us_per_call']:>9.1f} us  x{r['calls_per_call']:<4.1f} {r['kernel'][:90]}")


def print_kernel_table(rows: list[dict], peak_bw: float | None) -> None:
    peak = "unknown" if peak_bw is None else f"{peak_bw / 1e12:.2f} TB/s"
    print(f"bytes moved per kernel (traffic model; device peak {peak}; last column: the same bytes at 3 TB/s)")
    print(f"  {'kernel':<30}{'shape':<18}{'ms':>9}{'MB':>10}{'GB/s':>9}{'% peak':>8}{'ms @3TB/s':>11}{'TFLOP':>8}")
    for r in rows:
        pct = "-" if r["pct_of_peak_bw"] is None else f"{r['pct_of_peak_bw']:.0f}"
        print(f"  {r['kernel']:<30}{r['shape']:<18}{r['median_ms']:>9.3f}{r['bytes'] / 1e6:>10.1f}"
              f"{r['gb_per_s']:>9.1f}{pct:>8}{r['ms_at_3tbps']:>11.3f}{r['flops'] / 1e12:>8.2f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--hidden", type=int, nargs="+", default=[768, 1024])
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--chunk-size", type=int, default=None, help="rows per chunk (default: sized from free memory)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--backend", choices=["auto", "numba", "reference"], default=None,
                   help="cuda_ops backend for 'fused' and sampling (default: auto)")
    p.add_argument("--compile-backend", default=None, help="torch.compile backend (default inductor; eager in smoke)")
    p.add_argument("--sample-shapes", nargs="+", default=None, metavar="BxV",
                   help="sampling shapes (default: 1x32000 64x32000 256x128256)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--profile-iters", type=int, default=3, help="calls profiled per shape on CUDA (0: none)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, few iterations (CPU, seconds)")
    p.add_argument("--out", type=Path, default=None, help="results directory (default bench/results)")
    args = p.parse_args(argv)
    shapes = SAMPLING_SHAPES
    if args.smoke:
        args.tokens, args.hidden, args.vocab, args.chunk_size = [64, 96], [32], 500, 32
        shapes, args.warmup, args.iters = [(1, 500), (4, 500)], 1, 3
        args.compile_backend = args.compile_backend or "eager"  # inductor's C++ build takes minutes on 2 cores
    if args.sample_shapes:
        shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.sample_shapes]
    args.compile_backend = args.compile_backend or "inductor"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    peak_bw = peak_memory_bandwidth(device)

    compile_s = {}
    if resolve_backend(device, args.backend) == "numba":  # compile ahead so it is reported on its own
        compile_s["numba_cross_entropy_warmup_s"] = cross_entropy.warmup()
        compile_s["numba_sampling_warmup_s"] = sampling.warmup()

    ce_rows, kernels = [], []
    print(f"linear cross-entropy fwd+bwd, vocab {args.vocab}, {str(dtype).split('.')[-1]} on {device.type} "
          f"(median ms; ratio = torch / fused; compile backend {args.compile_backend})")
    print(f"  {'tokens x hidden':<16}{'eager':>9}{'compiled':>10}{'chunked':>9}{'fused':>9}"
          f"{'eager/f':>9}{'comp/f':>8}{'mem eager/f':>13}{'mem comp/f':>12}{'fused MiB':>11}{'chunks':>8}")
    for n in args.tokens:
        for d in args.hidden:
            row = bench_cross_entropy(n, d, args.vocab, dtype, device, args)
            ce_rows.append(row)
            m, r, t = row["methods"], row["ratios"], row["traffic"]
            print(f"  {f'{n} x {d}':<16}{m['eager']['median_ms']:>9.2f}{m['compiled']['median_ms']:>10.2f}"
                  f"{m['chunked']['median_ms']:>9.2f}{m['fused']['median_ms']:>9.2f}"
                  f"{r['eager_time_over_fused']:>9.2f}{r['compiled_time_over_fused']:>8.2f}"
                  f"{r['eager_peak_over_fused']:>13.2f}{r['compiled_peak_over_fused']:>12.2f}"
                  f"{m['fused']['peak_bytes'] / MiB:>11.1f}{t['chunks']:>8}")
            shape = f"{n}x{d}x{args.vocab}"
            total_b = sum(v["bytes"] for v in t.values() if isinstance(v, dict))
            total_f = sum(v["flops"] for v in t.values() if isinstance(v, dict))
            kernels.append(kernel_row("fused CE fwd+bwd", shape, m["fused"]["median_ms"], total_b, peak_bw, total_f))
            rw = row["rowwise"]
            kind = "staged" if rw.get("staged") else "two reads"
            kernels.append(kernel_row(f"CE row ({rw['logits_dtype']}, {kind})", f"{rw['rows']}x{args.vocab}",
                                      rw["median_ms"], rw["bytes"], peak_bw))
            if rw.get("staged"):
                two = rw["two_read_forced"]
                kernels.append(kernel_row(f"CE row ({rw['logits_dtype']}, two reads)", f"{rw['rows']}x{args.vocab}",
                                          two["median_ms"], two["bytes"], peak_bw))
    for row in ce_rows:
        print_profile(f"fused CE {row['shape']['tokens']}x{row['shape']['hidden']}", row["profile"],
                      row["methods"]["fused"]["median_ms"])
    print("  first call ms (compile included): " + "; ".join(
        f"{row['shape']['tokens']}x{row['shape']['hidden']}: " + ", ".join(
            f"{k} {v['first_call_ms']:.0f}" for k, v in row["methods"].items()) for row in ce_rows))

    samp_rows = [bench_sampling(b, v, device, args) for b, v in shapes]
    print("top-p 0.9 sampling step, fp32 logits (median ms wall clock; ratio = torch sort / sampler)")
    print(f"  {'B x V':<14}{'backend':>10}{'splits':>8}{'launches':>10}{'sampler':>10}{'kernels':>10}"
          f"{'torch sort':>12}{'ratio':>8}")
    for samp in samp_rows:
        ms, sh = samp["methods"], samp["shape"]
        bv = f"{sh['batch']} x {sh['vocab']}"
        print(f"  {bv:<14}{samp['backend']:>10}{str(samp['splits']):>8}"
              f"{samp['launches']:>10}{ms['sampler']['median_ms']:>10.3f}{ms['sampler_kernels']['median_ms']:>10.3f}"
              f"{ms['torch_sort']['median_ms']:>12.3f}{samp['ratios']['torch_sort_time_over_sampler']:>8.2f}")
        kernels.append(kernel_row("sampler kernels (top-p)", f"{sh['batch']}x{sh['vocab']}",
                                  ms["sampler_kernels"]["median_ms"], samp["bytes_one_read"], peak_bw))
        kernels.append(kernel_row("sampler, every launch", f"{sh['batch']}x{sh['vocab']}",
                                  ms["sampler_kernels"]["median_ms"], samp["bytes_at_most"], peak_bw))
    for samp in samp_rows:
        print_profile(f"sampler {samp['shape']['batch']}x{samp['shape']['vocab']}", samp["profile"],
                      samp["methods"]["sampler_kernels"]["median_ms"])
    print_kernel_table(kernels, peak_bw)
    if compile_s:
        print("  numba compile: " + ", ".join(f"{k} {v:.2f}" for k, v in compile_s.items()))

    path = write_result("decoder", {"cross_entropy": ce_rows, "sampling": samp_rows, "kernels": kernels,
                                    "peak_memory_bandwidth": peak_bw, "compile": compile_s, "smoke": args.smoke,
                                    "settings": {"warmup": args.warmup, "iters": args.iters,
                                                 "compile_backend": args.compile_backend}},
                        out_dir=args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
