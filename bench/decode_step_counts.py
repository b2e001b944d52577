"""What one decode step costs, counted on a CPU: bytes written, torch ops dispatched and device-to-host syncs, at
batches x cache lengths; and decode tokens/s of this checkout beside another one's, in the same run.

    python bench/decode_step_counts.py                          # nano: batches 1 8 64 x cache lengths 256 8192
    python bench/decode_step_counts.py --tier A --batch-sizes 1 64
    python bench/decode_step_counts.py --tree /tmp/old          # the same counts for another checkout's model code
    python bench/decode_step_counts.py --speed-tree /tmp/main   # + tokens/s at batch 1 and 64, that checkout and this
    python bench/decode_step_counts.py --smoke --out /tmp/r     # seconds (used by a test)

The step is what model/decode_loop.py runs per token: the model's graph-safe step and its logits (what is compiled
and captured on CUDA), then the sampler and the loop's bookkeeping (eager, captured with it). Counted three ways
(bench/step_counts.py says how): `model_eager` (every aten op the model step dispatches: what a CUDA graph of the
eager step replays), `model_compiled` (the forward graph torch.compile hands inductor, before fusion: an upper bound
of what the compiled step stores, exact for cache writes and copies) and `sampler_emit` (the reference sampler and
the bookkeeping, eager; on CUDA the Numba sampler is a fixed launch sequence over buffers of its own).

The cache is filled with random keys and values to the cache length (no prefill: the counts do not depend on what
the cache holds), then one step is counted. The goal: bytes written grow with the batch by a per-row amount made of
the new K/V entries, the logits and the row's activations, and not at all with the cache length; ops and syncs are
the same at every batch. Per (part, attention path) the summary fits bytes = a + b x batch at each cache length
and says whether anything grows with the cache length; the traffic model beside it gives the new K/V entries and the
logits of one row.

Speed (--speed-tree DIR, or --speed for this checkout alone): decode tokens/s through generate_ids_timed after
32-token prompts at batch 1 and 64, and of the step after a cache of 8,192 (filled as above), alternating this
checkout and DIR's over --repeat rounds so both see the same load; medians. JSON to bench/results/.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]


def _load_step_counts():
    """bench/step_counts.py of this checkout, whatever checkout `model` comes from (--tree)."""
    name = "decode_step_counts_helper"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE.with_name("step_counts.py"))
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def _build(tier: str, vocab: int):
    import torch

    from model.decoder import build_model

    torch.manual_seed(0)
    return build_model(tier, vocab).eval()


def _filled_cache(model, batch: int, cache_len: int, attention: str | None):
    """A cache holding `cache_len` random keys and values per row, room for a few more steps."""
    import torch

    cache = model.new_kv_cache(batch_size=batch, max_len=cache_len + 8)
    g = torch.Generator().manual_seed(cache_len)
    for buf in list(cache.k) + list(cache.v):
        buf[:, :, :cache_len] = torch.randn(buf[:, :, :cache_len].shape, generator=g)
    cache.advance(cache_len)
    if attention is not None:
        cache.attention = attention
    return cache


def attention_paths(model) -> list[str | None]:
    """The decode attention paths this checkout's KV cache offers (None: it has one, unnamed)."""
    import torch

    probe = model.new_kv_cache(batch_size=1, max_len=1)
    return ["fused", "split_k"] if hasattr(probe, "attention") else [None]


PARTS = ("model_compiled", "model_eager", "sampler_emit")


def count_shape(model, batch: int, cache_len: int, attention: str | None, vocab: int, parts=PARTS) -> list[dict]:
    """One decode step at (batch, cache_len) through `attention`, counted as each of `parts` (module docstring)."""
    import torch

    from cuda_ops.sampling import Sampler

    sc = _load_step_counts()
    cache = _filled_cache(model, batch, cache_len, attention)
    span = cache.decode_span()
    tok = torch.randint(0, vocab, (batch,), generator=torch.Generator().manual_seed(batch))

    def model_step(tok):
        return model.logits(model.decode_compute(tok, cache, span))

    rows = []
    base = {"batch": batch, "cache_len": cache_len, "span": span, "attention": attention or "split_k"}
    with torch.no_grad():
        if "model_compiled" in parts:
            graph = sc.forward_graph(model_step, tok)
            rows.append({**base, "part": "model_compiled", **sc.count_graph(graph).as_dict()})
        if "model_eager" in parts:
            rows.append({**base, "part": "model_eager", **sc.count_eager(model_step, tok).as_dict()})
        if "sampler_emit" not in parts:
            return rows
        logits = model_step(tok)
        import model.decoder
        try:
            from model import decode_loop
        except ImportError:
            decode_loop = None
        if decode_loop is None or Path(decode_loop.__file__).parent != Path(model.decoder.__file__).parent:
            return rows  # an older checkout: the loop lived elsewhere (or would come from this one's editable install)
        _DecodeLoop = decode_loop._DecodeLoop
        sampler = Sampler(batch, vocab, temperature=1.0, top_p=0.95, seed=1, backend="reference", graph=False)
        out = torch.empty(batch, 4, dtype=torch.int64)
        loop = _DecodeLoop(model, cache, sampler, out, eos_id=0, compile_backend=None)
        rows.append({**base, "part": "sampler_emit", **sc.count_eager(lambda: loop.emit(sampler(logits))).as_dict()})
    return rows


def traffic_model(model, vocab: int) -> dict:
    """Bytes one row must write per step by construction: its new K/V entries and its fp32 logits."""
    t = model.tier
    probe = model.new_kv_cache(batch_size=1, max_len=1)
    elem = probe.k[0].element_size()
    kv = t.n_layers * 2 * t.n_kv_heads * t.head_dim * elem
    return {"kv_entry_bytes_per_row": kv, "logits_bytes_per_row": vocab * 4, "n_layers": t.n_layers,
            "d_model": t.d_model, "d_ff": t.d_ff, "cache_row_bytes_per_slot": kv}


def summarise(rows: list[dict], model_bytes: dict) -> list[dict]:
    """Per (part, attention): bytes = a + b x batch at each cache length; growth with the cache length; ops/syncs."""
    sc = _load_step_counts()
    out = []
    for key in sorted({(r["part"], r["attention"]) for r in rows}):
        sel = [r for r in rows if (r["part"], r["attention"]) == key]
        lens = sorted({r["cache_len"] for r in sel})
        fits = {}
        for L in lens:
            pts = sorted((r["batch"], r["bytes_written"]) for r in sel if r["cache_len"] == L)
            a, b = sc.linear_fit([p[0] for p in pts], [p[1] for p in pts])
            fits[str(L)] = {"intercept_bytes": round(a), "per_row_bytes": round(b),
                            "linear": sc.is_linear([p[0] for p in pts], [p[1] for p in pts])}
        by_batch = {}
        for r in sel:
            by_batch.setdefault(r["batch"], {})[r["cache_len"]] = r["bytes_written"]
        grows = {str(b): v[max(v)] - v[min(v)] for b, v in sorted(by_batch.items()) if len(v) > 1}
        per_row = fits[str(lens[-1])]["per_row_bytes"]
        kv, lg = model_bytes["kv_entry_bytes_per_row"], model_bytes["logits_bytes_per_row"]
        out.append({"part": key[0], "attention": key[1], "fits": fits,
                    "bytes_growth_from_shortest_to_longest_cache_by_batch": grows,
                    "grows_with_cache_len": any(g != 0 for g in grows.values()),
                    "ops": sorted({r["ops"] for r in sel}), "syncs": sorted({r["syncs"] for r in sel}),
                    "ops_constant": len({r["ops"] for r in sel}) == 1,
                    "per_row_over_kv_and_logits": round(per_row / (kv + lg), 3)})
    return out


# ---------------------------------------------------------------------------------------------------- speed
def speed(tier: str, vocab: int, batches: list[int], new_tokens: int, long_len: int, steps: int) -> dict:
    """Decode tokens/s: generate_ids_timed after 32-token prompts; the step alone after a cache of long_len."""
    import torch

    from cuda_ops.sampling import Sampler
    from model.decode_loop import _DecodeLoop, generate_ids_timed

    model = _build(tier, vocab)
    res = {}
    for batch in batches:
        prompts = torch.randint(0, vocab, (batch, 32), generator=torch.Generator().manual_seed(batch)).tolist()
        generate_ids_timed(model, prompts, max_new_tokens=4, top_p=0.95)  # warm-up
        t = generate_ids_timed(model, prompts, max_new_tokens=new_tokens, top_p=0.95)[1]
        res[f"short_b{batch}"] = t.decode_tokens_per_s
        cache = _filled_cache(model, batch, long_len, None)
        cache.max_len = cache.length + steps + 2
        sampler = Sampler(batch, vocab, temperature=1.0, top_p=0.95, seed=1, backend="reference")
        loop = _DecodeLoop(model, cache, sampler, torch.zeros(batch, steps + 1, dtype=torch.int64), None, None)
        with torch.no_grad():
            loop.run_eager()
            t0 = time.perf_counter()
            for _ in range(steps):
                loop.run_eager()
            res[f"long{long_len}_b{batch}"] = batch * steps / (time.perf_counter() - t0)
    return res


def _speed_in(tree: Path, args) -> dict:
    """speed() with `model` and `cuda_ops` imported from `tree`, in a fresh process."""
    cmd = [sys.executable, str(HERE), "--tree", str(tree), "--speed-only", "--tier", args.tier, "--vocab",
           str(args.vocab), "--new-tokens", str(args.new_tokens), "--long-len", str(args.long_len), "--steps",
           str(args.steps), "--speed-batches", *map(str, args.speed_batches)]
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"error: the speed run in {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tier", default="nano")
    p.add_argument("--vocab", type=int, default=2000)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--cache-lens", type=int, nargs="+", default=[256, 8192])
    p.add_argument("--tree", type=Path, help="import model/ and cuda_ops/ from this checkout (default: this one)")
    p.add_argument("--speed", action="store_true", help="also tokens/s of this checkout")
    p.add_argument("--speed-tree", type=Path, help="also tokens/s of this checkout and of DIR, alternating")
    p.add_argument("--speed-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--speed-batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--long-len", type=int, default=8192)
    p.add_argument("--steps", type=int, default=16, help="timed steps after the long cache")
    p.add_argument("--repeat", type=int, default=3, help="speed rounds (each: DIR's run, then this checkout's)")
    p.add_argument("--label", default=None, help="a name for the result file (default: the tree's folder name)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    p.add_argument("--out", type=Path, help="results directory (default bench/results)")
    args = p.parse_args(argv)
    if args.smoke:
        args.vocab, args.batch_sizes, args.cache_lens = 300, [1, 3], [16, 300]
        args.speed_batches, args.new_tokens, args.long_len, args.steps, args.repeat = [1, 2], 6, 300, 3, 1
    tree = (args.tree or REPO).resolve()
    sys.path.insert(0, str(tree))
    import torch

    if args.speed_only:
        print(json.dumps(speed(args.tier, args.vocab, args.speed_batches, args.new_tokens, args.long_len, args.steps)))
        return 0
    model = _build(args.tier, args.vocab)
    rows = []
    for attention in attention_paths(model):
        for L in args.cache_lens:
            for B in args.batch_sizes:
                rows += count_shape(model, B, L, attention, args.vocab)
    model_bytes = traffic_model(model, args.vocab)
    summary = summarise(rows, model_bytes)
    print(f"decode step counts: tier {args.tier}, vocab {args.vocab}, {tree}; per row: new K/V "
          f"{model_bytes['kv_entry_bytes_per_row']:,} B, logits {model_bytes['logits_bytes_per_row']:,} B")
    print(f"{'part':<16}{'attention':<10}{'batch':>6}{'cache':>7}{'span':>7}{'ops':>6}{'syncs':>6}"
          f"{'bytes written':>16}")
    for r in rows:
        print(f"{r['part']:<16}{r['attention']:<10}{r['batch']:>6}{r['cache_len']:>7}{r['span']:>7}{r['ops']:>6}"
              f"{r['syncs']:>6}{r['bytes_written']:>16,}")
    for s in summary:
        growth = s["bytes_growth_from_shortest_to_longest_cache_by_batch"]
        fit = "; ".join(f"cache {L}: {f['intercept_bytes']:,} + {f['per_row_bytes']:,} x batch" for L, f in
                        s["fits"].items())
        print(f"  {s['part']} ({s['attention']}): {fit}; grows with the cache length: "
              f"{'yes ' + str(growth) if s['grows_with_cache_len'] else 'no'}; "
              f"ops {s['ops']}, syncs {s['syncs']}")
    result = {"shapes": {"tier": args.tier, "vocab": args.vocab, "batch_sizes": args.batch_sizes,
                         "cache_lens": args.cache_lens}, "tree": str(tree), "smoke": args.smoke,
              "traffic_model": model_bytes, "rows": rows, "summary": summary,
              "command": "python bench/decode_step_counts.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    if args.speed or args.speed_tree:
        rounds = {"this": [], "other": []}
        load_before = os.getloadavg()
        for _ in range(args.repeat):
            if args.speed_tree:
                rounds["other"].append(_speed_in(args.speed_tree.resolve(), args))
            rounds["this"].append(_speed_in(tree, args))
        med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in rounds.items() if v}
        result["speed"] = {"tier": args.tier, "speed_tree": str(args.speed_tree) if args.speed_tree else None,
                           "rounds": rounds, "median_tokens_per_s": med,
                           "load_average_before": [round(x, 2) for x in load_before],
                           "load_average_after": [round(x, 2) for x in os.getloadavg()]}
        print(f"decode tokens/s, tier {args.tier} (median of {args.repeat}; 'short': after 32-token prompts, "
              f"{args.new_tokens} new tokens; 'long': the step after a cache of {args.long_len})")
        for m in med["this"]:
            other = med.get("other", {}).get(m)
            print(f"  {m:<16}{'' if other is None else f'{other:>12,.1f} (other)'}{med['this'][m]:>12,.1f} (this)"
                  + ("" if other is None else f"   ratio {med['this'][m] / other:.2f}"))
    sys.path.insert(0, str(REPO))
    from bench.common import write_result

    label = args.label or ("" if tree == REPO else tree.name)
    path = write_result(f"decode_step_counts_{args.tier}" + (f"_{label}" if label else ""), result, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
