"""The max-batch finder: the largest micro-batch (sequences per worker per forward) of a tier at a
sequence length that trains without running out of device memory -- measured on this machine, or planned from
the memory model for any GPU size and worker count.

    python -m pipeline.train.max_batch --tier B --seq-len 32768                    # on this machine's device
    python -m pipeline.train.max_batch --tier A --seq-len 4096 --memory-limit-gib 24    # as on a 24 GiB device
    python -m pipeline.train.max_batch --tier nano --seq-len 256 --preset cpu --json max_batch.json
    python -m pipeline.train.max_batch --tier B --seq-len 131072 --model.mixer=resonance   # the resonance family
    python -m pipeline.train.max_batch --tier F --seq-len 32768 --workers 8 --memory-limit-gib 80   # the plan
    python -m pipeline.train.max_batch --tier E --seq-len 32768 --workers 8 --measure    # plan, then run it here
    python -m pipeline.train.max_batch --tier D E F --seq-len 32768 --workers 1 8 64 --memory-limit-gib 80  # table
    python -m pipeline.train.max_batch --tier B --seq-len 131072 --workers 8 --memory-limit-gib 80   # which degree
    python -m pipeline.train.max_batch --tier B --seq-len 131072 --workers 8 --memory-limit-gib 80 \
        --train.context_parallel_degree=4                                         # the plan at that degree

The plan (--workers N): pipeline/train/memory/plan.py's model of one worker's peak (parameters, gradients and
AdamW state divided by N under FSDP, the FSDP working set, activations, the loss head) for DDP and FSDP under
every activation-checkpointing setting, the largest micro-batch of each, and the choice: the least recompute
that fits one sequence, DDP before FSDP. It runs nothing, so it answers for 64 GPUs on a laptop; --device
(default cuda) and --memory-limit-gib say what the workers have. It plans at train.context_parallel_degree (each
row split over that many of the N workers; 1 unless set); when the row does not fit there, or the tier's
max_seq_len cannot hold it on one worker, it also names the smallest degree at which it fits, with its flags. --measure then trains that choice for two
steps on N local processes (NCCL on N GPUs, gloo on CPU with tensors counted) and prints each worker's
measured peak beside the model's.

    from pipeline.train.max_batch import find_max_batch
    found = find_max_batch(cfg, tier="B", seq_len=32768)       # found.max_batch, found.tries

It runs the engine's real `train_step` (forward, backward, optimizer step, as configured: precision,
activation checkpointing, compile, attention) on synthetic rows of the right shape, doubling the batch
from 1 until a step raises torch.OutOfMemoryError, then bisecting between the last size that fit and
the first that did not. After every try the gradients are dropped and memory is returned
(gc + torch.cuda.empty_cache) so one failure does not make the next try fail. A first step at batch 1
allocates the optimizer state, so every measured try sees the steady-state memory of training.

Where the memory limit comes from: `memory_limit_gib` (or train.memory_limit_gib) simulates a device of
that size (pipeline/train/memory/limit.py; CUDA: a capped allocator, CPU: counted tensor storage); without
one, a GPU is searched up to its real capacity and a CPU up to the memory the host has available.
Assumes memory grows with the batch (true for training steps), so the answer is exact to one sequence.

Progress and the time bound: each probe prints a line as it starts and as it ends. On a CPU (where the finder is
not at home: one step of tier B at 32k takes minutes) the command line stops after --max-seconds (default
CPU_MAX_SECONDS; none on a GPU): no probe starts past it, and one still running a grace later ends the process
with what the tries so far say (a lower bound, or one error line when nothing was measured).
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # `python pipeline/train/max_batch.py`: make the project importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from pipeline.config import Config, ConfigError, load_config, parse_overrides  # noqa: E402
from pipeline.data.synthetic import synthetic_batches  # noqa: E402
from pipeline.train.memory.hardware import host_available_gib  # noqa: E402

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
    model_max_batch: int = -1  # what the memory model (pipeline/train/memory/plan.py) predicts for the same limit
    out_of_time: bool = False  # the search stopped at max_seconds: max_batch is a lower bound

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.max_batch

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def find_max_batch(cfg: Config, *, tier: str | None = None, seq_len: int | None = None,
                   vocab_size: int | None = None, memory_limit_gib: float | None = None, upper: int = 1024,
                   device: torch.device | None = None, verbose: bool = False, max_seconds: float = 0.0,
                   tries: list[Try] | None = None) -> MaxBatchResult:
    """The largest micro-batch in 1..upper whose training step fits (0 if none).

    tier / seq_len / vocab_size default to cfg's model.tier, data.seq_len and data.vocab_size;
    memory_limit_gib defaults to cfg.train.memory_limit_gib (0 = the real device, or the host's available
    memory on a CPU). verbose: a line as each probe starts and one as it ends. max_seconds > 0: no probe starts
    after this many seconds from the call (result.out_of_time; max_batch is then the largest size that fit so
    far). tries: a list the tries are appended to as they end (result.tries is it), for a caller that reports
    them while the search runs. Raises ConfigError for an impossible tier/seq_len combination.
    """
    from pipeline.train.engine import Engine
    from pipeline.train.memory.hardware import default_device

    if upper < 1:
        raise ConfigError(f"max-batch upper bound must be >= 1, got {upper}")
    if cfg.train.context_parallel_degree > 1:
        raise ConfigError(f"the measured search runs one process, and train.context_parallel_degree="
                          f"{cfg.train.context_parallel_degree} splits each row over several: plan it with --workers N "
                          f"(a multiple of the degree), and add --measure to run the plan's choice on N processes")
    if cfg.train.expert_parallel_degree > 1:
        raise ConfigError(f"the measured search runs one process, and train.expert_parallel_degree="
                          f"{cfg.train.expert_parallel_degree} splits the experts over several: plan it with --workers "
                          f"N (a multiple of the degree), and add --measure to run the plan's choice on N processes")
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
    t_start = time.monotonic()
    result = MaxBatchResult(cfg.model.tier, cfg.data.seq_len, 0, round(limit, 4), simulated, str(device), upper)
    if tries is not None:
        result.tries = tries
    from pipeline.train.memory.plan import max_batch_by_model, usable_bytes

    result.model_max_batch = max_batch_by_model(cfg, vocab, limit_bytes=usable_bytes(limit, device.type),
                                                upper=upper, device_type=device.type)[0]
    if verbose:
        print(f"  the memory model predicts {result.model_max_batch} (pipeline/train/memory/plan.py); measuring: one "
              f"training step per probe", flush=True)
    engine = Engine(cfg, vocab, device, parallel="none")

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
        if verbose:
            print(f"  batch {bs:>5}: training step ...", flush=True)
        t0 = time.perf_counter()
        ok, peak = step(bs)
        seconds = time.perf_counter() - t0
        result.tries.append(Try(bs, ok, round(peak, 6), round(seconds, 3)))
        if verbose:
            print(f"  batch {bs:>5}: {'fits' if ok else 'OOM '}  peak {peak:.3f} GiB  ({seconds:.1f} s)", flush=True)
        return ok

    def out_of_time() -> bool:
        result.out_of_time = max_seconds > 0 and time.monotonic() - t_start >= max_seconds
        return result.out_of_time

    try:
        if verbose:
            print("  batch     1: first step (creates the optimizer state; not measured) ...", flush=True)
        if not step(1)[0]:  # allocates the optimizer state; not a measured try
            return result
        if out_of_time() or not fits(1):
            return result
        lo = 1  # fits
        while lo * 2 <= upper and not out_of_time() and fits(lo * 2):
            lo *= 2
        hi = min(lo * 2, upper + 1)  # does not fit, or is past the bound
        while hi - lo > 1 and not out_of_time():
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


# ------------------------------------------------------------------------------------------ the plan
def _measure_worker(rank: int, world: int, flat: dict, vocab_size: int, parallel: str, steps: int) -> int:
    """One worker of --measure: `steps` training steps at the configured micro-batch; its peak bytes."""
    from pipeline.config import from_flat
    from pipeline.train.engine import Engine
    from pipeline.train.memory.hardware import default_device

    cfg = from_flat(flat)
    device = default_device()
    if device.type == "cpu":  # count every tensor, with room to spare: the measurement must not stop at a limit
        cfg = cfg.replace({"train.memory_limit_gib": max(1.0, host_available_gib())})
    mode = parallel if (world > 1 or parallel == "fsdp") else "none"
    engine = Engine(cfg, vocab_size, device, rank=rank, world_size=world, parallel=mode)
    b = cfg.train.batch_size
    for i in range(steps):  # the first step creates AdamW's state; the last is the steady state
        batch = next(synthetic_batches(n_sequences=b, seq_len=cfg.data.seq_len, vocab_size=vocab_size, batch_size=b,
                                       seed=cfg.train.seed + engine.mesh.data_rank + i))  # a context group: same rows
        if engine.memory_limit is not None:
            engine.memory_limit.reset_peak()
        elif device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        engine.train_step([batch])
    if engine.memory_limit is not None:
        return int(engine.memory_limit.peak_bytes)
    return int(torch.cuda.max_memory_allocated(device))


def measure_peaks(cfg: Config, vocab_size: int, workers: int, parallel: str, steps: int = 2) -> list[int]:
    """Each worker's peak bytes over `steps` steps of cfg (its micro-batch and checkpointing) on `workers` local
    processes (pipeline/train/distributed/process_group.py)."""
    from pipeline.train.distributed.process_group import run_workers

    return run_workers(_measure_worker, workers, cfg.flat(), vocab_size, parallel, steps)


def print_plan(p, cfg: Config) -> None:
    from pipeline.console import size_text

    dev = ("CUDA, " + ("fp32" if cfg.train.precision == "fp32" else "bf16") +
           (", compiled blocks" if cfg.model.compile != "off" else "") if p.device_type == "cuda" else "CPU, fp32")
    room = (f"{p.limit_gib:g} GiB each, {size_text(p.usable_bytes)} usable" if p.device_type == "cuda"
            else f"{p.limit_gib:g} GiB each")
    split = f", data {p.workers // p.context} x context {p.context}" if p.context > 1 else ""
    print(f"memory plan (the memory model, pipeline/train/memory/plan.py; not a measurement): {p.mixer} tier {p.tier}, "
          f"seq_len {p.seq_len:,}, vocab {p.vocab_size:,}, {p.workers} worker(s) x {room}{split} ({dev})")
    print(f"  {'parallel':<9}{'checkpointing':<15}{'max micro-batch':>16}  peak per worker")
    for r in p.rows:
        at = f"{size_text(r.peak_bytes)}" + ("" if r.max_batch else " at batch 1")
        print(f"  {r.parallel:<9}{r.activation_checkpointing:<15}{r.max_batch:>16}  {at}")
    if p.choice is None:
        worst = min(p.rows, key=lambda r: r.peak_bytes)
        print(f"fits: no -- even {worst.parallel} with activation checkpointing {worst.activation_checkpointing} needs "
              f"{size_text(worst.peak_bytes)} per worker at batch 1; add workers, shorten data.seq_len or pick a "
              f"smaller tier")
        return
    c, parts = p.choice, p.choice.estimate.parts()
    cp = f"--train.context_parallel_degree={p.context} " if p.context > 1 else ""
    print(f"fits: yes -- {cp}--train.parallel={c.parallel} --model.activation_checkpointing={c.activation_checkpointing} "
          f"--train.batch_size={c.max_batch} ({size_text(c.peak_bytes)} of {size_text(p.usable_bytes)} per worker: "
          + ", ".join(f"{k} {size_text(v * GIB)}" for k, v in parts.items() if k != "total" and v > 0)
          + f"; the peak is at {c.estimate.moment})")


def plan_main(args, rest: list[str]) -> int:
    from pipeline.config import default_preset
    from pipeline.train.memory.plan import MAX_CONTEXT_DEGREE, plan, size_text

    device_type = args.device or "cuda"
    preset = args.preset or ("gpu" if device_type == "cuda" else default_preset())
    # the plan's workers are the config's (train.context_parallel_degree must divide them)
    over = {**parse_overrides(rest), "ray.num_workers": max(args.workers or [1])}
    over.update({k: v for k, v in (("model.tier", args.tier[0] if args.tier else None),
                                   ("data.seq_len", args.seq_len)) if v})
    too_long = None
    try:
        cfg = load_config(preset, over)
    except ConfigError as exc:  # a row longer than one worker holds: plan the smallest degree that takes it (below)
        if "data.seq_len" not in str(exc) or len(args.workers) > 1 or len(args.tier or []) > 1:
            raise
        too_long = str(exc)
        cfg = load_config(preset, {k: v for k, v in over.items() if k != "data.seq_len"})
    seq_len = over.get("data.seq_len", cfg.data.seq_len)
    vocab = args.vocab_size or cfg.data.vocab_size
    limit = args.memory_limit_gib
    if limit is None:
        if device_type != "cuda" or not torch.cuda.is_available():
            raise ConfigError("a plan needs the memory of one worker: pass --memory-limit-gib (e.g. 80 for an 80 GB "
                              "GPU)")
        limit = torch.cuda.get_device_properties(0).total_memory / GIB
    if min(args.workers) < 1:
        raise ConfigError(f"--workers {' '.join(map(str, args.workers))}: every count must be at least 1")
    if len(args.workers) > 1 or len(args.tier or []) > 1:  # the fit table
        from pipeline.train.memory.plan import fit_table

        print(f"fit table (the memory model, not a measurement): {cfg.model.mixer}, seq_len {cfg.data.seq_len:,}, "
              f"vocab {vocab:,}, {device_type}; each cell: train.parallel, activation checkpointing, micro-batch "
              f"(peak per worker)")
        print(fit_table(cfg, vocab, args.tier or [cfg.model.tier], args.workers, limit_gib=limit,
                        device_type=device_type))
        return 0
    from pipeline.train.memory.plan import smallest_context_degree

    p = None
    if too_long is None:
        p = plan(cfg, vocab, workers=args.workers[0], limit_gib=limit, device_type=device_type, upper=args.upper)
        print_plan(p, cfg)
    else:
        print(f"memory plan: {too_long.split('; a longer row')[0]} on one worker")
    result = {"plan": p.to_dict() if p is not None else None}
    if p is None or not p.fits:
        q = smallest_context_degree(cfg, vocab, limit_gib=limit, device_type=device_type, workers=args.workers[0],
                                    seq_len=seq_len, upper=args.upper)
        result["smallest_context_degree"] = q.to_dict() if q is not None else None
        if q is None:
            print(f"context parallelism: it does not fit at any degree up to {MAX_CONTEXT_DEGREE} either")
        else:
            c = q.choice
            print(f"context parallelism: the smallest degree that fits is {q.context} (each row split over {q.context} "
                  f"workers, {q.workers} in all): --train.context_parallel_degree={q.context} --ray.num_workers="
                  f"{q.workers} --train.parallel={c.parallel} --model.activation_checkpointing="
                  f"{c.activation_checkpointing} --train.batch_size={c.max_batch} ({size_text(c.peak_bytes)} per "
                  f"worker)")
        if p is not None:  # a MoE tier: also the smallest expert-parallel degree that fits
            result["smallest_expert_degree"] = _print_expert_degree(cfg, vocab, args.workers[0], limit, device_type,
                                                                    args.upper)
        p = p if p is not None and p.fits else None
    if args.measure and p is not None and p.choice is not None:
        from pipeline.train.memory.hardware import default_device

        if default_device().type != device_type:
            raise ConfigError(f"--measure runs the plan on this machine, which has no {device_type} device; "
                              f"plan with --device {default_device().type}")
        c = p.choice
        run_cfg = cfg.replace({"train.batch_size": c.max_batch, "model.activation_checkpointing":
                               c.activation_checkpointing, "train.parallel": c.parallel, "train.grad_accum": 1,
                               "data.vocab_size": vocab})
        print(f"measuring: 2 steps on {args.workers[0]} local worker(s) ...", flush=True)
        peaks = measure_peaks(run_cfg, vocab, args.workers[0], c.parallel)
        print(f"measured peak per worker: {', '.join(size_text(b) for b in peaks)}; the model said "
              f"{size_text(c.peak_bytes)} ({max(peaks) / c.peak_bytes:.3f} of it); "
              f"{'within' if max(peaks) <= p.usable_bytes else 'ABOVE'} the {size_text(p.usable_bytes)} usable")
        result["measured_peak_bytes"] = peaks
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def _print_expert_degree(cfg: Config, vocab: int, workers: int, limit: float, device_type: str, upper: int):
    """A MoE tier that does not fit: the smallest expert-parallel degree at which it does (plan.py), as a line."""
    from pipeline.config import model_tier
    from pipeline.console import size_text
    from pipeline.train.memory.plan import smallest_expert_degree

    if model_tier(cfg).moe is None:
        return None
    q = smallest_expert_degree(cfg, vocab, workers=workers, limit_gib=limit, device_type=device_type, upper=upper)
    if q is None:
        print(f"expert parallelism: it does not fit at any degree dividing both the experts and the {workers} "
              f"worker(s) either")
        return None
    c = q.choice
    print(f"expert parallelism: the smallest degree that fits is {q.expert_degree} (each MoE layer's experts split "
          f"over {q.expert_degree} workers): --train.expert_parallel_degree={q.expert_degree} --train.parallel="
          f"{c.parallel} --model.activation_checkpointing={c.activation_checkpointing} --train.batch_size="
          f"{c.max_batch} ({size_text(c.peak_bytes)} per worker)")
    return q.to_dict()


CPU_MAX_SECONDS = 300.0  # the measured search's default time bound on a CPU (--max-seconds)


def _nothing_measured(budget: float, tier: str, seq_len: int) -> str:
    return (f"the max-batch search measured nothing within --max-seconds {budget:g} (the first training steps of "
            f"tier {tier} at seq_len {seq_len} did not end in time on this device); run it on a GPU, raise "
            f"--max-seconds, or ask the memory model: python -m pipeline.train.max_batch --tier {tier} --seq-len "
            f"{seq_len} --workers 1 --device cuda --memory-limit-gib 80 (an 80 GiB GPU)")


def _watchdog(budget: float, tries: list[Try], tier: str, seq_len: int) -> "threading.Timer":
    """The bound on a probe in flight at the deadline: find_max_batch starts no probe after it, but one training
    step at batch 1 on a CPU can itself take many minutes, and a step in C++ cannot be interrupted. At the deadline
    (plus a grace of 10% of it, at least 5 s) this prints what the tries so far say and ends the process."""
    import os
    import threading

    def fire() -> None:
        fit = max((t.batch_size for t in tries if t.fits), default=0)
        if fit == 0:
            print(f"error: {_nothing_measured(budget, tier, seq_len)}", file=sys.stderr, flush=True)
            os._exit(1)
        print(f"largest micro-batch that fits: at least {fit} (the search stopped at --max-seconds {budget:g} during "
              f"a probe: a lower bound)", flush=True)
        os._exit(0)

    timer = threading.Timer(budget + max(5.0, budget / 10), fire)
    timer.daemon = True
    timer.start()
    return timer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.train.max_batch", description=__doc__.split("\n")[0])
    p.add_argument("--tier", nargs="+", help="model tier (default: the preset's model.tier); with --workers, "
                                             "several tiers print the fit table")
    p.add_argument("--seq-len", type=int, help="tokens per row (default: the preset's data.seq_len)")
    p.add_argument("--preset", help="cpu | gpu | test | a YAML preset (default: by hardware; gpu for a CUDA plan)")
    p.add_argument("--vocab-size", type=int, help="default: the preset's data.vocab_size")
    p.add_argument("--memory-limit-gib", type=float, help="simulate a device of this size (default: the real one); "
                                                         "with --workers: each worker's memory")
    p.add_argument("--max", type=int, default=1024, dest="upper", help="largest batch to try (default 1024)")
    p.add_argument("--workers", type=int, nargs="+", help="plan for this many workers from the memory model (runs "
                                                           "nothing); several counts print the fit table")
    p.add_argument("--device", choices=("cuda", "cpu"), help="with --workers: the workers' device (default cuda)")
    p.add_argument("--measure", action="store_true", help="with --workers: then train the plan's choice for two "
                                                          "steps on that many local processes and print the peaks")
    p.add_argument("--max-seconds", type=float, help=f"stop the measured search after this many seconds (default: "
                                                      f"{CPU_MAX_SECONDS:g} on a CPU, none on a GPU; 0 = none): the "
                                                      f"largest size that fit by then is a lower bound")
    p.add_argument("--json", help="also write the result here")
    args, rest = p.parse_known_args(argv)
    try:
        if args.workers is not None:
            return plan_main(args, rest)
        if args.measure or args.device:
            raise ConfigError("--measure and --device go with --workers N (the plan)")
        if args.tier and len(args.tier) > 1:
            raise ConfigError("several --tier values print the fit table, which needs --workers")
        if args.max_seconds is not None and args.max_seconds < 0:
            raise ConfigError(f"--max-seconds {args.max_seconds:g}: give seconds > 0, or 0 for no bound")
        tier = args.tier[0] if args.tier else None
        cfg = load_config(args.preset, rest)
        print(f"max-batch search: {cfg.model.mixer} tier {tier or cfg.model.tier}, "
              f"seq_len {args.seq_len or cfg.data.seq_len}", flush=True)
        from pipeline.train.memory.hardware import default_device

        on_cpu = default_device().type != "cuda"
        budget = args.max_seconds if args.max_seconds is not None else (CPU_MAX_SECONDS if on_cpu else 0.0)
        seq = args.seq_len or cfg.data.seq_len
        if on_cpu:
            print(f"note: no GPU here: the finder is meant for one; each probe is a real training step on the CPU "
                  f"(minutes each for a large tier or a long seq_len), and the search stops after "
                  f"{f'--max-seconds {budget:g}' if budget else 'no time bound (--max-seconds 0)'}. The memory model "
                  f"answers at once: python -m pipeline.train.max_batch --tier {tier or cfg.model.tier} --seq-len "
                  f"{seq} --workers 1 --device cuda --memory-limit-gib 80 (an 80 GiB GPU)", flush=True)
        tries: list[Try] = []
        watchdog = _watchdog(budget, tries, tier or cfg.model.tier, seq) if budget else None
        try:
            found = find_max_batch(cfg, tier=tier, seq_len=args.seq_len, vocab_size=args.vocab_size,
                                   memory_limit_gib=args.memory_limit_gib, upper=args.upper, verbose=True,
                                   max_seconds=budget, tries=tries)
        finally:
            if watchdog is not None:
                watchdog.cancel()
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    kind = "simulated" if found.simulated else "available"
    if found.out_of_time and found.max_batch == 0:
        print(f"error: {_nothing_measured(budget, tier or cfg.model.tier, found.seq_len)}", file=sys.stderr)
        return 1
    capped = ", search capped at --max" if found.max_batch == found.upper else ""
    if found.out_of_time:
        capped = f", the search stopped at --max-seconds {budget:g}: a lower bound"
    print(f"largest micro-batch that fits: {'at least ' if found.out_of_time else ''}{found.max_batch} (tier "
          f"{found.tier}, seq_len {found.seq_len}, {found.limit_gib:.2f} GiB {kind} on {found.device}{capped}); the "
          f"memory model says {found.model_max_batch}")
    if args.json:
        Path(args.json).write_text(found.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
