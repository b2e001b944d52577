"""torch.distributed without Ray: N local worker processes with a process group, or one in this process.

    results = run_workers(fn, 2, arg)     # fn(rank, world_size, arg) in 2 processes (gloo on CPU, NCCL on GPUs)
    with process_group(0, 1):             # a one-worker group here, e.g. FSDP on one GPU in a benchmark
        engine = Engine(cfg.replace({"train.parallel": "fsdp"}), vocab)

The Ray-free engine under a real process group: what the max-batch finder's `--workers N --measure` runs on one
host, what the benchmarks use to measure FSDP on one GPU, and how the tests check DDP against FSDP, exact resume
and resharding in seconds (Ray Train runs the same engine in its workers; tests keep one real Ray Train FSDP run).
Each worker's return value must be JSON (it comes back through a file in a temporary directory).
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import torch


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


@contextlib.contextmanager
def process_group(rank: int, world_size: int, store_path: str | None = None,
                  backend: str | None = None, timeout_s: float | None = None) -> Iterator[None]:
    """A process group over a FileStore (a file every worker opens; no port to pick); on CUDA each worker uses
    the GPU of its rank. timeout_s: how long a collective waits for the other ranks (train.collective_timeout_s;
    None: torch's default). Destroyed on exit."""
    import datetime

    import torch.distributed as dist

    with contextlib.ExitStack() as stack:
        if store_path is None:
            store_path = os.path.join(stack.enter_context(tempfile.TemporaryDirectory()), "store")
        if torch.cuda.is_available():
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.FileStore(store_path, world_size)
        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
        dist.init_process_group(backend or default_backend(), store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _worker(rank: int, world_size: int, store_path: str, out_dir: str, fn: Callable, args: tuple,
            timeout_s: float | None = None) -> None:
    with process_group(rank, world_size, store_path, timeout_s=timeout_s):
        result = fn(rank, world_size, *args)
    Path(out_dir, f"rank_{rank}.json").write_text(json.dumps(result))


def run_workers(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float | None = None) -> list[Any]:
    """Run fn(rank, world_size, *args) in `world_size` fresh processes under one process group; returns the
    workers' results by rank. fn must be importable (a module-level function) and return JSON-able values.
    timeout_s: the process group's collective timeout (process_group)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="longtrain-pg-") as tmp:
        mp.spawn(_worker, args=(world_size, os.path.join(tmp, "store"), tmp, fn, args, timeout_s),
                 nprocs=world_size)
        return [json.loads(Path(tmp, f"rank_{r}.json").read_text()) for r in range(world_size)]
