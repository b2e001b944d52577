"""Ctrl+C from the first second: `python pipeline/run.py train` started the way a shell script's `cmd &` starts it
(SIGINT ignored: a SIGINT sent before training began used to be lost, and the run trained to its end), interrupted
before Ray is up and during prepare. Each ends at once with exit code 130 and one line of what was kept; nothing
half-built is left. The moments are held with prepare's test hook (LONGTRAIN_PREPARE_HOLD: a marker file in the
build directory), not timed with sleeps. During training: tests/pipeline/test_object_storage.py (Ray) and
tests/pipeline/train/test_resume_extend.py (--no-ray, and during eval)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[1].parent
RUN = [sys.executable, str(ROOT / "pipeline" / "run.py")]


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # what a non-interactive shell does for `cmd &`


@pytest.fixture(scope="module")
def held_runs(ray_address, tmp_path_factory):
    """Two `train` commands on a small new corpus, started together as background jobs and held by prepare's
    hook: one before it joins Ray (start), one after Ray Data tokenized the corpus (parts)."""
    from tests.pipeline.data.helpers import sample_docs, write_jsonl

    base = tmp_path_factory.mktemp("ctrlc-moments")
    corpus = write_jsonl(base / "corpus.jsonl", sample_docs(40, 1500))
    procs = {}
    for moment in ("start", "parts"):
        root = base / moment
        args = ["train", "--preset", "test", f"--run.root={root}", "--run.name=held", "--data.source=files",
                f"--data.path={corpus}", "--tracking.enabled=false", "--address", ray_address]
        env = {**os.environ, "LONGTRAIN_PREPARE_HOLD": moment, "PYTHONPATH": str(ROOT)}
        procs[moment] = (subprocess.Popen([*RUN, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          cwd=ROOT, env=env, preexec_fn=_ignore_sigint), root)
    yield procs
    for proc, _ in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize("moment", ["start", "parts"], ids=["before Ray is up", "during prepare"])
def test_ctrl_c_before_training_ends_at_once_and_says_what_was_kept(held_runs, moment):
    proc, root = held_runs[moment]
    deadline = time.monotonic() + 300
    marker = None
    while marker is None and proc.poll() is None and time.monotonic() < deadline:
        marker = next(root.glob(f"datasets/*/build-*/.hold-{moment}"), None)
        time.sleep(0.05)
    assert marker is not None, f"never reached {moment}: {proc.communicate(timeout=60)}"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-3000:] + err[-3000:]
    run_dir = root / "held"
    assert err.strip().splitlines()[-1] == (
        f"interrupted: during prepare: no dataset was published (the partial build is removed; a rerun builds it "
        f"again); run {run_dir} has no checkpoint yet; continue with: python pipeline/run.py train --resume {run_dir}")
    assert "Traceback" not in err and "==> train" not in out
    assert json.loads((run_dir / "run.json").read_text())["status"] == "stopped"
    dataset = marker.parent.parent
    assert not (dataset / "manifest.json").exists() and not list(dataset.glob("build-*"))
