"""Compile the sampling kernel and the staged cross-entropy row kernel to PTX for an H100 / H200 (sm_90) on a
machine without a GPU.

The simulator runs the kernels as Python, so it cannot see what only the device compiler sees: Numba's typing of the
real code path (libdevice bit casts, integer widths, shared-memory indexing) and where the registers go. This script
compiles the sampling kernel with the block and bucket count the Sampler launches and checks that nothing lives in
local memory (the per-thread buckets are in shared memory) and that no 64-bit integer division is left but the one
that sizes a block's slice; and the cross-entropy row kernel staged as a 32,000-logit bf16 row runs it (16 words a
thread in registers: none in local memory), both with the array types torch tensors give them. Run by
tests/cuda_ops/test_sampling_cudasim.py and test_cross_entropy_cudasim.py in a subprocess; by hand:

    .venv/bin/python tests/cuda_ops/ptx_decoder_kernels.py

It needs NVVM and NVRTC (numba-cuda's `cu13` extra) and prints {"skipped": reason} without them. Numba asks the
current device for its compute capability even when told one; with no device, this script answers (9, 0).
Prints one JSON object {"sampling": "ok" | traceback, "cross_entropy_staged": ...}.
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

    import cuda_ops.cross_entropy as ce
    import cuda_ops.sampling_kernel as K

    dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=CC)
    arr = lambda dtype, ndim: nt.Array(dtype, ndim, "A")  # noqa: E731
    f32, f64, i32, i64 = nt.float32, nt.float64, nt.int32, nt.int64
    signature = (arr(f32, 2), arr(i32, 2), arr(f32, 1), arr(i64, 1), arr(f32, 1), arr(f32, 1), arr(i64, 1),
                 arr(i64, 1), arr(i64, 1), arr(i64, 3), arr(f64, 3), arr(f64, 4), arr(i32, 4), arr(i32, 4), i64,
                 nt.boolean)
    report = {}
    try:
        ptx, _ = cuda.compile_ptx(K.build_kernel(K.BLOCK, K.NB).py_func, signature, cc=CC)
        assert ".entry" in ptx, "no kernel entry"
        assert ".local" not in ptx, "registers or arrays in local memory"
        divisions = ptx.count("div.s64") + ptx.count("div.u64") + ptx.count("rem.s64") + ptx.count("rem.u64")
        assert divisions <= 1, f"{divisions} 64-bit integer divisions (one sizes the slice)"
        report["sampling"] = "ok"
    except Exception:
        report["sampling"] = traceback.format_exc()
    try:
        threads, words = ce.rowwise_plan(16000)  # a 32,000-logit bf16 row as int32 words of two
        assert words == 16, (threads, words)
        ce_sig = (arr(i32, 2), arr(i64, 1), i64, f64, nt.boolean, arr(f32, 1), arr(i32, 1))
        ptx, _ = cuda.compile_ptx(ce._rowwise_kernel(threads, "bf16x2", words).py_func, ce_sig, cc=CC)
        assert ".entry" in ptx and ".local" not in ptx, "no kernel entry, or the held row in local memory"
        report["cross_entropy_staged"] = "ok"
    except Exception:
        report["cross_entropy_staged"] = traceback.format_exc()
    return report


if __name__ == "__main__":
    print(json.dumps(main()))
