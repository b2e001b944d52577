"""The max-batch finder: the largest micro-batch (sequences per worker per forward) of a tier at a
sequence length that trains without running out of device memory.

    python -m pipeline.train.max_batch --tier B --seq-len 32768                    # on this machine's device
    python -m pipeline.train.max_batch --tier A --seq-len 4096 --memory-limit-gib 24    # as on a 24 GiB device
    python -m pipeline.train.max_batch --tier nano --seq-len 256 --preset cpu --json max_batch.json
    python -m pipeline.train.max_batch --tier B --seq-len 131072 --model.mixer=resonance   # the resonance family

    from pipeline.train.max_batch import find_max_batch
    found = find_max_batch(cfg, tier="B", seq_len=32768)       # found.max_batch, found.tries

It runs the engine's real `train_step` (forward, backward, optimizer step, as configured: precision,
activation checkpointing, compile, attention) on synthetic rows of the right shape, doubling the batch
from 1 until a step raises torch.OutOfMemoryError, then bisecting between the last size that fit and
the first that did not. After every try the gradients are dropped and memory is returned
(gc + torch.cuda.empty_cache) so one failure does not make the next try fail. A first step at batch 1
allocates the optimizer state, so every measured try sees the steady-state memory of training.

Where the memory limit comes from: `memory_limit_gib` (or train.memory_limit_gib) simulates a device of
that size (pipeline/train/memory_limit.py; CUDA: a capped allocator, CPU: counted tensor storage); without
one, a GPU is searched up to its real capacity and a CPU up to the memory the host has available.
Assumes memory grows with the batch (true for training steps), so the answer is exact to one sequence.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # `python pipeline/train/max_batch.py`: make the project importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from pipeline.config import Config, ConfigError, load_config  # noqa: E402
from pipeline.data.synthetic import synthetic_batches  # noqa: E402

GIB = 2**30


@dataclass
class Try:
    batch_size: int
    fits: bool
    peak_gib: float  # the step's peak memory (GiB); for a failed try, what was live when it failed is unknown: 0
    seconds: float


@dataclass
class MaxBatchResult:
    tier: str
    seq_len: int
    max_batch: int  # 0: not even one sequence fits
    limit_gib: float  # the memory the search was bounded by (GiB)
    simulated: bool  # True when the limit is a simulated device size, False for the real device
    device: str
    upper: int  # the search stopped here even if larger batches fit
    tries: list[Try] = field(default_factory=list)

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.max_batch

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def host_available_gib() -> float:
    """Memory the host can still give (GiB): the CPU 'device' size when no limit is set."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / GIB
    except (ValueError, OSError, AttributeError):
        return 8.0


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def find_max_batch(cfg: Config, *, tier: str | None = None, seq_len: int | None = None,
                   vocab_size: int | None = None, memory_limit_gib: float | None = None, upper: int = 1024,
                   device: torch.device | None = None, verbose: bool = False) -> MaxBatchResult:
    """The largest micro-batch in 1..upper whose training step fits (0 if none).

    tier / seq_len / vocab_size default to cfg's model.tier, data.seq_len and data.vocab_size;
    memory_limit_gib defaults to cfg.train.memory_limit_gib (0 = the real device, or the host's available
    memory on a CPU). Raises ConfigError for an impossible tier/seq_len combination.
    """
    from pipeline.train.engine import Engine
    from pipeline.train.hardware import default_device

    if upper < 1:
        raise ConfigError(f"max-batch upper bound must be >= 1, got {upper}")
    device = device or default_device()
    limit = cfg.train.memory_limit_gib if memory_limit_gib is None else memory_limit_gib
    simulated = limit > 0
    if not simulated and device.type != "cuda":
        limit = host_available_gib()  # the counting limit is what makes a CPU search end at all
    elif not simulated:
        limit = torch.cuda.get_device_properties(device).total_memory / GIB
    cfg = cfg.replace({"model.tier": tier or cfg.model.tier, "data.seq_len": seq_len or cfg.data.seq_len,
                       "train.grad_accum": 1, "train.max_bad_steps": 1_000_000,
                       "train.memory_limit_gib": limit if (simulated or device.type != "cuda") else 0.0})
    vocab = vocab_size or cfg.data.vocab_size
    result = MaxBatchResult(cfg.model.tier, cfg.data.seq_len, 0, round(limit, 4), simulated, str(device), upper)
    engine = Engine(cfg, vocab, device)

    def step(bs: int) -> tuple[bool, float]:
        batch = next(synthetic_batches(n_sequences=bs, seq_len=cfg.data.seq_len, vocab_size=vocab, batch_size=bs,
                                       seed=cfg.train.seed))
        if engine.memory_limit is not None:
            engine.memory_limit.reset_peak()
        elif device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            engine.train_step([batch])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            ok = True
        except (torch.OutOfMemoryError, MemoryError):
            ok = False
        finally:
            del batch
            engine.optimizer.zero_grad(set_to_none=True)
            _free_memory(device)
        if not ok:
            return False, 0.0
        if engine.memory_limit is not None:
            return True, engine.memory_limit.peak_gib()
        return True, torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else 0.0

    def fits(bs: int) -> bool:
        t0 = time.perf_counter()
        ok, peak = step(bs)
        result.tries.append(Try(bs, ok, round(peak, 6), round(time.perf_counter() - t0, 3)))
        if verbose:
            print(f"  batch {bs:>5}: {'fits' if ok else 'OOM '}  peak {peak:.3f} GiB", flush=True)
        return ok

    try:
        if not step(1)[0]:  # allocates the optimizer state; not a measured try
            return result
        if not fits(1):
            return result
        lo = 1  # fits
        while lo * 2 <= upper and fits(lo * 2):
            lo *= 2
        hi = min(lo * 2, upper + 1)  # does not fit, or is past the bound
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        result.max_batch = lo
        return result
    finally:
        del engine
        _free_memory(device)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.train.max_batch", description=__doc__.split("\n")[0])
    p.add_argument("--tier", help="model tier (default: the preset's model.tier)")
    p.add_argument("--seq-len", type=int, help="tokens per row (default: the preset's data.seq_len)")
    p.add_argument("--preset", help="cpu | gpu | test | a YAML preset (default: by hardware)")
    p.add_argument("--vocab-size", type=int, help="default: the preset's data.vocab_size")
    p.add_argument("--memory-limit-gib", type=float, help="simulate a device of this size (default: the real one)")
    p.add_argument("--max", type=int, default=1024, dest="upper", help="largest batch to try (default 1024)")
    p.add_argument("--json", help="also write the result here")
    args, rest = p.parse_known_args(argv)
    try:
        cfg = load_config(args.preset, rest)
        print(f"max-batch search: {cfg.model.mixer} tier {args.tier or cfg.model.tier}, seq_len {args.seq_len or cfg.data.seq_len}")
        found = find_max_batch(cfg, tier=args.tier, seq_len=args.seq_len, vocab_size=args.vocab_size,
                               memory_limit_gib=args.memory_limit_gib, upper=args.upper, verbose=True)
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    kind = "simulated" if found.simulated else "available"
    print(f"largest micro-batch that fits: {found.max_batch} (tier {found.tier}, seq_len {found.seq_len}, "
          f"{found.limit_gib:.2f} GiB {kind} on {found.device}"
          f"{', search capped at --max' if found.max_batch == found.upper else ''})")
    if args.json:
        Path(args.json).write_text(found.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
