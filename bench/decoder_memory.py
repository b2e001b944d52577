"""Peak extra memory of the chunked linear cross-entropy vs full logits + F.cross_entropy, forward + backward.

    python bench/decoder_memory.py                                  # 4096 tokens x 768 hidden x 32000 vocab
    python bench/decoder_memory.py --chunk-sizes 256 1024 4096 --dtype bfloat16
    python bench/decoder_memory.py --smoke --out /tmp/results       # tiny shapes, seconds (used by a test)

Both methods run side by side in one process on the same inputs; the ratio chunked / full is printed per chunk size
(goal at the default shape: < 1/8). "Peak extra" is the highest level of allocated memory above what was allocated
before the loss call, during forward + backward, INCLUDING the gradients of hidden and weight, which both methods
leave allocated (their size is reported as grads_bytes, so the transient part is peak - grads).

How memory is measured:
  CUDA: torch.cuda.max_memory_allocated() after reset_peak_memory_stats(), minus memory_allocated() before.
  CPU:  torch has no CPU peak counter and tracemalloc does not see torch's allocator, so the call runs under
        torch.profiler(profile_memory=True), whose allocation events carry the allocator's running total
        (`total_allocated`); peak extra = max(total) - total before the first event. This sees every tensor
        allocation made by torch on the calling thread, which is where all of these ops allocate.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import write_result  # noqa: E402
from cuda_ops.cross_entropy import linear_cross_entropy  # noqa: E402
from cuda_ops.dispatch import resolve_backend  # noqa: E402

MiB = 2**20


def _cpu_peak_extra_bytes(fn: Callable[[], None]) -> int:
    from torch._C._profiler import _EventType  # the profiler's allocation records (no public accessor yet)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.typed[0] == _EventType.Allocation:
            events.append((node.start_time_ns, node.typed[1].alloc_size, node.typed[1].total_allocated))
        stack.extend(node.children)
    if not events:
        return 0
    events.sort(key=lambda e: e[0])
    before = events[0][2] - events[0][1]
    return max(total for _, _, total in events) - before


def peak_extra_bytes(fn: Callable[[], None], device: torch.device) -> int:
    """Peak bytes allocated by `fn` above the level before it (see the module docstring for the method)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    return _cpu_peak_extra_bytes(fn)


def full_logits_loss(hidden, weight, targets):
    """The eager recipe: materialise (N, V) logits, upcast, torch's cross-entropy (as nanoGPT / torchtitan do)."""
    logits = hidden @ weight.t()                                                  # (N, V) input dtype
    return F.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="sum")


def make_inputs(tokens, hidden_size, vocab, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, device=device, generator=g).to(dtype)
    weight = (torch.randn(vocab, hidden_size, device=device, generator=g) * hidden_size ** -0.5).to(dtype)
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=g)
    return hidden, weight, targets


def fwd_bwd(loss_fn, hidden, weight, targets) -> Callable[[], None]:
    """Clear the leaves' grads now (outside any measurement window: freeing them inside would hide their size),
    and return a closure running forward + backward; the new grads stay allocated in the leaves."""
    hidden.requires_grad_().grad = None
    weight.requires_grad_().grad = None

    def run():
        loss_fn(hidden, weight, targets).backward()
    return run


def measure(tokens, hidden_size, vocab, dtype, device, chunk_sizes, backend=None) -> dict:
    hidden, weight, targets = make_inputs(tokens, hidden_size, vocab, dtype, device)
    backend = resolve_backend(device, backend)

    def chunked(cs):
        return lambda h, w, t: linear_cross_entropy(h, w, t, chunk_size=cs, backend=backend).loss_sum

    # One untimed round first: cuBLAS workspaces, the Numba compile and the out_dtype probe are one-off allocations.
    for fn in [full_logits_loss] + [chunked(cs) for cs in chunk_sizes]:
        fwd_bwd(fn, hidden, weight, targets)()
    full = peak_extra_bytes(fwd_bwd(full_logits_loss, hidden, weight, targets), device)
    rows = []
    for cs in chunk_sizes:
        peak = peak_extra_bytes(fwd_bwd(chunked(cs), hidden, weight, targets), device)
        rows.append({"chunk_size": cs, "peak_bytes": peak, "ratio_to_full": peak / full})
    grads = (tokens + vocab) * hidden_size * hidden.element_size()
    return {"shapes": {"tokens": tokens, "hidden": hidden_size, "vocab": vocab, "dtype": str(dtype).split(".")[-1]},
            "backend": backend,
            "method": "cuda.max_memory_allocated" if device.type == "cuda" else "torch.profiler allocation events",
            "full_logits_peak_bytes": full, "grads_bytes": grads, "chunked": rows, "goal_ratio": 1 / 8}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--chunk-sizes", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="default: bfloat16 on CUDA, float32 on CPU (CPU bf16 matmuls are slow and unrepresentative)")
    p.add_argument("--backend", choices=["auto", "numba", "reference"], default=None)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (64 x 32 x 500) for a quick end-to-end run")
    p.add_argument("--out", type=Path, default=None, help="results directory (default bench/results)")
    args = p.parse_args(argv)
    if args.smoke:
        args.tokens, args.hidden, args.vocab, args.chunk_sizes = 64, 32, 500, [16, 64]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))

    res = measure(args.tokens, args.hidden, args.vocab, dtype, device, args.chunk_sizes, args.backend)
    s = res["shapes"]
    print(f"peak extra memory, forward+backward, {s['tokens']} tokens x {s['hidden']} hidden x {s['vocab']} vocab, "
          f"{s['dtype']} on {device.type} ({res['method']}; includes {res['grads_bytes'] / MiB:.1f} MiB of grads)")
    print(f"  {'full logits + F.cross_entropy':<36}{res['full_logits_peak_bytes'] / MiB:>10.1f} MiB   ratio 1.000")
    for row in res["chunked"]:
        label = f"chunked ({res['backend']}), chunk {row['chunk_size']}"
        print(f"  {label:<36}{row['peak_bytes'] / MiB:>10.1f} MiB   ratio {row['ratio_to_full']:.3f}")
    path = write_result("decoder_memory", {**res, "smoke": args.smoke}, out_dir=args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
