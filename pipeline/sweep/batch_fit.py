"""The largest micro-batch of each tier in a sweep, found before any trial runs (`skip_unfit_batch: true`): the
max-batch finder's measured search for one-worker trials (pipeline/train/max_batch.py), the memory model's plan for
trials of several workers (pipeline/train/memory/plan.py), each in a Ray task on a trial worker's resources.

    max_fit = max_fit_per_tier(cfg, space, manifest.vocab_size)    # {"nano": 64, "A": 16}
"""
from __future__ import annotations

from typing import Any

from pipeline.config import Config, from_flat
from pipeline.sweep.space import Space


def _plan_fit(flat: dict[str, Any], tier: str, vocab_size: int, upper: int) -> tuple[str, int, str]:
    """(tier, largest micro-batch, how) for a trial of ray.num_workers > 1 workers, from the memory model
    (pipeline/train/memory/plan.py) with this process's device, as the trial's workers will resolve
    train.parallel and use model.activation_checkpointing."""
    from pipeline.train.memory.hardware import default_device
    from pipeline.train.memory.plan import choose_parallel, max_batch_by_model, usable_bytes
    from pipeline.train.distributed.parallel import device_memory_gib

    cfg = from_flat(flat).replace({"model.tier": tier})
    device, workers = default_device(), cfg.ray.num_workers
    limit = device_memory_gib(cfg, device)
    mode = cfg.train.parallel
    if mode == "auto":
        mode = choose_parallel(cfg, vocab_size, workers=workers, limit_gib=limit, device_type=device.type)[0]
    b, est = max_batch_by_model(cfg, vocab_size, limit_bytes=usable_bytes(limit, device.type), upper=upper,
                                workers=workers, parallel=mode, device_type=device.type)
    return tier, b, (f"memory model, {workers} workers, {mode}, activation checkpointing "
                     f"{cfg.model.activation_checkpointing}, {limit:.2f} GiB each")


def max_fit_per_tier(cfg: Config, space: Space, vocab_size: int) -> dict[str, int]:
    """The largest micro-batch per tier in the sweep, each found by a Ray task on a trial worker's resources: the
    max-batch finder's measured search for one-worker trials; for trials of several workers (sharded under FSDP,
    their memory is not one process's to measure) the memory model's plan for that worker count."""
    import ray

    from pipeline.train.max_batch import find_max_batch
    from pipeline.ray_runtime import use_gpu

    upper = max(int(b) for b in space.values_of("train.batch_size", cfg))

    def probe(flat: dict[str, Any], tier: str) -> tuple[str, int, str]:
        if from_flat(flat).ray.num_workers > 1:
            return _plan_fit(flat, tier, vocab_size, upper)
        f = find_max_batch(from_flat(flat), tier=tier, vocab_size=vocab_size, upper=upper)
        return tier, f.max_batch, f"measured, {f.limit_gib:.2f} GiB {'simulated' if f.simulated else 'device'}"

    # max_calls=1: the worker process exits after its probe, so its CUDA context and cached device memory
    # go with it instead of staying in an idle Ray worker beside the trials (.options() cannot set it).
    task = ray.remote(num_cpus=cfg.ray.cpus_per_worker, num_gpus=1 if use_gpu(cfg) else 0, max_calls=1)(probe)
    tiers = [str(t) for t in space.values_of("model.tier", cfg)]
    found = ray.get([task.remote(cfg.flat(), t) for t in tiers])
    for tier, max_batch, how in found:
        print(f"max-batch finder: tier {tier} at seq_len {cfg.data.seq_len}: largest micro-batch {max_batch} ({how})")
    return {tier: max_batch for tier, max_batch, _ in found}
