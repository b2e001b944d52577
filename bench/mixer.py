"""Attention vs resonance mixer, side by side on one device: training and generation tokens/s and peak memory
per sequence length, tier for tier (the same tier name: nearly the same parameter count, `python -m model`).

    python bench/mixer.py                                        # tier B at 8,192 / 32,768 / 131,072 (a GPU)
    python bench/mixer.py --tier nano --seq-lens 1024 4096 --steps 3 --gen-tokens 16   # what a CPU manages
    python bench/mixer.py --find-max-seq                         # also: the longest row that trains at batch 1
    python bench/mixer.py --smoke                                # seconds, on CPU (the test suite runs this)

Training: forward, backward (the fused cross-entropy of cuda_ops, as the engine runs it) and an AdamW step on
random tokens, batch --batch-size, bf16 autocast on CUDA; no document masking unless --doc-masking (attention
then uses flex/varlen as the engine would, resonance the chunked scan instead of the FFT). Generation: a prompt
of seq_len - gen_tokens tokens (prefill, timed apart) then gen_tokens greedy decode steps: the KV cache for
attention, the recurrent state for resonance. Peak memory: torch.cuda.max_memory_allocated on CUDA; on a CPU
every live tensor is counted by pipeline/train/memory_limit.py in a separate, untimed pass. A length that runs
out of memory is recorded as "oom". Ratios printed: resonance / attention (tokens/s; memory).
"""
from __future__ import annotations

import argparse
import gc
import math
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/mixer.py`: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import device_info, write_result
from cuda_ops.cross_entropy import linear_cross_entropy
from model.decoder import build_model
from pipeline.train.memory_limit import MemoryLimit

MIXERS = ("attention", "resonance")
GIB = 2**30


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


class Setup:
    """One model of one family on the device, its optimizer, and random data of one shape."""

    def __init__(self, mixer: str, tier: str, vocab: int, seq_len: int, batch: int, device: torch.device,
                 doc_masking: bool):
        torch.manual_seed(0)
        self.device, self.seq_len, self.batch = device, seq_len, batch
        self.model = build_model(tier, vocab, mixer=mixer, doc_masking=doc_masking).to(device)
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
    def generate(self, n_new: int) -> float:
        """Prefill seq_len - n_new tokens, then n_new greedy steps; returns the decode seconds."""
        self.model.eval()
        prompt = self.tokens[:, : self.seq_len - n_new]
        cache = self.model.new_kv_cache(batch_size=self.batch, max_len=self.seq_len)
        with self.amp:
            h = self.model(prompt, kv_cache=cache)[:, -1]
            nxt = self.model.logits(h).argmax(-1)
            _sync(self.device)
            t0 = time.perf_counter()
            for _ in range(n_new):
                h = self.model(nxt[:, None], kv_cache=cache)[:, -1]
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
    try:
        setup = Setup(mixer, args.tier, args.vocab, seq_len, args.batch_size, device, args.doc_masking)
        row["params"] = setup.model.num_params()
        setup.train_step()  # warm-up: optimizer state, kernels, allocator
        _sync(device)
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
        row["status"] = "ok"
    except torch.OutOfMemoryError as exc:
        row.update(status="oom", reason=str(exc).splitlines()[0][:200])
    finally:
        setup = None
        _free(device)
    return row


def max_trainable_seq(mixer: str, args, device: torch.device, start: int = 8192, limit: int = 2**21) -> int:
    """The longest power-of-two row (from `start`) whose training step fits at batch 1; 0 if none."""
    best, seq = 0, start
    while seq <= limit:
        try:
            setup = Setup(mixer, args.tier, args.vocab, seq, 1, device, args.doc_masking)
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


def _fmt(v, spec=",.0f") -> str:
    return "–" if v is None else format(v, spec)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/mixer.py", description=__doc__.splitlines()[0])
    p.add_argument("--tier", default="B")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768, 131072])
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=5, help="timed training steps per length (after one warm-up)")
    p.add_argument("--gen-tokens", type=int, default=64, help="timed decode steps per length")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--doc-masking", action="store_true", help="rows of 4 documents, masked (default: one document)")
    p.add_argument("--find-max-seq", action="store_true", help="also search the longest row that trains at batch 1")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU, seconds")
    p.add_argument("--out", type=Path, default=None, help="results directory (default bench/results)")
    args = p.parse_args(argv)
    if args.smoke:
        args.tier, args.seq_lens, args.steps, args.gen_tokens, args.vocab = "nano", [64, 128], 1, 4, 300
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.find_max_seq and device.type != "cuda":
        p.error("--find-max-seq needs a GPU (a CPU would only stop when the host runs out of memory)")
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()

    rows = [measure(m, args, T, device) for T in args.seq_lens for m in MIXERS]
    max_seq = {m: max_trainable_seq(m, args, device) for m in MIXERS} if args.find_max_seq else {}

    print(f"tier {args.tier}, batch {args.batch_size}, {'doc-masked' if args.doc_masking else 'one document'}, "
          f"{device_info().get('gpu', 'cpu')}; load: {load}")
    head = ["seq_len", "mixer", "train tok/s", "train GiB", "decode tok/s", "gen GiB", "status"]
    print(" | ".join(head))
    for r in rows:
        print(" | ".join([str(r["seq_len"]), r["mixer"], _fmt(r.get("train_tokens_per_s")),
                          _fmt(r.get("train_peak_gib"), ".3f"), _fmt(r.get("decode_tokens_per_s")),
                          _fmt(r.get("gen_peak_gib"), ".3f"), r["status"]]))
    ratios = []
    for T in args.seq_lens:
        att, res = (next(r for r in rows if r["seq_len"] == T and r["mixer"] == m) for m in MIXERS)
        if att["status"] == res["status"] == "ok":
            ratio = {"seq_len": T}
            for key in ("train_tokens_per_s", "train_peak_gib", "decode_tokens_per_s", "gen_peak_gib"):
                ratio[key] = res[key] / att[key] if att[key] else math.nan
            ratios.append(ratio)
            print(f"ratio resonance/attention at {T}: train tok/s {ratio['train_tokens_per_s']:.2f}x, "
                  f"train memory {ratio['train_peak_gib']:.2f}x, decode tok/s {ratio['decode_tokens_per_s']:.2f}x, "
                  f"generation memory {ratio['gen_peak_gib']:.2f}x")
    for m, T in max_seq.items():
        print(f"longest row that trains at batch 1 ({m}): {T:,}")
    name = "mixer" if args.smoke or args.tier == "B" else f"mixer_{args.tier}"
    path = write_result(name, {"smoke": args.smoke, "load": load, "shapes": {
        "tier": args.tier, "seq_lens": args.seq_lens, "batch": args.batch_size, "vocab": args.vocab,
        "steps": args.steps, "gen_tokens": args.gen_tokens, "doc_masking": args.doc_masking},
        "rows": rows, "ratios": ratios, "max_trainable_seq": max_seq,
        "command": "python bench/mixer.py " + " ".join(argv if argv is not None else sys.argv[1:])}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
