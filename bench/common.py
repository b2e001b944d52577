"""What every benchmark shares: a description of the device and the JSON result writer.

Results go to bench/results/<name>-<device slug>-<UTC date>.json with the device, date, git commit,
shapes and figures, so a result can be traced to the code and the hardware that produced it.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

from pipeline.tracking.tracker import git_commit  # pipeline owns it; bench may import pipeline, never the reverse

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def device_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
                            "cpu_count": os.cpu_count(), "torch": torch.__version__}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device="cuda", gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    cuda=torch.version.cuda)
    else:
        info.update(device="cpu")
    return info


def device_slug() -> str:
    info = device_info()
    name = info.get("gpu", "cpu")
    return "".join(c if c.isalnum() else "-" for c in name).strip("-").lower()


def write_result(name: str, payload: dict[str, Any], out_dir: Path | None = None) -> Path:
    """Write {name, date, commit, device, **payload} atomically and return the path. The commit is git's, else
    LONGTRAIN_COMMIT's (set where the code is a copy without git), else "unknown"."""
    out_dir = Path(out_dir or RESULTS_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    now = _dt.datetime.now(_dt.timezone.utc)
    # LONGTRAIN_COMMIT: where the checkout is a copy without git (a lent GPU machine), bench/gpu_check.py --commit
    commit = git_commit() or os.environ.get("LONGTRAIN_COMMIT") or "unknown"
    record = {"benchmark": name, "date": now.isoformat(timespec="seconds"), "commit": commit,
              "device": device_info(), **payload}
    path = out_dir / f"{name}-{device_slug()}-{now.strftime('%Y%m%d')}.json"
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(record, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
    return path


def saved_tensor_bytes(fn, params=()) -> int:
    """Bytes of the tensors autograd saves for backward while `fn()` runs: the activation memory a training step
    holds at the end of its forward. Counted per storage (a tensor saved by several ops, or views of one buffer,
    count once), parameters in `params` left out (they are held anyway)."""
    import torch

    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip and t.device.type != "meta":
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())
