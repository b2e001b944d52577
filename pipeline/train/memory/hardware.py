"""Device facts the engine needs: which device to train on, its dense bf16 peak for MFU, the autocast dtype.

Peaks are the vendors' dense (no sparsity) bf16 tensor-core figures with fp32 accumulation; MFU is
model FLOPs actually done per second over that peak (model/flops.py: with document masking only the
within-document attention pairs count). LONGTRAIN_PEAK_TFLOPS=<number> sets the peak by hand, for a device
the table does not know (or a CPU, to see the MFU arithmetic there).
"""
from __future__ import annotations

import os

import torch

PEAK_ENV = "LONGTRAIN_PEAK_TFLOPS"


class PeakFlopsError(ValueError):
    """LONGTRAIN_PEAK_TFLOPS is set to something that is not a positive number."""

# Dense bf16 peak FLOP/s by a substring of torch.cuda.get_device_name(); first match wins, so the
# more specific names come first.
PEAK_BF16_FLOPS: list[tuple[str, float]] = [
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A10G", 70e12),  # AWS g5: lower clocks than A10
    ("A10", 125e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
    ("V100", 125e12),  # fp16 (no bf16 on Volta)
]


# Peak memory bandwidth in bytes/s by the same kind of name substring (vendors' HBM/GDDR figures); bench/decoder_kernels.py
# reports each kernel's achieved GB/s as a share of it.
PEAK_MEMORY_BYTES_PER_S: list[tuple[str, float]] = [
    ("GH200", 4.0e12),  # before H200, which it contains
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100 NVL", 3.9e12),
    ("H100", 3.35e12),  # SXM, HBM3
    ("B200", 8.0e12),
    ("A100-SXM4-80GB", 2.04e12),
    ("A100", 1.56e12),
    ("L40S", 0.864e12),
    ("L4", 0.3e12),
    ("A10", 0.6e12),
]


def peak_memory_bandwidth(device: torch.device) -> float | None:
    """Peak memory bandwidth of `device` in bytes/s, or None when unknown (CPU, unlisted GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bw for key, bw in PEAK_MEMORY_BYTES_PER_S if key in name), None)


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak FLOP/s of `device`, or None when unknown (CPU, unlisted GPU): MFU is then not reported.
    LONGTRAIN_PEAK_TFLOPS, when set, wins on any device."""
    manual = os.environ.get(PEAK_ENV, "").strip()
    if manual:
        try:
            tflops = float(manual)
        except ValueError:
            tflops = float("nan")
        if not tflops > 0 or tflops == float("inf"):
            raise PeakFlopsError(f"{PEAK_ENV}={manual!r} is not a peak; set it to the device's dense bf16 "
                                 "TFLOP/s, e.g. 989 for an H100 SXM, or unset it")
        return tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_BF16_FLOPS:
        if key in name:
            return flops
    return None


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on CUDA under precision auto|bf16; None (plain fp32) on CPU or with precision fp32.

    bf16 autocast on CPU is slow and numerically different from what a CPU test expects, so CPU runs
    are fp32 whatever the precision field says.
    """
    if precision == "fp32" or device.type != "cuda":
        return None
    return torch.bfloat16


def configure_cuda_math() -> None:
    """TF32 for the fp32 matmuls that remain under autocast (optimizer math, norms)."""
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("high")


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated memory since the last reset, in GiB (0 on CPU, where torch keeps no counter)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return 0.0


def host_available_gib() -> float:
    """Memory the host can still give (GiB): the CPU 'device' size when no limit is set."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (ValueError, OSError, AttributeError):
        return 8.0
