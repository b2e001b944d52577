"""One command run as a step of bench/gpu_check.py: in an environment nobody sets by hand, in a process group of its
own under a time cap, and afterwards nothing it started left running.

    site = make_site(tmp / "site", tarball=None)          # the numpy shim (and a Ray + MLflow site, when given)
    res = run_command([sys.executable, "bench/decoder_kernels.py"], cwd=REPO, env=step_env(site, REPO), cap_s=60, log_dir=d)
    res["status"]                                         # ok | failed | timeout | interrupted

The environment: PYTHONPATH=<site>:<repo>, PYTHONUNBUFFERED=1, and in <site> a sitecustomize.py that gives numpy
2.5 back `np.row_stack` (numba-cuda 0.30.4 still calls it at its first kernel compile: the GPU image's mismatch), then
runs the sitecustomize it shadows, if any. Every process of the step carries a marker variable, so the processes that left
its process group (Ray's raylet and workers start sessions of their own) are found and stopped too.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import tarfile
import time
import uuid
from pathlib import Path

MARKER = "LONGTRAIN_GPU_CHECK_STEP"  # in the environment of every process a step starts

SHIM = '''"""Written by bench/step_process.py into a temporary folder first on PYTHONPATH: runs at interpreter start."""
try:
    import numpy as _np
    if not hasattr(_np, "row_stack"):  # numpy 2.5 removed it; numba-cuda 0.30.4 still calls it at its first compile
        _np.row_stack = _np.vstack
except ImportError:
    pass
import importlib.machinery as _machinery, importlib.util as _util, os as _os, sys as _sys
_here = _os.path.dirname(_os.path.abspath(__file__))  # then the sitecustomize this one shadows, if there is one
_spec = _machinery.PathFinder.find_spec("sitecustomize", [p for p in _sys.path if _os.path.abspath(p or ".") != _here])
if _spec is not None and _spec.loader is not None:
    _spec.loader.exec_module(_util.module_from_spec(_spec))
'''


def make_site(site: Path, tarball: Path | None = None) -> Path:
    """The folder every step's interpreter finds first: a site tarball's packages when given (Ray + MLflow, built by
    `python bench/gpu_check.py --pack`: bench/gpu_site.py), then the numpy shim as sitecustomize.py, written last so
    it is always ours."""
    site.mkdir(parents=True, exist_ok=True)
    if tarball is not None:
        with tarfile.open(tarball) as tar:
            tar.extractall(site, filter="data")
    (site / "sitecustomize.py").write_text(SHIM)
    return site


def step_env(site: Path, repo: Path, commit: str | None = None) -> dict[str, str]:
    """This process's environment with the site and the repository first on PYTHONPATH, output unbuffered, the
    site's console scripts (ray, mlflow) first on PATH, and LONGTRAIN_COMMIT (bench/common.py records it where the
    code is a copy without git, as on a lent machine)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(repo)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONUNBUFFERED"] = "1"
    if (site / "bin").is_dir():
        env["PATH"] = f"{site / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    if commit:
        env["LONGTRAIN_COMMIT"] = commit
    return env


class Interrupted(Exception):
    """This process got SIGTERM or SIGINT (a device call's time limit, Ctrl-C) while a step ran."""


def raise_on_signal(signum, frame):
    """Signal handler: raise Interrupted once; later signals are ignored so the cleanup is not cut short."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    raise Interrupted(signal.Signals(signum).name)


def marked_pids(marker: str) -> list[int]:
    """Processes (other than this one) whose environment holds MARKER=marker."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            if int(d.name) != os.getpid() and needle in (d / "environ").read_bytes().split(b"\0"):
                found.append(int(d.name))
        except (OSError, ValueError):
            continue
    return found


def _signal(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def stop_processes(proc: subprocess.Popen | None, marker: str, grace_s: float = 5.0) -> int:
    """Stop what the step left running: SIGINT to its process group first while its own process still runs (pytest
    then still writes its JUnit XML of the tests so far; a Python bench ends as on Ctrl-C), then SIGTERM to the group
    and every marked process, SIGKILL to what is left after `grace_s` each. Returns how many were running."""
    running = lambda: proc is not None and proc.poll() is None  # noqa: E731
    alive = lambda: set(marked_pids(marker)) | ({proc.pid} if running() else set())  # noqa: E731
    pids, was_running = alive(), running()

    def wait(done) -> None:
        deadline = time.monotonic() + grace_s
        while not done() and time.monotonic() < deadline:
            time.sleep(0.2)

    for sig in (signal.SIGINT, signal.SIGTERM):
        if running():
            try:
                os.killpg(proc.pid, sig)
            except OSError:
                pass
        if sig == signal.SIGTERM:
            _signal(alive(), sig)
        wait((lambda: not running()) if sig == signal.SIGINT else (lambda: not alive()))
    _signal(alive(), signal.SIGKILL)
    if was_running:  # the group's unmarked members too (a step that ended by itself is not signalled at all)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
    if proc is not None:
        proc.wait()
    return len(pids)


_NOISE = re.compile(r"warn|^\s*$|^\s*(\[\d+/\d+\]|\d+%\|)", re.I)


def last_lines(text: str, n: int = 5) -> list[str]:
    """The last n meaningful lines: escape codes and progress bars out, warnings and blank lines skipped (all lines
    when nothing else is left)."""
    lines = [ln.rsplit("\r", 1)[-1].rstrip() for ln in re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text).splitlines()]
    meaningful = [ln for ln in lines if not _NOISE.search(ln)]
    return (meaningful or [ln for ln in lines if ln.strip()])[-n:]


def failure_lines(text: str) -> list[str]:
    """Why a command failed, from its stderr: the exception line(s) of its last Python traceback, else its last
    meaningful lines (the project's CLI prints one `error: ...` line)."""
    lines = last_lines(text, 400)
    for i in range(len(lines) - 1, -1, -1):
        if "Traceback (most recent call last)" in lines[i]:
            raised = [ln for ln in lines[i + 1:] if ln.strip() and not ln.startswith((" ", "\t"))]
            if raised:
                return raised[-3:]
            break
    return lines[-5:]


def tail(path: Path, n_bytes: int = 200_000) -> str:
    """The end of a log file as text."""
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - n_bytes))
        return f.read().decode("utf-8", "replace")


def run_command(argv: list[str], *, cwd: Path, env: dict[str, str], cap_s: float, log_dir: Path) -> dict:
    """Run argv under a cap of cap_s seconds, stdout and stderr to log_dir/{stdout,stderr}.log. Returns status (ok |
    failed | timeout | interrupted), reason (the exit code and the last meaningful stderr lines when it failed),
    seconds, exit_code and the two log paths. Interrupted (SIGTERM/SIGINT to this process) stops the step and is
    returned as its status, not raised."""
    marker = uuid.uuid4().hex
    out_log, err_log = log_dir / "stdout.log", log_dir / "stderr.log"
    status, reason, rc, proc = "ok", "", None, None
    t0 = time.monotonic()
    try:
        with open(out_log, "wb") as fo, open(err_log, "wb") as fe:
            proc = subprocess.Popen(argv, cwd=cwd, env={**env, MARKER: marker}, stdout=fo, stderr=fe,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            rc = proc.wait(timeout=cap_s)
    except subprocess.TimeoutExpired:
        status, reason = "timeout", f"over its cap of {cap_s:.0f} s: stopped with every process it started"
    except Interrupted as exc:
        status, reason = "interrupted", f"stopped by {exc}"
    left = stop_processes(proc, marker)
    seconds = time.monotonic() - t0
    if status == "ok" and rc != 0:
        why = failure_lines(tail(err_log)) or failure_lines(tail(out_log))
        status, reason = "failed", f"exit code {rc}: " + " | ".join(why)
    elif status == "ok" and left:
        reason = f"{left} process(es) it left running were stopped"
    return {"status": status, "reason": reason, "seconds": round(seconds, 1), "exit_code": rc,
            "stdout": out_log, "stderr": err_log}
