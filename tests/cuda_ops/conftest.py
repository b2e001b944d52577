"""Fixtures of the cuda_ops tests: the CUDA-simulator runs, started together in the background.

NUMBA_ENABLE_CUDASIM must be set before numba is first imported, so each simulator script
(cudasim_cross_entropy.py, cudasim_sampling.py, cudasim_resonance_scan.py, cudasim_moe_dispatch.py, and ptx_resonance_scan.py, which compiles
the resonance kernels with the real compiler instead) runs in a subprocess of its own. The first two are single-threaded
Python (the simulator runs every GPU thread as a Python thread), ~13 s and ~36 s on 2 cores (the resonance ones
~4 s each), and used to run one after the other, each when its test module started, while the second core idled. They now start as soon as the
first test of this package runs (when the session has collected their tests), side by side with each other and
with the other cuda_ops tests, and each module's fixture waits for its own result: the package takes ~40 s
instead of ~67 s. On pytest-xdist's workers each module starts its own script instead (the fixture below says why). The assertions are in test_cross_entropy_cudasim.py, test_sampling_cudasim.py and test_resonance_scan_cudasim.py.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# test module -> the simulator script whose output it checks
SCRIPTS = {"test_cross_entropy_cudasim.py": HERE / "cudasim_cross_entropy.py",
           "test_sampling_cudasim.py": HERE / "cudasim_sampling.py",
           "test_resonance_scan_cudasim.py": HERE / "cudasim_resonance_scan.py",
           "test_moe_dispatch_cudasim.py": HERE / "cudasim_moe_dispatch.py"}
# scripts that run beside a module's simulator script: the real compiler's check (it unsets the simulator itself)
COMPANIONS = {"test_resonance_scan_cudasim.py": [HERE / "ptx_resonance_scan.py"],
              "test_sampling_cudasim.py": [HERE / "ptx_decoder_kernels.py"],
              "test_cross_entropy_cudasim.py": [HERE / "ptx_decoder_kernels.py"]}
TIMEOUT_S = 300  # a bound for a hang, from the moment a test waits for the run


class SimulatorRuns:
    """Each script started at most once; result() waits for it like subprocess.run(capture_output=True)."""

    def __init__(self, out_dir: Path):
        self.out_dir = out_dir
        self.procs: dict[str, tuple[subprocess.Popen, Path, Path]] = {}

    def start(self, script: Path) -> None:
        if script.name in self.procs:
            return
        env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
        env.pop("LONGTRAIN_KERNELS", None)
        # Files, not pipes: nobody reads while it runs, and a full pipe would stall it.
        out, err = self.out_dir / f"{script.stem}.out", self.out_dir / f"{script.stem}.err"
        with open(out, "w") as fo, open(err, "w") as fe:
            proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=fo, stderr=fe, text=True)
        self.procs[script.name] = (proc, out, err)

    def result(self, script: Path) -> subprocess.CompletedProcess:
        self.start(script)
        proc, out, err = self.procs[script.name]
        try:
            proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            pytest.fail(f"{script.name} under the simulator did not finish in {TIMEOUT_S} s:\n"
                        f"{err.read_text()[-3000:]}")
        return subprocess.CompletedProcess(proc.args, proc.returncode, out.read_text(), err.read_text())

    def stop(self) -> None:
        for proc, _, _ in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="session")
def cudasim_runs(tmp_path_factory):
    runs = SimulatorRuns(tmp_path_factory.mktemp("cudasim"))
    yield runs
    runs.stop()


@pytest.fixture(scope="package", autouse=True)
def _start_simulator_runs_early(request, cudasim_runs):
    """Start the simulator script of every collected cudasim test module before this package's first test.

    Not on a pytest-xdist worker: each worker collects every test, so each started every script, and the suite on
    2 processes ran them twice (a worker's copies of the scripts of modules the other worker ran went unread). There each module's fixture
    starts its own script when it first needs it, on the worker that runs that module, and the other worker's tests
    keep the second core busy meanwhile."""
    if hasattr(request.config, "workerinput"):
        return
    if importlib.util.find_spec("numba") is not None:  # without numba those modules are skipped
        wanted = {item.path.name for item in request.session.items} & set(SCRIPTS)
        for name in sorted(wanted):
            for script in [SCRIPTS[name], *COMPANIONS.get(name, [])]:
                cudasim_runs.start(script)
