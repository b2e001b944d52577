"""One decode step profiled: kernels per step, GPU time per step and where it goes, beside the bytes the step must move.

    python bench/decode_profile.py                      # CUDA: tier B, bf16, 32-token prompts, batches 1 and 64
    python bench/decode_profile.py --batches 1 8 64 --attention fused split_k   # both decode attention paths
    python bench/decode_profile.py --cache-len 8192
    python bench/decode_profile.py --mixer resonance --batches 1   # the resonance family's step (no attention path)
    python bench/decode_profile.py --smoke --out /tmp/r # CPU, tier nano, eager: the plumbing (seconds)

The step is model/decode_loop.py's: the compiled model step, the Numba sampler (top-p 0.95) and the bookkeeping,
captured in one CUDA graph after the loop's eager warm-up steps; --replays replays of it run under torch.profiler
(CUDA activity: CUPTI sees the Numba kernels too) and, apart, under CUDA events for the wall time per step. By
default each batch runs the decode attention path the cache picks (`auto`: model/kv_cache.py decode_attention, fused
SDPA or split-K by the batch); `--attention fused split_k` runs both, the measurement that rule awaits (each path
and batch is one more compile, ~30 s on an H100).

Bytes per step (the traffic model, by construction): every weight once (the step's matmuls read them whatever the
batch), the keys and values of the span (B x layers x 2 x kv heads x span x head_dim x 2 B), the new K/V entries
and the logits written, the logits read by the sampler (its search rounds re-read mostly from L2); the time they
take at the device's peak bandwidth is the floor a step could reach. On CPU (--smoke) the steps run eagerly under
the profiler's CPU activity: op counts, no kernels.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import write_result  # noqa: E402
from cuda_ops.sampling import Sampler  # noqa: E402
from model.decode_loop import _DecodeLoop, generation_autocast  # noqa: E402
from model.decoder import build_model  # noqa: E402
from pipeline.train.handoff.text_generation import prepare_for_generation  # noqa: E402
from pipeline.train.memory.hardware import peak_memory_bandwidth  # noqa: E402


def traffic(model, cache, batch: int, span: int | None, vocab: int) -> dict:
    t = model.tier
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if hasattr(cache, "k"):  # attention: the span's keys and values read, one slot of each written
        elem = cache.k[0].element_size()
        kv_read = batch * t.n_layers * 2 * t.n_kv_heads * span * t.head_dim * elem
        written = batch * (t.n_layers * 2 * t.n_kv_heads * t.head_dim * elem + vocab * 4)
    else:  # resonance: every layer's state read and written
        state = sum(s.numel() * s.element_size() for s in cache.state)
        kv_read, written = state, state + batch * vocab * 4
    return {"weights": weights, "kv_read": kv_read, "kv_and_logits_written": written, "logits_read": batch * vocab * 4,
            "total": weights + kv_read + written + batch * vocab * 4}


def profile_one(model, batch: int, cache_len: int, attention: str, args, device) -> dict:
    on_cuda = device.type == "cuda"
    vocab = args.vocab
    g = torch.Generator().manual_seed(batch)
    prompt = torch.randint(0, vocab, (batch, cache_len), generator=g).to(device)
    steps = 2 + args.replays + args.timed + 4
    cache = model.new_kv_cache(batch, cache_len + steps)
    if attention != "auto" and hasattr(cache, "attention"):
        cache.attention = attention
    with torch.no_grad():
        logits = model.logits(model(prompt, kv_cache=cache)[:, -1])
        sampler = Sampler(batch, vocab, device=device, temperature=1.0, top_p=0.95,
                          seed=torch.arange(batch, device=device), graph=False)
        out = torch.empty(batch, steps + 1, dtype=torch.int64, device=device)
        loop = _DecodeLoop(model, cache, sampler, out, None, "inductor" if on_cuda else None)
        loop.emit(sampler(logits))
        if on_cuda:
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                loop.run_eager()  # compiles the step
                loop.run_eager()
            torch.cuda.current_stream(device).wait_stream(side)
            span = loop.span()
            side.wait_stream(torch.cuda.current_stream(device))
            loop.capture(span, side)
            run = lambda: loop.replay(span)  # noqa: E731
        else:
            loop.run_eager()
            span = loop.span()
            run = loop.run_eager
        run()
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_cuda else [])
        if on_cuda:
            torch.cuda.synchronize(device)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(args.replays):
                run()
            if on_cuda:
                torch.cuda.synchronize(device)
        times = []
        for _ in range(args.timed):
            if on_cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                run()
                times.append((time.perf_counter() - t0) * 1e3)
    kind = "cuda" if on_cuda else "cpu"
    rows = []
    for e in prof.key_averages():
        dev_us = getattr(e, "self_device_time_total", 0.0) if on_cuda else 0.0
        if on_cuda and dev_us <= 0:
            continue
        if not on_cuda and not e.key.startswith("aten::"):
            continue
        rows.append({"name": e.key[:120], "calls_per_step": e.count / args.replays,
                     "us_per_step": (dev_us if on_cuda else e.self_cpu_time_total) / args.replays})
    rows.sort(key=lambda r: -r["us_per_step"])
    model_bytes = traffic(model, cache, batch, span, vocab)
    bw = peak_memory_bandwidth(device)
    step_ms = statistics.median(times)
    return {"batch": batch, "cache_len": cache_len, "span": span, "attention": getattr(cache, "attention", None),
            "mixer": "attention" if hasattr(cache, "attention") else "resonance", "activity": kind,
            "step_ms": step_ms, "tokens_per_s": batch / (step_ms * 1e-3),
            "kernels_per_step": sum(r["calls_per_step"] for r in rows),
            "device_us_per_step": sum(r["us_per_step"] for r in rows) if on_cuda else None,
            "bytes_model": model_bytes, "floor_ms_at_peak_bw": None if bw is None else model_bytes["total"] / bw * 1e3,
            "top": rows[:args.top]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tier", default=None, help="default B on CUDA, nano on CPU")
    p.add_argument("--mixer", choices=["attention", "resonance"], default="attention")
    p.add_argument("--vocab", type=int, default=None, help="default 32000 on CUDA, 2000 on CPU")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--cache-len", type=int, default=32, help="prompt tokens before the profiled steps")
    p.add_argument("--attention", nargs="+", choices=["auto", "fused", "split_k"], default=["auto"])
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--timed", type=int, default=50)
    p.add_argument("--top", type=int, default=15, help="kernels listed per row")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_cuda = device.type == "cuda"
    args.tier = args.tier or ("B" if on_cuda and not args.smoke else "nano")
    args.vocab = args.vocab or (32000 if on_cuda and not args.smoke else 2000)
    if args.smoke:
        args.batches, args.replays, args.timed, args.vocab = [1, 2], 2, 3, 300
    torch.manual_seed(0)
    model = prepare_for_generation(build_model(args.tier, args.vocab, mixer=args.mixer), device)
    rows = []
    if args.mixer == "resonance":
        args.attention = ["auto"]
    dtype = next(model.parameters()).dtype
    print(f"decode step profile: {args.mixer} tier {args.tier}, vocab {args.vocab}, {dtype} on {device}, "
          f"{args.cache_len} cached tokens")
    print(f"{'batch':>6}{'attention':>10}{'step ms':>10}{'tokens/s':>12}{'kernels':>9}{'GPU us':>9}{'floor ms':>10}")
    for batch in args.batches:
        for attention in args.attention:
            with generation_autocast(model):  # the resonance family's fp32 weights decode under bf16 autocast on CUDA
                r = profile_one(model, batch, args.cache_len, attention, args, device)
            rows.append(r)
            gpu = "-" if r["device_us_per_step"] is None else f"{r['device_us_per_step']:.0f}"
            floor = "-" if r["floor_ms_at_peak_bw"] is None else f"{r['floor_ms_at_peak_bw']:.3f}"
            print(f"{batch:>6}{str(r['attention']):>10}{r['step_ms']:>10.3f}{r['tokens_per_s']:>12,.0f}"
                  f"{r['kernels_per_step']:>9.0f}{gpu:>9}{floor:>10}")
            for k in r["top"][:6]:
                print(f"{'':>8}{k['us_per_step']:>9.1f} us  x{k['calls_per_step']:<5.1f} {k['name'][:80]}")
    name = "decode_profile" + ("_resonance" if args.mixer == "resonance" else "")
    shapes = {"mixer": args.mixer, "tier": args.tier, "vocab": args.vocab, "batches": args.batches,
              "cache_len": args.cache_len, "attention": args.attention}
    path = write_result(name, {"smoke": args.smoke, "rows": rows, "shapes": shapes,
                               "peak_memory_bandwidth": peak_memory_bandwidth(device)}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
