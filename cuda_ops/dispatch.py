"""Which implementation of a cuda_ops kernel runs, and the torch <-> Numba interop every kernel shares.

    backend = resolve_backend(hidden.device)            # "numba" on a CUDA tensor with numba-cuda, else "reference"
    LONGTRAIN_KERNELS=reference python bench/decoder_kernels.py # force the pure-torch path everywhere

Precedence: an explicit `requested` argument ("numba" / "reference") wins, then the LONGTRAIN_KERNELS environment
variable, then "auto". Forcing "numba" where it cannot run (CPU tensor, numba-cuda missing, no CUDA driver) raises
one KernelBackendError naming the cause and the fix, instead of failing later inside a kernel launch.

Numba is imported lazily, inside functions, so `import cuda_ops` never needs numba or a GPU.

Interop (docs/design.md, Kernels): torch CUDA tensors are handed to Numba through __cuda_array_interface__ WITHOUT the
implicit stream synchronisation (`as_cuda_array(t, sync=False)`), and kernels launch on torch's current stream
(`torch_stream()`), so a Numba kernel orders with the surrounding cuBLAS matmuls like any torch op and nothing
waits on the host.

Compilation: Numba compiles a kernel on its first launch (a second or so per kernel and block size). Each kernel
module exposes `warmup()`, which compiles ahead and returns the seconds it took, so benchmarks report compile time
apart from steady-state timings.
"""
from __future__ import annotations

import functools
import os

import torch

ENV_VAR = "LONGTRAIN_KERNELS"
CHOICES = ("auto", "reference", "numba")


class KernelBackendError(RuntimeError):
    """A kernel backend was requested that cannot run here (or the request itself is malformed)."""


@functools.lru_cache(maxsize=1)
def numba_cuda_status() -> tuple[bool, str]:
    """(usable, reason): whether numba-cuda imports and sees a CUDA driver + NVVM. Cached: probing inits the driver."""
    try:
        from numba import cuda
    except ImportError as exc:  # numba or numba-cuda not installed
        return False, f"numba-cuda is not importable ({exc}); install it with `pip install numba-cuda`"
    try:
        if cuda.is_available():
            return True, "numba-cuda sees a CUDA device"
    except Exception as exc:  # driver init can raise on broken installs; report it rather than crash dispatch
        return False, f"numba-cuda failed to initialise CUDA ({type(exc).__name__}: {exc})"
    return False, "numba-cuda is installed but finds no usable CUDA driver/NVVM (numba.cuda.is_available() is False)"


def _requested_choice(requested: str | None) -> tuple[str, str]:
    """(choice, where it came from) after applying the argument-over-environment precedence."""
    if requested is not None and requested != "auto":
        source = "backend argument"
        choice = requested
    else:
        source = f"environment variable {ENV_VAR}"
        choice = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise KernelBackendError(f"{source} is {choice!r}; allowed values are {', '.join(CHOICES)}")
    return choice, source


def resolve_backend(device: torch.device | str, requested: str | None = None) -> str:
    """Return "numba" or "reference" for tensors living on `device`.

    auto:      CUDA device and numba-cuda usable -> "numba", otherwise "reference".
    reference: always "reference" (pure torch; runs on CPU and CUDA).
    numba:     "numba", or KernelBackendError when the device is not CUDA or numba-cuda cannot run.
    """
    choice, source = _requested_choice(requested)
    device = torch.device(device)
    if choice == "reference":
        return "reference"
    usable, reason = numba_cuda_status() if device.type == "cuda" else (False, "")
    if choice == "auto":
        return "numba" if usable else "reference"
    # choice == "numba": forced
    if device.type != "cuda":
        raise KernelBackendError(
            f"{source} asks for the numba kernels, but the tensors are on {device}; the Numba kernels need CUDA "
            f"tensors. Move the tensors to a GPU, or use {ENV_VAR}=auto / backend='reference' on this machine.")
    if not usable:
        raise KernelBackendError(
            f"{source} asks for the numba kernels, but {reason}. Use {ENV_VAR}=auto or backend='reference' "
            f"to run the pure-torch path instead.")
    return "numba"


# The kernel families and the module of each (all resolve their backend through resolve_backend).
KERNEL_FAMILIES = ("cross_entropy", "sampling", "resonance_scan", "moe_dispatch")
GPU_EXTRA_FIX = ("install the project's gpu extra on GPU nodes: pip install -e '.[gpu]' (numba-cuda with CUDA 13's "
                 "NVVM and NVRTC; '.[gpu-cu12]' for a CUDA 12 driver)")


def kernel_backends(device: torch.device | str) -> dict[str, tuple[str, str]]:
    """family -> (backend, why) for tensors on `device`, as the `auto` dispatch (or LONGTRAIN_KERNELS) decides.
    `why` says what a run on the reference path gives up and how to get the kernels, where that applies."""
    device = torch.device(device)
    choice, source = _requested_choice(None)
    try:
        backend = resolve_backend(device)
    except KernelBackendError as exc:  # LONGTRAIN_KERNELS=numba where they cannot run: the first kernel call fails
        return {family: ("unavailable", str(exc)) for family in KERNEL_FAMILIES}
    if backend == "numba":
        why = "Numba-CUDA kernels"
    elif choice == "reference":
        why = f"forced by {source}=reference"
    elif device.type != "cuda":
        why = f"the tensors are on the {device.type} (the Numba kernels need CUDA tensors; the reference is the CPU path)"
    else:
        why = (f"{numba_cuda_status()[1]}: fp32 matmuls and an fp32 copy of the output head instead of the kernels; "
               f"{GPU_EXTRA_FIX}")
    return {family: (backend, why) for family in KERNEL_FAMILIES}


def describe_backends(device: torch.device | str) -> str:
    """One line for the console and an MLflow tag: `cross_entropy, sampling, resonance_scan: numba (Numba-CUDA
    kernels)`, or the reference path with its reason."""
    groups: dict[tuple[str, str], list[str]] = {}
    for family, choice in kernel_backends(device).items():
        groups.setdefault(choice, []).append(family)
    return "; ".join(f"{', '.join(fams)}: {backend} ({why})" for (backend, why), fams in groups.items())


# ---------------------------------------------------------------------------------------------------------------
# torch <-> Numba interop (only called on the "numba" backend, i.e. with CUDA tensors)
# ---------------------------------------------------------------------------------------------------------------

def as_numba(t: torch.Tensor):
    """Zero-copy Numba DeviceNDArray view of a CUDA tensor, without the interface's stream synchronisation.

    `detach()` because torch refuses __cuda_array_interface__ on tensors that require grad; the view aliases the
    same memory, so kernels writing into it write into `t`. The tensor stays alive as the view's owner.
    """
    from numba import cuda

    if not t.is_cuda:
        raise ValueError(f"as_numba needs a CUDA tensor, got one on {t.device}")
    return cuda.as_cuda_array(t.detach(), sync=False)


@functools.lru_cache(maxsize=64)
def _external_stream(ptr: int):
    from numba import cuda

    return cuda.external_stream(ptr)


def torch_stream():
    """torch's current CUDA stream as a Numba stream, so a launch `kernel[grid, block, torch_stream()]` is ordered
    after the torch ops already queued (the logits matmul) and before the ones queued next (the gradient matmuls).
    Wrappers are cached by stream pointer: creating one per launch costs a driver call."""
    return _external_stream(torch.cuda.current_stream().cuda_stream)


def check_same_device(t: torch.Tensor) -> None:
    """Numba binds to one CUDA context per host thread (the device current when it first ran). One device per
    process, as under DDP, is what the kernels support; a tensor on another device is a clear error, not a crash."""
    from numba import cuda

    numba_dev = cuda.current_context().device.id
    if t.device.index is not None and t.device.index != numba_dev:
        raise KernelBackendError(
            f"tensor is on cuda:{t.device.index} but Numba is bound to cuda:{numba_dev} in this thread; use one GPU "
            f"per process (torch.cuda.set_device(local_rank) before the first kernel call)")
