"""A device of a chosen size: `train.memory_limit_gib` makes a training step fail with the real
`torch.OutOfMemoryError` once it needs more memory than that, on a GPU or on the CPU.

    cap = MemoryLimit.for_device(limit_gib=0.05, device=torch.device("cpu"))
    with cap.during(engine.module, engine.optimizer):      # what one train_step allocates is counted
        engine.train_step([batch])                           # raises torch.OutOfMemoryError above 0.05 GiB
    cap.peak_gib()                                           # the most memory live at once so far

Why: the max-batch finder (pipeline/train/max_batch.py) and the batch-size sweep must see out-of-memory
failures where they would happen on a smaller device, and tests must see them on a CPU-only machine.

CUDA: the caching allocator itself is capped (`torch.cuda.set_per_process_memory_fraction`), so the
OOM comes from the allocator exactly as on a device of that size, fragmentation included.

CPU: torch keeps no allocation counter, so every tensor an operator creates during the step is seen
through a TorchDispatchMode (below autograd, so the backward pass's tensors are seen too; under FSDP also the
all-gathered parameters and reduce-scatter buffers, and a sharded tensor counts its local shard). Each distinct
storage counts its bytes while it is alive (a weak reference tells when it is freed); the parameters,
their gradients and the optimizer state that exist when the step starts count from the start. When the
live total would exceed the limit the mode raises torch.OutOfMemoryError, like the allocator would.
Freed storages are swept only when the total reaches a new high, so the peak is exact and the
bookkeeping stays cheap (most allocations happen below an earlier peak).
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from pipeline.console import size_text

GIB = 2**30


def _oom(needed: int, limit: int, device: str) -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError(
        f"{device} out of memory: {size_text(needed)} would be live on a simulated {size_text(limit)} device "
        f"(train.memory_limit_gib); lower train.batch_size or data.seq_len, or raise the limit")


class _LiveStorages:
    """Bytes of the storages alive on one device, keyed by the storage's identity."""

    def __init__(self) -> None:
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}
        self.total = 0

    def add(self, t: torch.Tensor) -> bool:
        """Count t's storage if it is not counted yet; True if the total grew. A DTensor (FSDP's sharded
        parameters, gradients and optimizer state) counts its local shard."""
        t = getattr(t, "_local_tensor", t)
        storage = t.untyped_storage()
        ref = StorageWeakRef(storage)
        old = self.refs.get(ref.cdata)
        if old is not None and not old[0].expired():
            return False
        if old is not None:  # a new storage at a freed one's address
            self.total -= old[1]
        nbytes = storage.nbytes()
        self.refs[ref.cdata] = (ref, nbytes)
        self.total += nbytes
        return True

    def sweep(self) -> None:
        """Forget the storages freed since the last sweep."""
        dead = [k for k, (ref, _) in self.refs.items() if ref.expired()]
        for k in dead:
            self.total -= self.refs.pop(k)[1]


class _CountingMode(TorchDispatchMode):
    def __init__(self, limit: "MemoryLimit", live: _LiveStorages, device_type: str):
        super().__init__()
        self.limit, self.live, self.device_type = limit, live, device_type

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == self.device_type and self.live.add(t):
                self.limit._check(self.live)
        return out


class MemoryLimit:
    """Caps what a training step may allocate at `limit_gib` and measures the peak.

    Use `MemoryLimit.for_device(limit_gib, device)`; it returns None when limit_gib is 0 (no cap).
    """

    def __init__(self, limit_gib: float, device: torch.device):
        if not limit_gib > 0:
            raise ValueError(f"memory limit must be > 0 GiB, got {limit_gib}")
        self.limit_bytes = int(limit_gib * GIB)
        self.device = device
        self.peak_bytes = 0
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            # The allocator refuses to reserve beyond this fraction: a real OOM at the limit.
            torch.cuda.set_per_process_memory_fraction(min(1.0, self.limit_bytes / total), device)

    @classmethod
    def for_device(cls, limit_gib: float, device: torch.device) -> "MemoryLimit | None":
        return cls(limit_gib, device) if limit_gib > 0 else None

    def _check(self, live: _LiveStorages) -> None:
        if live.total > self.peak_bytes:
            live.sweep()  # only at a new high: the total must be exact before it is a peak or an OOM
            if live.total > self.limit_bytes:
                raise _oom(live.total, self.limit_bytes, self.device.type)
            self.peak_bytes = max(self.peak_bytes, live.total)

    @contextlib.contextmanager
    def during(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Iterator[None]:
        """Count (CPU) or cap (CUDA) the memory used inside the block; module and optimizer state that
        exist on entry count from the start."""
        if self.device.type == "cuda":
            yield  # the allocator enforces the fraction; peak comes from torch.cuda's counters
            self.peak_bytes = max(self.peak_bytes, torch.cuda.max_memory_allocated(self.device))
            return
        live = _LiveStorages()
        for t in _resident_tensors(module, optimizer):
            if t.device.type == self.device.type:
                live.add(t)
        self._check(live)
        with _CountingMode(self, live, self.device.type):
            yield

    def reset_peak(self) -> None:
        self.peak_bytes = 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_gib(self) -> float:
        """The most memory live at once inside `during` blocks so far (GiB)."""
        if self.device.type == "cuda":
            return max(self.peak_bytes, torch.cuda.max_memory_allocated(self.device)) / GIB
        return self.peak_bytes / GIB


def _resident_tensors(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> Iterable[torch.Tensor]:
    """Parameters, buffers, gradients and optimizer state: what occupies the device between steps."""
    for p in module.parameters():
        yield p
        if p.grad is not None:
            yield p.grad
    yield from module.buffers()
    if optimizer is not None:
        for state in optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))
