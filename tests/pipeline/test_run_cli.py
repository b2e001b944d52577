"""`python pipeline/run.py` as a user runs it: phases carry the model from one dataset to the next; bad command lines
get one clear line. Ctrl+C during a Ray Train run, --resume finishing it with every sequence seen exactly once and a
larger train.max_steps extending it: tests/pipeline/test_object_storage.py (the whole pipeline, in the bucket)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN = [sys.executable, str(ROOT / "pipeline" / "run.py")]


def run_cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*RUN, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.system
def test_phases_carry_the_model_and_schedule(tmp_path, ray_address, mlflow_server):
    """Two phases on two corpora (Ray-free path): phase 2 starts from phase 1's final state with its own
    data, one LR schedule spans both, and the second dataset reuses the first tokenizer. Training is Ray-free;
    preparing the two datasets (Ray Data) joins the session's Ray instead of starting one of its own, and the
    run tracks to the session's MLflow server (a new SQLite store costs ~4 s of schema migrations)."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for path, word in ((a, "alpha"), (b, "omega")):
        with open(path, "w") as f:
            for i in range(200):
                f.write(json.dumps({"text": f"{word} story {i}: " + " ".join([word, "and", "the", "cat"] * (5 + i % 7))})
                        + "\n")
    phases = tmp_path / "phases.yaml"
    phases.write_text(f"- steps: 4\n  overrides: {{data.path: '{a}'}}\n- steps: 6\n  overrides: {{data.path: '{b}'}}\n")
    res = run_cli("train", "--no-ray", "--address", ray_address, "--preset", "test",
                  f"--run.root={tmp_path / 'runs'}", "--run.name=ph",
                  "--data.source=files", f"--data.path={a}", "--data.vocab_size=300", "--phases", str(phases),
                  "--train.checkpoint_every=2", "--train.eval_every=2", "--train.sample_tokens=0",
                  f"--tracking.tracking_uri={mlflow_server[0]}", "--tracking.experiment=phases")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    record = json.loads((tmp_path / "runs" / "ph" / "run.json").read_text())
    assert record["phases_done"] == 2 and len(record["datasets"]) == 2
    assert record["datasets"][0] != record["datasets"][1]
    meta = json.loads((Path(record["checkpoint"]) / "meta.json").read_text())
    assert meta["counters"]["step"] == 10 and meta["counters"]["phase"] == 1
    assert meta["counters"]["epoch"] == 0 and meta["counters"]["cursor"] == 6 * 4  # phase 2's own data cursor
    assert meta["config"]["train"]["max_steps"] == 10  # one schedule over both phases
    m1 = json.loads(Path(record["datasets"][1], "manifest.json").read_text())
    m0 = json.loads(Path(record["datasets"][0], "manifest.json").read_text())
    assert m1["tokenizer_sha256"] == m0["tokenizer_sha256"]


BAD_COMMAND_LINES = [
    (["train", "--train.batch_size=0"], "train.batch_size=0 is invalid; it must be > 0"),
    (["train", "--model.tier=Z"], "model.tier='Z' is not allowed; choose one of: nano, A, B, C, D"),
    (["train", "--train.bogus=1"], "unknown config field 'train.bogus'"),
    (["train", "--preset", "cpu", "--data.seq_len=99999"], "data.seq_len=99999 is out of range for model.tier=nano"),
    (["train", "--resume", "/nonexistent/run"], "--resume /nonexistent/run: no run there"),
    (["eval", "--checkpoint", "/nonexistent/ckpt"], "is not a checkpoint"),
    (["validate"], "validate needs a dataset directory"),
]


@pytest.fixture(scope="module")
def bad_command_line_runs(request) -> dict[tuple[str, ...], subprocess.Popen]:
    """`python pipeline/run.py ARGS` for every bad command line this session runs, all started at once: each is
    a few seconds of imports on one core, so side by side they take the time of the slowest few instead of the
    sum; test_bad_command_lines_get_one_clear_line waits for and checks its own."""
    wanted = [tuple(item.callspec.params["args"]) for item in request.session.items
              if item.originalname == "test_bad_command_lines_get_one_clear_line" and item.path == request.path]
    procs = {args: subprocess.Popen([*RUN, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    cwd=ROOT) for args in dict.fromkeys(wanted)}
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize("args, message", BAD_COMMAND_LINES)
def test_bad_command_lines_get_one_clear_line(args, message, bad_command_line_runs):
    proc = bad_command_line_runs[tuple(args)]
    stdout, stderr = proc.communicate(timeout=120)
    res = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert res.returncode == 2
    assert message in res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


@pytest.mark.system
def test_the_main_job_reads_well_in_a_log_file(test_runs_root):
    """`python pipeline/run.py` (every stage) with its output going to a file, as in CI or `ray job logs`:
    its own local Ray (dashboard URL printed), stage banners, plain progress lines without colour codes, and none
    of Ray's placement-group-cleaner or deprecation noise."""
    res = run_cli("--preset", "test", f"--run.root={test_runs_root}", "--run.name=console", "--max-new-tokens=8",
                  timeout=400)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    lines = out.splitlines()
    assert any(ln.startswith("ray: local instance") and "dashboard at http://127.0.0.1:" in ln for ln in lines), out
    for name in ("prepare", "train", "eval", "generate"):
        assert any(ln.startswith(f"==> {name}") for ln in lines), f"no {name} banner:\n{out}"
    assert any(ln.endswith("eta 0m00s") and "step 8/8" in ln for ln in lines), out  # plain progress lines
    # the kernels' backend, once, with the reason it is not the Numba one (rank 0's line, through Ray's log)
    kernels = [ln for ln in lines if "kernels: " in ln]
    assert len(kernels) == 1 and kernels[0].split("kernels: ", 1)[1].startswith(
        "cross_entropy, sampling, resonance_scan, moe_dispatch: reference (the tensors are on the cpu"), out
    noise = [i for i, ln in enumerate(lines)
             if "PlacementGroupCleaner" in ln or "deprecated" in ln.lower() or "Traceback" in ln]
    assert not noise, "\n\n".join("\n".join(lines[i:i + 40]) for i in noise[:2])
    assert "\x1b[" not in out, "terminal colour codes in a log file"  # Ray colours worker prefixes unless told
    assert len(lines) <= 150, f"{len(lines)} lines:\n{out}"


@pytest.mark.parametrize("no_ray", [True, False], ids=["no-ray", "ray-train"])
def test_a_dataset_without_validation_rows_is_refused_at_training_start(test_runs_root, tmp_path, capsys, no_ray):
    """The session's prepared `test` dataset with its validation shards taken out of the manifest (found again by
    its settings hash, so nothing is prepared): training refuses it in one line before any step or worker."""
    import shutil

    from pipeline.run import main

    (dataset,) = (test_runs_root / "datasets").iterdir()
    copy = shutil.copytree(dataset, tmp_path / "no-val")
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["shards"]["val"] = []
    (copy / "manifest.json").write_text(json.dumps(manifest))
    args = ["train", "--preset", "test", f"--run.root={tmp_path}", f"--data.dataset_dir={copy}",
            "--tracking.enabled=false", *(["--no-ray"] if no_ray else [])]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [ln for ln in err.splitlines() if not ln.startswith("[data] ")]  # after prepare's reuse line
    assert line.startswith("error: no validation rows (") and "data.val_fraction=0.02) in dataset " in line
    assert not (tmp_path / "ray_results").exists() and not list(tmp_path.glob("*/checkpoints"))
