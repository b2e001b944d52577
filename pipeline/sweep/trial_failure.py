"""Which failure a trial met, in one line: out of memory (anywhere in the chain of Ray's wrappers) or anything else,
for the sweep's table and the trial's MLflow tag.

    is_oom(exc)                  # torch.OutOfMemoryError, MemoryError or Ray's OutOfMemoryError inside `exc`
    failure_reason(exc, 90)      # "TypeName: last line of its message", at most 90 characters
"""
from __future__ import annotations


def is_oom(exc: BaseException | None) -> bool:
    """True if `exc` or anything it wraps (Ray task errors, Train worker failures, causes) is an
    out-of-memory error: torch.OutOfMemoryError, MemoryError or Ray's own OutOfMemoryError."""
    import torch

    from pipeline.ray_runtime import find_cause

    return find_cause(exc, lambda e: isinstance(e, (torch.OutOfMemoryError, MemoryError))
                      or type(e).__name__ == "OutOfMemoryError") is not None


def failure_reason(exc: BaseException, limit: int = 90) -> str:
    """One line naming what failed, at most `limit` characters (the table's; MLflow's tag gets 250)."""
    inner = exc
    for e in getattr(exc, "worker_failures", {}).values():
        inner = e
        break
    lines = [ln.strip() for ln in str(inner).strip().splitlines() if ln.strip()]
    text = f"{type(inner).__name__}: {lines[-1] if lines else ''}"
    return text if len(text) <= limit else text[:limit - 1] + "…"
