"""Decoder-head kernels vs torch, side by side in one run: fused linear cross-entropy and top-p sampling.

    python bench/decoder.py                            # GPU: {4096, 32768} tokens x {768, 1024} hidden x 32000, bf16
    python bench/decoder.py --tokens 4096 --hidden 768 --iters 50
    python bench/decoder.py --smoke --out /tmp/results # tiny shapes on CPU in seconds (used by a test)

Cross-entropy, forward + backward of the summed loss w.r.t. hidden and weight, per shape:
    eager     full (N, V) logits + F.cross_entropy(logits.float())      (the nanoGPT / torchtitan recipe)
    compiled  torch.compile of that same eager function
    fused     cuda_ops.linear_cross_entropy (Numba kernel on GPU; the torch reference where numba cannot run)
    chunked   cuda_ops.linear_cross_entropy(backend="reference"): the same chunking in torch ops only
Sampling, one step for a (64, 32000) fp32 logits batch at top-p 0.9: cuda_ops.sampling.sample vs a torch
sort -> cumsum -> mask -> multinomial top-p.

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


def bench_cross_entropy(tokens, hidden_size, vocab, dtype, device, args) -> dict:
    hidden, weight, targets = make_inputs(tokens, hidden_size, vocab, dtype, device)
    fused_backend = resolve_backend(device, args.backend)
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
    return {"shape": {"tokens": tokens, "hidden": hidden_size, "vocab": vocab, "dtype": str(dtype).split(".")[-1],
                      "chunk_size": args.chunk_size},
            "fused_backend": fused_backend, "methods": res, "ratios": ratios}


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
    step = [0]

    def ours():
        step[0] += 1
        return sampling.sample(logits, temperature=1.0, top_p=0.9, seed=1234, step=step[0], backend=backend)

    def theirs():
        return torch_top_p(logits, 0.9, 1.0, g)

    res = {}
    for name, fn in (("cuda_ops", ours), ("torch_sort", theirs)):
        first = first_call_ms(fn, device)
        times = time_calls_ms(fn, device, args.warmup, args.iters)
        res[name] = {"first_call_ms": first, "median_ms": statistics.median(times), "min_ms": min(times)}
    return {"shape": {"batch": batch, "vocab": vocab, "top_p": 0.9, "temperature": 1.0}, "backend": backend,
            "methods": res, "ratios": {"torch_sort_time_over_cuda_ops":
                                       res["torch_sort"]["median_ms"] / res["cuda_ops"]["median_ms"]}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--hidden", type=int, nargs="+", default=[768, 1024])
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--chunk-size", type=int, default=4096)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--backend", choices=["auto", "numba", "reference"], default=None,
                   help="cuda_ops backend for 'fused' and sampling (default: auto)")
    p.add_argument("--compile-backend", default=None, help="torch.compile backend (default inductor; eager in smoke)")
    p.add_argument("--sample-batch", type=int, default=64)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, few iterations (CPU, seconds)")
    p.add_argument("--out", type=Path, default=None, help="results directory (default bench/results)")
    args = p.parse_args(argv)
    if args.smoke:
        args.tokens, args.hidden, args.vocab, args.chunk_size = [64, 96], [32], 500, 32
        args.sample_batch, args.warmup, args.iters = 4, 1, 3
        args.compile_backend = args.compile_backend or "eager"  # inductor's C++ build takes minutes on 2 cores
    args.compile_backend = args.compile_backend or "inductor"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))

    compile_s = {}
    if resolve_backend(device, args.backend) == "numba":  # compile ahead so it is reported on its own
        compile_s["numba_cross_entropy_warmup_s"] = cross_entropy.warmup()

    ce_rows = []
    print(f"linear cross-entropy fwd+bwd, vocab {args.vocab}, {str(dtype).split('.')[-1]} on {device.type} "
          f"(median ms; ratio = torch / fused; compile backend {args.compile_backend})")
    print(f"  {'tokens x hidden':<16}{'eager':>9}{'compiled':>10}{'chunked':>9}{'fused':>9}"
          f"{'eager/f':>9}{'comp/f':>8}{'mem eager/f':>13}{'fused MiB':>11}")
    for n in args.tokens:
        for d in args.hidden:
            row = bench_cross_entropy(n, d, args.vocab, dtype, device, args)
            ce_rows.append(row)
            m, r = row["methods"], row["ratios"]
            print(f"  {f'{n} x {d}':<16}{m['eager']['median_ms']:>9.2f}{m['compiled']['median_ms']:>10.2f}"
                  f"{m['chunked']['median_ms']:>9.2f}{m['fused']['median_ms']:>9.2f}"
                  f"{r['eager_time_over_fused']:>9.2f}{r['compiled_time_over_fused']:>8.2f}"
                  f"{r['eager_peak_over_fused']:>13.2f}{m['fused']['peak_bytes'] / MiB:>11.1f}")
    print("  first call ms (compile included): " + "; ".join(
        f"{row['shape']['tokens']}x{row['shape']['hidden']}: " + ", ".join(
            f"{k} {v['first_call_ms']:.0f}" for k, v in row["methods"].items()) for row in ce_rows))

    samp = bench_sampling(args.sample_batch, args.vocab, device, args)
    ms = samp["methods"]
    print(f"top-p sampling step, {args.sample_batch} x {args.vocab} fp32 ({samp['backend']}): cuda_ops "
          f"{ms['cuda_ops']['median_ms']:.3f} ms, torch sort {ms['torch_sort']['median_ms']:.3f} ms, ratio "
          f"{samp['ratios']['torch_sort_time_over_cuda_ops']:.2f} (first calls {ms['cuda_ops']['first_call_ms']:.0f}"
          f" / {ms['torch_sort']['first_call_ms']:.0f} ms)")
    if compile_s:
        print("  numba compile: " + ", ".join(f"{k} {v:.2f}" for k, v in compile_s.items()))

    path = write_result("decoder", {"cross_entropy": ce_rows, "sampling": samp, "compile": compile_s,
                                    "smoke": args.smoke, "settings": {"warmup": args.warmup, "iters": args.iters,
                                                                      "compile_backend": args.compile_backend}},
                        out_dir=args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
