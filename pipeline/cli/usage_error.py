"""The command line's errors: a UsageError for a flag combination it refuses, and which exception of a failure is
the user's (one line, no traceback) rather than a bug.

    raise UsageError("export needs --out DIR: ...")     # run.py prints `error: <the message>` and exits 2
    found = user_error(exc)                              # the project's own error inside Ray's wrappers, or None
"""
from __future__ import annotations


class UsageError(ValueError):
    """Bad command-line usage; printed as one line."""


def user_error(exc: BaseException) -> BaseException | None:
    """The first of the project's own ValueError/RuntimeError subclasses in `exc`'s chain (Ray's wrappers
    followed: pipeline/ray_runtime.py find_cause), or None."""
    def ours(e: BaseException) -> bool:
        return (isinstance(e, (ValueError, RuntimeError))
                and type(e).__module__.split(".")[0] in ("pipeline", "model", "cuda_ops"))

    if ours(exc):
        return exc
    from pipeline.ray_runtime import find_cause

    return find_cause(exc, ours)
