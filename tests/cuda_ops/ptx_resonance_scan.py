"""Compile the resonance scan's kernels to PTX for an H100 (sm_90) on a machine without a GPU.

The simulator runs the kernels as Python, so it cannot see what only the device compiler sees: Numba's typing of
the real code path (the bf16 codec's libdevice bit casts, integer widths, strided array types). NVVM can: this
script compiles all six kernels, for both storage kinds, with the array types torch tensors give them (any strides).
Run by tests/cuda_ops/test_resonance_scan_cudasim.py in a subprocess; by hand:

    .venv/bin/python tests/cuda_ops/ptx_resonance_scan.py

It needs NVVM and NVRTC (`pip install nvidia-nvvm nvidia-cuda-nvrtc`, the CUDA 13 wheels numba-cuda's `cu13` extra
names) and prints {"skipped": reason} without them. Numba asks the current device for its compute capability even
when told one; with no device, this script answers (9, 0) for it.
Prints one JSON object {"<io> <kernel>": "ok" | traceback, ...}.
"""
from __future__ import annotations

import json
import os
import sys
import traceback
import types
from pathlib import Path

os.environ.pop("NUMBA_ENABLE_CUDASIM", None)  # the real compiler, not the simulator
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

CC = (9, 0)


def main() -> dict:
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        for lib in ("nvvm", "nvrtc"):
            load_nvidia_dynamic_lib(lib)
    except Exception as exc:  # no toolkit libraries: nothing to compile with
        return {"skipped": f"NVVM/NVRTC not found ({type(exc).__name__}); pip install nvidia-nvvm nvidia-cuda-nvrtc"}
    import numba.cuda.dispatcher as dispatcher
    from numba import cuda
    from numba import types as nt

    import cuda_ops.resonance_scan as rs

    dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=CC)
    f32, arr = nt.float32, (lambda dtype, ndim: nt.Array(dtype, ndim, "A"))
    report = {}
    for io in rs.IO_KINDS:
        x = arr(f32, 5) if io == "f32" else arr(nt.int32, 4)  # z, s, gs, dz
        lam, starts, summary, state, chunk = arr(f32, 3), arr(nt.uint8, 2), arr(f32, 5), arr(f32, 5), nt.int64
        signatures = {
            "fwd_reduce": (x, lam, starts, chunk, summary),
            "fwd_carry": (summary, state),
            "fwd_apply": (x, lam, starts, chunk, state, x, arr(f32, 4)),
            "bwd_reduce": (x, lam, starts, chunk, summary),
            "bwd_carry": (summary, state),
            "bwd_apply": (x, x, lam, starts, chunk, arr(f32, 4), state, x, state),
        }
        for name, kernel in rs._kernels(io).items():
            try:
                ptx, _ = cuda.compile_ptx(kernel.py_func, signatures[name], cc=CC)
                assert ".entry" in ptx and ".local" not in ptx, "no kernel entry, or registers spilled to local memory"
                report[f"{io} {name}"] = "ok"
            except Exception:
                report[f"{io} {name}"] = traceback.format_exc()
    return report


if __name__ == "__main__":
    print(json.dumps(main()))
