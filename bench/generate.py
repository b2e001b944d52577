"""Generation speed: prefill and decode tokens/s of model/decode_loop.py at batch 1, 8 and 64, with the
kernels' sampler and with the pure-torch reference sampler, side by side in one run; after short and long prompts,
for either model family.

    python bench/generate.py                          # CPU: tier nano, vocab 2,000 (the cpu preset's), fp32
                                                      # CUDA: tier B, vocab 32,000, bf16, compiled step, CUDA graph
    python bench/generate.py --tier B --vocab 32000 --batch-sizes 1 64 --new-tokens 128
    python bench/generate.py --prompt-len 32 8192 32768 --batch-sizes 1      # decode after long prompts
    python bench/generate.py --mixer resonance --prompt-len 32 32768 --batch-sizes 1
    python bench/generate.py --prompt-len 8192 32768 --batch-sizes 1 --samplers kernels --repeat 1   # gpu_check's
    python bench/generate.py --threads 1              # CPU: torch intra-op threads for the run
    python bench/generate.py --smoke --out /tmp/r     # tiny, seconds (used by a test)

Random weights (the speed does not depend on them), random prompts of equal length (--prompt-len, several
allowed), 128 new tokens, temperature 1 and top-p 0.95. Per prompt length, batch size and sampler: one first call
(compile and warm-up; its wall time is reported as first_call_s), then --repeat timed calls; the medians are
reported. Within a call, prefill is the prompt forward, decode the steady-state steps after the warm-up steps (and,
on CUDA, the compile and graph capture), each phase closed by a device sync (see model/decode_loop.py).
decode tokens per CPU-second (process time) is reported beside the wall-clock figure: on a shared machine the wall
clock includes time spent waiting for a core. On CPU the kernels' dispatch resolves to the reference sampler, so
the two columns run the same code there. --compile (default on CUDA) compiles the decode step before capture.

Before the first token (the JSON's `first_token` per row, from the first call, which pays every one-off cost): the
cache allocation, the prefill (its forwards: one per PREFILL_CHUNK tokens a row), the first sampler call (Numba's
compile on CUDA), the first decode step (torch.compile's trace and compile) and the graph captures (CUDA only: the
CPU runs eagerly); `compiles` counts the graphs torch.compile made during the call (0 once the step is compiled
for this batch size: the cache length and span are symbolic); peak memory is torch's CUDA peak (CPU: the process's
maximum resident set, which only grows).
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import write_result  # noqa: E402
from cuda_ops.dispatch import resolve_backend  # noqa: E402
from model.decoder import build_model  # noqa: E402
from model.decode_loop import generate_ids_timed, generation_autocast  # noqa: E402
from pipeline.train.handoff.text_generation import prepare_for_generation  # noqa: E402
from pipeline.train.memory.hardware import default_device  # noqa: E402

SAMPLERS = {"kernels": None, "reference": "reference"}  # name -> sampling_backend passed to generate


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tier", help="model tier (default: B on CUDA, nano on CPU)")
    p.add_argument("--vocab", type=int, help="vocabulary size (default: 32000 on CUDA, 2000 on CPU)")
    p.add_argument("--mixer", choices=["attention", "resonance"], default="attention", help="model family")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="default 1 8 64 (1 2 with --smoke)")
    p.add_argument("--prompt-len", type=int, nargs="+", default=None,
                   help="prompt lengths, e.g. 32 8192 32768 (default 32; 4 with --smoke)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the decode step (default: on CUDA)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--samplers", nargs="+", choices=list(SAMPLERS), default=list(SAMPLERS),
                   help="samplers to run (default both: the kernels' and the reference, side by side)")
    p.add_argument("--threads", type=int, help="CPU: torch.set_num_threads for the run (default: torch's)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    p.add_argument("--out", type=Path, help="results directory (default bench/results)")
    args = p.parse_args(argv)
    if args.smoke:
        args.tier, args.vocab, args.batch_sizes = "nano", 300, args.batch_sizes or [1, 2]
        args.prompt_len, args.new_tokens, args.repeat = args.prompt_len or [4], 6, 1
    args.prompt_len = args.prompt_len or [32]
    args.batch_sizes = args.batch_sizes or [1, 8, 64]
    return args


def measure(decoder, batch: int, prompt_len: int, args, sampling_backend: str | None, device: torch.device) -> dict:
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, args.vocab, (batch, prompt_len), generator=g).tolist()
    # a model without a graph-safe decode_compute (the resonance family until its state is static) decodes eagerly
    compile_step = bool(args.compile) and hasattr(decoder, "decode_compute")
    kw = dict(max_new_tokens=args.new_tokens, temperature=1.0, top_p=args.top_p, sampling_backend=sampling_backend,
              compile_step=compile_step)
    from torch._dynamo.utils import counters

    with generation_autocast(decoder):
        graphs_before = counters["stats"]["unique_graphs"]
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        _, first = generate_ids_timed(decoder, prompts, **kw)  # first call: compiles (Numba sampler, the step)
        first_call_s = time.perf_counter() - t0
        compiles = counters["stats"]["unique_graphs"] - graphs_before
        peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        runs = [generate_ids_timed(decoder, prompts, seed=r, **kw)[1] for r in range(args.repeat)]
    med = lambda f: statistics.median(f(t) for t in runs)  # noqa: E731
    first_token = {"cache_s": round(first.cache_s, 4), "prefill_s": round(first.prefill_s - first.cache_s, 4),
                   "prefill_chunks": first.prefill_chunks, "first_sample_s": round(first.first_sample_s, 4),
                   "first_step_s": round(first.first_step_s, 4), "capture_s": round(first.capture_s, 4),
                   "compiles": compiles, "peak_memory_bytes": peak, "peak_memory_kind": "cuda_allocated"
                   if device.type == "cuda" else "process_max_rss"}
    return {"batch": batch, "prompt_len": prompt_len, "first_call_s": round(first_call_s, 4),
            "prefill_tokens_per_s": round(med(lambda t: t.prefill_tokens_per_s), 1),
            "decode_tokens_per_s": round(med(lambda t: t.decode_tokens_per_s), 1),
            "decode_tokens_per_cpu_s": round(med(lambda t: t.decode_tokens / max(t.decode_cpu_s, 1e-9)), 1),
            "warmup_s": round(med(lambda t: t.warmup_s), 4), "decode_tokens": runs[0].decode_tokens,
            "cuda_graph": runs[0].cuda_graph, "compiled": runs[0].compiled, "graphs": runs[0].graphs,
            "sampler_backend": resolve_backend(device, sampling_backend), "first_token": first_token}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = default_device()
    on_cuda = device.type == "cuda"
    args.tier = args.tier or ("B" if on_cuda else "nano")
    args.vocab = args.vocab or (32000 if on_cuda else 2000)
    if args.compile is None:
        args.compile = on_cuda  # inductor's C++ build on a CPU takes minutes; the eager step is the CPU figure
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    decoder = prepare_for_generation(build_model(args.tier, args.vocab, mixer=args.mixer), device)
    dtype = str(next(decoder.parameters()).dtype).replace("torch.", "")
    load_before = os.getloadavg()
    print(f"generate: {args.mixer} tier {args.tier}, vocab {args.vocab}, {dtype} on {device}, prompts "
          f"{args.prompt_len}, {args.new_tokens} new tokens, top-p {args.top_p}, compiled step {args.compile}, "
          f"torch threads {torch.get_num_threads()}, load average {load_before[0]:.2f}")
    rows = []
    header = (f"{'prompt':>6} | {'batch':>5} | {'sampler':>9} | {'prefill tok/s':>13} | {'decode tok/s':>12} | "
              f"{'decode tok/CPU-s':>16} | {'graph':>5} | {'first call s':>12}")
    print(header + "\n" + "-" * len(header))
    family = "" if args.mixer == "attention" else f"{args.mixer}_"
    result_name = f"generate_{family}{args.tier}" + ("" if on_cuda else f"_t{torch.get_num_threads()}")

    def write(complete: bool) -> Path:
        """The result so far, rewritten after every row: a run stopped midway (bench/gpu_check.py's cap) keeps the
        rows it measured, with "complete": false."""
        return write_result(result_name, {
            "smoke": args.smoke, "complete": complete,
            "shapes": {"mixer": args.mixer, "tier": args.tier, "vocab": args.vocab, "dtype": dtype,
                       "prompt_lens": args.prompt_len, "new_tokens": args.new_tokens,
                       "batch_sizes": args.batch_sizes, "top_p": args.top_p, "repeat": args.repeat,
                       "samplers": args.samplers,
                       "compiled_step": args.compile},
            "torch_threads": torch.get_num_threads(),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "command": "python bench/generate.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "rows": rows}, args.out)

    for prompt_len in args.prompt_len:
        for batch in args.batch_sizes:
            for name in args.samplers:
                backend = SAMPLERS[name]
                row = {"sampler": name, **measure(decoder, batch, prompt_len, args, backend, device)}
                rows.append(row)
                print(f"{prompt_len:>6} | {batch:>5} | {name:>9} | {row['prefill_tokens_per_s']:>13,.0f} | "
                      f"{row['decode_tokens_per_s']:>12,.0f} | {row['decode_tokens_per_cpu_s']:>16,.0f} | "
                      f"{'yes' if row['cuda_graph'] else 'no':>5} | {row['first_call_s']:>12.2f}")
                ft = row["first_token"]
                print(f"{'':>6}   before the first token: cache {ft['cache_s']:.3f} s, prefill {ft['prefill_s']:.3f} s "
                      f"({ft['prefill_chunks']} forward(s)), first sample {ft['first_sample_s']:.3f} s, first step "
                      f"{ft['first_step_s']:.3f} s ({ft['compiles']} compile(s)), capture {ft['capture_s']:.3f} s, "
                      f"peak {ft['peak_memory_bytes'] / 2**20:,.0f} MiB")
                write(complete=False)
            if len(args.samplers) == 2:
                k, r = rows[-2], rows[-1]
                print(f"{'':>6}   {'':>5}   ratio kernels / reference decode tokens/s: "
                      f"{k['decode_tokens_per_s'] / r['decode_tokens_per_s']:.2f}")
    path = write(complete=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
