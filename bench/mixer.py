"""Attention vs resonance mixer, side by side on one device: training and generation tokens/s and peak memory
per sequence length, tier for tier (the same tier name: nearly the same parameter count, `python -m model`), the
scan kernel's bytes-moved model, and the activation bytes each family keeps for backward.

    python bench/mixer.py                                   # tier B at 8,192 ... 262,144, one document (a GPU)
    python bench/mixer.py --doc-masking                     # rows of 4 documents, masked (resonance: the scan)
    python bench/mixer.py --find-max-seq --seq-lens 65536   # also: the longest row each family trains at batch 1
    python bench/mixer.py --activation-checkpointing mixer  # resonance recomputes its mixer halves (attention: none)
    python bench/mixer.py --tier nano --seq-lens 1024 4096 --steps 3 --gen-tokens 16   # what a CPU manages
    python bench/mixer.py --smoke                           # seconds, on CPU (the test suite runs this)
    python bench/mixer.py --smoke --compile on --tier B     # CPU: the saved bytes of tier B's width, compiled blocks

Training: forward, backward (the fused cross-entropy of cuda_ops, as the engine runs it) and an AdamW step on
random tokens, batch --batch-size, bf16 autocast on CUDA, every block compiled on CUDA as the engine compiles
them (`model.compile_blocks()`, --compile), so both families get the same compiler. No document masking unless
--doc-masking (attention then uses flex/varlen as the engine would). The resonance core runs the form the
engine's model picks: on CUDA the Numba scan kernel (cuda_ops/resonance_scan.py) for every row, on CPU the FFT
(one document) or the reference scan. Generation: a prompt of seq_len - gen_tokens tokens (prefill, timed apart),
then gen_tokens greedy decode steps, each the family's static decode step (KV cache / recurrent state), eager; again
at each of --gen-batch-sizes (1 and 64) after the same prompt length.
Peak memory: torch.cuda.max_memory_allocated on CUDA; on a CPU every live tensor is counted by
pipeline/train/memory/limit.py in a separate, untimed pass. A length that runs out of memory is recorded as
"oom". Ratios printed: resonance / attention (tokens/s; memory).

Also printed (and in the JSON): the scan kernel's bytes-moved model for the tier (cuda_ops.resonance_scan.traffic:
bytes read and written per pass, the time that traffic takes at 3 TB/s, per layer and per step, on the device's
launch plan, the H100's off CUDA), and the bytes autograd saves for backward per token and layer
(bench.common.saved_tensor_bytes on one-layer models of the tier's width): attention, the resonance FFT form
through its autograd Function and through plain autograd (what the form kept before), and the scan.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import math
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

if __package__ in (None, ""):  # run as `python bench/mixer.py`: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import model.resonance as resonance
from bench.common import device_info, saved_tensor_bytes, write_result
from cuda_ops import resonance_scan
from cuda_ops.cross_entropy import linear_cross_entropy
from model.decoder import Decoder, build_model
from model.tiers import get_mixer_tier
from pipeline.train.memory.limit import MemoryLimit

MIXERS = ("attention", "resonance")
GIB = 2**30
BANDWIDTH = 3.0e12  # bytes/s: the "time at 3 TB/s" of the bytes-moved model (an H100's HBM3 peaks at 3.35)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _fresh_compile(model) -> None:
    """model.compile_blocks(), as pipeline/train/engine.py does, after dropping what earlier models compiled: every
    row builds a new model of the same block classes, and past torch._dynamo's recompile limit (8 per code object)
    a block would silently run eager."""
    import torch._dynamo

    torch._dynamo.reset()
    model.compile_blocks()


class Setup:
    """One model of one family on the device, its optimizer, and random data of one shape."""

    def __init__(self, mixer: str, tier: str, vocab: int, seq_len: int, batch: int, device: torch.device,
                 doc_masking: bool, compile_blocks: bool, activation_checkpointing: str = "none"):
        torch.manual_seed(0)
        self.device, self.seq_len, self.batch = device, seq_len, batch
        if activation_checkpointing == "mixer" and mixer != "resonance":
            activation_checkpointing = "none"  # the resonance family's own option; attention keeps everything
        self.model = build_model(tier, vocab, mixer=mixer, doc_masking=doc_masking,
                                 activation_checkpointing=activation_checkpointing).to(device)
        if compile_blocks:
            _fresh_compile(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=device.type == "cuda")
        self.tokens = torch.randint(0, vocab, (batch, seq_len + 1), device=device)
        # documents of 1/4 row each when doc masking is on (what packing gives for long documents)
        self.doc_ids = (torch.arange(seq_len, device=device) // max(1, seq_len // 4)).int().expand(batch, -1)
        self.doc_masking = doc_masking
        self.amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def train_step(self) -> None:
        with self.amp:
            hidden = self.model(self.tokens[:, :-1], self.doc_ids if self.doc_masking else None)
            res = linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), self.model.output_weight,
                                       self.tokens[:, 1:].reshape(-1))
        (res.loss_sum / res.n_tokens).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def generate(self, n_new: int, batch: int | None = None) -> float:
        """Prefill seq_len - n_new tokens in each of `batch` rows (default: the training batch; extra rows repeat
        the data's), then n_new greedy steps; returns the decode seconds."""
        self.model.eval()
        batch = batch or self.batch
        prompt = self.tokens[:, : self.seq_len - n_new].repeat(-(-batch // self.batch), 1)[:batch]
        with self.amp:
            cache = self.model.new_kv_cache(batch_size=batch, max_len=self.seq_len)
            h = self.model(prompt, kv_cache=cache)[:, -1]
            nxt = self.model.logits(h).argmax(-1)
            _sync(self.device)
            t0 = time.perf_counter()
            for _ in range(n_new):
                h = self.model.decode_step(nxt, cache)
                nxt = self.model.logits(h).argmax(-1)
            _sync(self.device)
        self.model.train()
        return time.perf_counter() - t0


def _peak_gib(setup: Setup, what) -> float:
    """Peak memory of one call of `what`: the CUDA allocator's peak, or every live CPU tensor counted."""
    if setup.device.type == "cuda":
        _free(setup.device)
        what()
        _sync(setup.device)
        return torch.cuda.max_memory_allocated(setup.device) / GIB
    cap = MemoryLimit.for_device(1e6, setup.device)
    with cap.during(setup.model, setup.optimizer):
        what()
    return cap.peak_gib()


def measure(mixer: str, args, seq_len: int, device: torch.device) -> dict:
    row = {"mixer": mixer, "seq_len": seq_len, "batch": args.batch_size}
    setup = None
    try:
        setup = Setup(mixer, args.tier, args.vocab, seq_len, args.batch_size, device, args.doc_masking, args.compile,
                      args.activation_checkpointing)
        row["params"] = setup.model.num_params()
        t0 = time.perf_counter()
        setup.train_step()  # warm-up: compilation, optimizer state, kernels, allocator
        _sync(device)
        row["first_step_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(args.steps):
            setup.train_step()
        _sync(device)
        row["train_tokens_per_s"] = args.steps * args.batch_size * seq_len / (time.perf_counter() - t0)
        row["train_peak_gib"] = _peak_gib(setup, setup.train_step)
        n_new = min(args.gen_tokens, seq_len // 2)
        setup.generate(2)  # warm-up
        row["gen_tokens"] = n_new
        row["decode_tokens_per_s"] = n_new * args.batch_size / setup.generate(n_new)
        row["gen_peak_gib"] = _peak_gib(setup, lambda: setup.generate(n_new))
        row["decode_tokens_per_s_by_batch"] = {}
        for b in args.gen_batch_sizes:  # after the same prompt length; OOM (a KV cache of b rows) is recorded
            try:
                setup.generate(2, b)
                row["decode_tokens_per_s_by_batch"][b] = n_new * b / setup.generate(n_new, b)
            except torch.OutOfMemoryError:
                row["decode_tokens_per_s_by_batch"][b] = "oom"
                _free(device)
        row["status"] = "ok"
    except torch.OutOfMemoryError as exc:
        row.update(status="oom", reason=str(exc).splitlines()[0][:200])
    finally:
        setup = None
        _free(device)
    return row


def max_trainable_seq(mixer: str, args, device: torch.device, start: int = 8192, limit: int = 2**21) -> int:
    """The longest row start * 2^k whose training step fits at batch 1; 0 if none."""
    best, seq = 0, start
    while seq <= limit:
        setup = None
        try:
            setup = Setup(mixer, args.tier, args.vocab, seq, 1, device, args.doc_masking, args.compile,
                          args.activation_checkpointing)
            setup.train_step()
            _sync(device)
            best = seq
        except torch.OutOfMemoryError:
            break
        finally:
            setup = None
            _free(device)
        seq *= 2
    return best


# ---------------------------------------------------------------------------------------------------------------
# What the resonance core costs in bytes: the kernel's traffic model, and what autograd keeps for backward
# ---------------------------------------------------------------------------------------------------------------

def kernel_model(tier_name: str, seq_lens: list[int], batch: int, device: torch.device) -> list[dict]:
    """The scan kernel's bytes per pass for each row length (bf16 I/O, the device's launch plan), with the time
    that traffic takes at BANDWIDTH; a pass that moves few bytes is bounded by its `steps` instead."""
    tier = get_mixer_tier(tier_name, "resonance")
    out = []
    for T in seq_lens:
        plan = resonance_scan.device_plan(batch, T, tier.n_groups, tier.n_eigen, device)
        passes = resonance_scan.traffic(plan, io_bytes=4)
        layer_bytes = sum(p["read"] + p["written"] for p in passes)
        out.append({"seq_len": T, "chunk": plan.chunk, "n_chunks": plan.n_chunks, "threads": plan.threads,
                    "passes": [{**p, "us_at_3tbs": (p["read"] + p["written"]) / BANDWIDTH * 1e6} for p in passes],
                    "layer_bytes": layer_bytes, "step_ms_at_3tbs": tier.n_layers * layer_bytes / BANDWIDTH * 1e3})
    return out


def saved_bytes(tier_name: str, seq_len: int, device: torch.device, compile_blocks: bool) -> dict:
    """Bytes per token per layer that autograd keeps from a forward (bf16 autocast), on one-layer models of the
    tier's width: attention (one document), the resonance FFT form through its autograd Function and through plain
    autograd (the same ops: what the form kept before), and the resonance scan (4 documents; the kernel on CUDA,
    the reference scan elsewhere), and the resonance model with activation_checkpointing="mixer". Per token = the growth from seq_len to 2 seq_len tokens over
    seq_len, so what does not grow with the row (autocast's bf16 copies of the weights) is left out."""
    scan = "kernel" if resonance.core_form(device, True) == "scan" and device.type == "cuda" else "reference"
    plain_autograd = functools.partial(resonance.fft_conv, plain_autograd=True)
    runs = {"attention": ("attention", False, None, "none"), "resonance fft": ("resonance", False, None, "none"),
            "resonance fft, plain autograd": ("resonance", False, plain_autograd, "none"),
            f"resonance scan ({scan}), 4 docs": ("resonance", True, None, "none"),
            "resonance, mixer recomputed": ("resonance", False, None, "mixer")}
    out = {}
    for name, (mixer, docs, patch, ac) in runs.items():
        torch.manual_seed(0)
        one_layer = dataclasses.replace(get_mixer_tier(tier_name, mixer), n_layers=1)
        model = (Decoder(one_layer, 1000) if mixer == "attention"
                 else resonance.ResonanceLM(one_layer, 1000, activation_checkpointing=ac)).to(device)
        if compile_blocks:  # what the compiled block keeps (its partitioner recomputes cheap elementwise work)
            _fresh_compile(model)
        total = []
        for T in (seq_len, 2 * seq_len):
            tokens = torch.randint(0, 1000, (1, T), device=device)
            doc_ids = (torch.arange(T, device=device) // (T // 4)).int()[None] if docs else None
            with mock.patch.object(resonance, "fft_conv", patch or resonance.fft_conv), \
                    torch.autocast(device.type, dtype=torch.bfloat16):
                if compile_blocks:
                    model(tokens, doc_ids).float().sum().backward()  # compile first: count the steady state
                total.append(saved_tensor_bytes(lambda: model(tokens, doc_ids), list(model.parameters())))
        out[name] = (total[1] - total[0]) / seq_len
    return out


def _fmt(v, spec=",.0f") -> str:
    return "–" if v is None else format(v, spec)


def _print_kernel_model(rows: list[dict], tier: str, device_name: str) -> None:
    print(f"\nresonance scan kernel, tier {tier}, bf16 in/out, fp32 state; bytes per layer, fwd + bwd "
          f"({device_name} launch plan; time = bytes / 3 TB/s):")
    for r in rows:
        print(f"  T={r['seq_len']:,}: chunk {r['chunk']}, {r['n_chunks']} chunks, {r['threads']:,} threads; "
              f"{r['layer_bytes'] / 1e6:,.1f} MB per layer, {r['step_ms_at_3tbs']:.2f} ms per step")
        for p in r["passes"]:
            print(f"    {p['pass']:<10} read {p['read'] / 1e6:9.2f} MB  written {p['written'] / 1e6:9.2f} MB  "
                  f"{p['us_at_3tbs']:8.1f} us  ({p['steps']:,} dependent steps a thread)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/mixer.py", description=__doc__.splitlines()[0])
    p.add_argument("--tier", default=None, help="default B (--smoke: nano rows and saved bytes, B's kernel model)")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768, 65536, 131072, 262144])
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=5, help="timed training steps per length (after one warm-up)")
    p.add_argument("--gen-tokens", type=int, default=64, help="timed decode steps per length")
    p.add_argument("--gen-batch-sizes", type=int, nargs="*", default=[1, 64],
                   help="decode tokens/s also at these batch sizes (prompt: the row length minus --gen-tokens)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--doc-masking", action="store_true", help="rows of 4 documents, masked (default: one document)")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="compile every block as the engine does (auto: on CUDA)")
    p.add_argument("--mixers", nargs="+", choices=MIXERS, default=list(MIXERS), help="the families to run")
    p.add_argument("--activation-checkpointing", default="none",
                   help="none | all | every_<k> for both families; mixer: the resonance blocks' mixer halves only")
    p.add_argument("--find-max-seq", action="store_true", help="also search the longest row that trains at batch 1 "
                   "(doubling from the shortest --seq-lens)")
    p.add_argument("--saved-seq-len", type=int, default=1024, help="row lengths (this and twice this) of the "
                   "saved-bytes measurement; 0 skips it (on CUDA it compiles five one-layer models)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU, seconds")
    p.add_argument("--out", type=Path, default=None, help="results directory (default bench/results)")
    args = p.parse_args(argv)
    model_tier = args.tier or "B"  # the kernel model's tier; the saved bytes' unless --smoke runs without --tier
    saved_tier = args.tier or ("nano" if args.smoke else "B")
    args.tier = args.tier or "B"
    if args.smoke:
        args.tier, args.seq_lens, args.steps, args.gen_tokens, args.vocab = "nano", [64, 128], 1, 4, 300
        args.gen_batch_sizes = [1, 4]
        args.saved_seq_len = 256  # a multiple of the reference scan's chunk: its own tensors grow with T too
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    args.compile = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")
    if args.find_max_seq and device.type != "cuda":
        p.error("--find-max-seq needs a GPU (a CPU would only stop when the host runs out of memory)")
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()

    rows = [measure(m, args, T, device) for T in args.seq_lens for m in args.mixers]
    start = min(args.seq_lens)  # the search doubles from the shortest row asked for
    max_seq = {m: max_trainable_seq(m, args, device, start) for m in args.mixers} if args.find_max_seq else {}
    kernel_rows = kernel_model(model_tier, [8192, 32768, 131072, 262144], 1, device)
    saved = saved_bytes(saved_tier, args.saved_seq_len, device, args.compile) if args.saved_seq_len else {}

    device_name = device_info().get("gpu", "cpu")
    print(f"tier {args.tier}, batch {args.batch_size}, {'doc-masked' if args.doc_masking else 'one document'}, "
          f"blocks {'compiled' if args.compile else 'eager'}, activation checkpointing {args.activation_checkpointing}, "
          f"{device_name}; load: {load}")
    print(" | ".join(["seq_len", "mixer", "train tok/s", "train GiB", "decode tok/s", "gen GiB", "status"]))
    for r in rows:
        by_batch = ", ".join(f"batch {b}: {v if isinstance(v, str) else format(v, ',.0f')}"
                             for b, v in r.get("decode_tokens_per_s_by_batch", {}).items())
        print(" | ".join([str(r["seq_len"]), r["mixer"], _fmt(r.get("train_tokens_per_s")),
                          _fmt(r.get("train_peak_gib"), ".3f"), _fmt(r.get("decode_tokens_per_s")),
                          _fmt(r.get("gen_peak_gib"), ".3f"), r["status"]]) + (f" | decode {by_batch}" if by_batch else ""))
    ratios = []
    for T in args.seq_lens if len(args.mixers) == 2 else []:
        att, res = (next(r for r in rows if r["seq_len"] == T and r["mixer"] == m) for m in MIXERS)
        if att["status"] == res["status"] == "ok":
            ratio = {"seq_len": T}
            for key in ("train_tokens_per_s", "train_peak_gib", "decode_tokens_per_s", "gen_peak_gib"):
                ratio[key] = res[key] / att[key] if att[key] else math.nan
            ratios.append(ratio)
            print(f"ratio resonance/attention at {T}: train tok/s {ratio['train_tokens_per_s']:.2f}x, "
                  f"train memory {ratio['train_peak_gib']:.2f}x, decode tok/s {ratio['decode_tokens_per_s']:.2f}x, "
                  f"generation memory {ratio['gen_peak_gib']:.2f}x")
        elif att["status"] != res["status"]:
            print(f"at {T}: attention {att['status']}, resonance {res['status']}")
    for m, T in max_seq.items():
        print(f"longest row that trains at batch 1 ({m}): {T:,}")
    _print_kernel_model(kernel_rows, model_tier, device_name if device.type == "cuda" else "H100")
    if saved:
        print(f"\nsaved for backward, bytes per token per layer (tier {saved_tier} width, rows of "
              f"{args.saved_seq_len} and {2 * args.saved_seq_len} tokens, bf16 autocast, blocks "
              f"{'compiled' if args.compile else 'eager'}, {device.type}):")
        for name, value in saved.items():
            print(f"  {name:<34} {value:10,.0f}   {value / saved['attention']:.2f}x attention")
        print(f"  FFT form, its autograd Function / plain autograd: "
              f"{saved['resonance fft'] / saved['resonance fft, plain autograd']:.2f}x")
    name = "mixer" if args.smoke or args.tier == "B" else f"mixer_{args.tier}"
    if args.doc_masking:
        name += "_docmasked"
    if args.activation_checkpointing != "none":
        name += f"_ac-{args.activation_checkpointing}"
    if args.find_max_seq:
        name += "_maxseq"
    if len(args.mixers) == 1:
        name += f"_{args.mixers[0]}"
    path = write_result(name, {"smoke": args.smoke, "load": load, "shapes": {
        "tier": args.tier, "seq_lens": args.seq_lens, "batch": args.batch_size, "vocab": args.vocab,
        "steps": args.steps, "gen_tokens": args.gen_tokens, "gen_batch_sizes": args.gen_batch_sizes,
        "doc_masking": args.doc_masking, "mixers": args.mixers,
        "compiled_blocks": args.compile, "activation_checkpointing": args.activation_checkpointing}, "rows": rows, "ratios": ratios, "max_trainable_seq": max_seq,
        "kernel_model": {"tier": model_tier, "bandwidth": BANDWIDTH, "rows": kernel_rows},
        "saved_bytes_per_token_layer": {"tier": saved_tier, "seq_len": args.saved_seq_len, **saved},
        "command": "python bench/mixer.py " + " ".join(argv if argv is not None else sys.argv[1:])}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
