"""bench/gpu_check.py's plumbing on a CPU: one `--smoke` run of two real bench steps among steps added with
--add-step (one that fails, one over its cap that leaves a process of its own session behind, one that checks the
environment every step gets, one whose cap does not fit the budget), a run stopped by SIGTERM, folding and merging
the check files, the numpy shim, and the goals read from the H100 results committed under bench/results/.

    .venv/bin/python -m pytest -q tests/test_gpu_check.py      (~40 s on 2 idle cores)

Only the plumbing is asserted (statuses, reasons, files, which figures were read); figures are never assertions.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import gpu_check
from bench.gpu_report import measure_goal, merge, write_check
from bench.step_process import failure_lines, make_site, step_env

REPO = Path(__file__).resolve().parents[1]
SCRIPT = str(REPO / "bench" / "gpu_check.py")

FAILS = """import sys
print("about to fail")
sys.stderr.write("some/module.py:1: UserWarning: noise that is not the reason\\n")
raise RuntimeError("the injected failure")
"""
# Over its cap: it starts a process in a session of its own (as Ray's raylet does), which must be stopped too.
SLEEPS = """import pathlib, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
pathlib.Path(sys.argv[1]).write_text(str(child.pid))
time.sleep(600)
"""
ENV_CHECK = """import os, sys
import numpy as np, sitecustomize
site = os.environ["PYTHONPATH"].split(os.pathsep)[0]
assert os.path.dirname(sitecustomize.__file__) == site, (sitecustomize.__file__, site)
assert os.environ["PYTHONPATH"].split(os.pathsep)[1] == os.getcwd()  # the repository, the step's cwd
assert os.environ["PYTHONUNBUFFERED"] == "1" and os.environ["LONGTRAIN_COMMIT"] == "abc1234"
assert np.row_stack is not None
import bench.common  # the repository is importable
print("environment ok")
"""


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a parent that never reaps it is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """One gpu_check --smoke run (~30 s on 2 idle cores); (its output folder, its JSON, stdout, exit code, pid)."""
    d = tmp_path_factory.mktemp("gpu_check")
    scripts = {name: d / f"{name}.py" for name in ("fails", "sleeps", "env_check")}
    for (name, path), text in zip(scripts.items(), (FAILS, SLEEPS, ENV_CHECK)):
        path.write_text(text)
    pidfile = d / "grandchild.pid"
    argv = [sys.executable, SCRIPT, "--smoke", "--out", str(d / "out"), "--budget-min", "20", "--commit", "abc1234",
            "--steps", "fails", "decoder", "sleeps", "env_check", "too_long", "generate_short",
            "--add-step", "fails", "60", f"python {scripts['fails']}",
            "--add-step", "sleeps", "8", f"python {scripts['sleeps']} {pidfile}",
            "--add-step", "env_check", "60", f"python {scripts['env_check']}",
            "--add-step", "too_long", "100000", "python -c pass"]
    proc = subprocess.run(argv, cwd=d, capture_output=True, text=True, timeout=600)
    checks = list((d / "out").glob("gpu_check-*.json"))
    assert len(checks) == 1, proc.stdout + proc.stderr
    return d / "out", json.loads(checks[0].read_text()), proc, int(pidfile.read_text())


@pytest.mark.system
def test_every_step_is_recorded_and_a_failure_a_timeout_or_a_budget_skip_stops_nothing(smoke_run):
    out, check, proc, grandchild = smoke_run
    assert proc.returncode == 1, proc.stdout + proc.stderr  # a step failed and one timed out
    steps = {s["name"]: s for s in check["steps"]}
    assert list(steps) == ["fails", "decoder", "sleeps", "env_check", "too_long", "generate_short"]
    assert {n: s["status"] for n, s in steps.items()} == {
        "fails": "failed", "decoder": "ok", "sleeps": "timeout", "env_check": "ok", "too_long": "skipped",
        "generate_short": "ok"}, {n: s["reason"] for n, s in steps.items()}
    # the failure's reason: its exit code and the exception its traceback ends with
    assert steps["fails"]["reason"] == "exit code 1: RuntimeError: the injected failure"
    assert steps["fails"]["exit_code"] == 1 and steps["fails"]["stdout_tail"] == ["about to fail"]
    assert steps["sleeps"]["reason"].startswith("over its cap of 8 s") and steps["sleeps"]["seconds"] >= 8
    assert not _alive(grandchild), "the process the timed-out step started in its own session was left running"
    assert steps["too_long"]["reason"].startswith("budget: its cap of 100000 s does not fit the ")
    assert steps["too_long"]["seconds"] == 0 and "exit_code" not in steps["too_long"]
    assert steps["env_check"]["stdout_tail"] == ["environment ok"]
    assert check["smoke"] and check["budget_min"] == 20 and check["device"]["device"] == "cpu"
    assert check["commit"] not in ("unknown", "abc1234")  # this checkout has git: git's commit wins
    for s in check["steps"]:
        assert {"status", "reason", "seconds", "cap_s", "command", "files"} <= s.keys()


@pytest.mark.system
def test_bench_files_are_named_after_their_step_and_their_figures_are_read(smoke_run):
    out, check, proc, _ = smoke_run
    steps = {s["name"]: s for s in check["steps"]}
    stem_tail = f"{check['slug']}-{check['date'][:10].replace('-', '')}"
    assert steps["decoder"]["files"] == [f"decoder-{stem_tail}.json"]
    assert steps["generate_short"]["files"] == [f"generate_short-{stem_tail}.json"]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [f"decoder-{stem_tail}.json", f"generate_short-{stem_tail}.json", f"gpu_check-{stem_tail}.json",
         f"gpu_check-{stem_tail}.md"])
    assert json.loads((out / f"decoder-{stem_tail}.json").read_text())["benchmark"] == "decoder"
    assert json.loads((out / f"decoder-{stem_tail}.json").read_text())["commit"] == check["commit"]
    wanted = [g.figure for g in gpu_check.GOALS if g.step in ("decoder", "generate_short")]
    assert [f["figure"] for f in check["figures"]] == wanted  # only the goals of the steps that were asked for
    for f in check["figures"]:  # each extractor found its figure in the smoke JSON (a renamed key would show here)
        assert f["value"] is not None and f["result"] == "n/a (smoke)", f
    md = (out / f"gpu_check-{stem_tail}.md").read_text()
    assert "| figure | goal | measured | pass/fail |" in md
    for f in check["figures"]:
        assert f"| {f['figure']} | {f['goal']} | {f['measured']} | n/a (smoke) |" in md
    for s in check["steps"]:
        assert f"| {s['name']} | {s['status']} | " in md
    assert "not run for want of budget: too_long" in proc.stdout
    # the next call's budget is named: the step's cap and this run's set-up, in minutes rounded up
    need = re.search(r"--steps too_long --budget-min ([0-9.]+) --out DIR", proc.stdout)
    assert need and 100000 / 60 < float(need.group(1)) < 100000 / 60 + 2, proc.stdout[-600:]
    assert "set-up took" in steps["too_long"]["reason"]


@pytest.mark.system
def test_folding_and_merging_round_trip(smoke_run, tmp_path):
    out, check, _, _ = smoke_run
    name = next(out.glob("gpu_check-*.json")).name
    folded = merge([out / name], tmp_path / "folded", gpu_check.GOALS, fold="always")
    assert sorted(p.name for p in folded.parent.iterdir()) == sorted([name, name.replace(".json", ".md")])
    again = merge([folded], tmp_path / "unfolded", gpu_check.GOALS)
    for s in check["steps"]:
        for f in s["files"]:  # every bench JSON back, byte for byte
            assert (tmp_path / "unfolded" / f).read_text() == (out / f).read_text()
    assert json.loads(again.read_text())["figures"] == check["figures"]
    # two calls' checks: a later run of a step replaces an earlier one, a skip never replaces a run
    first = json.loads((out / name).read_text())
    second = dict(first, steps=[dict(s, status="skipped", reason="budget", files=[]) for s in first["steps"]])
    (tmp_path / "call2").mkdir()
    (tmp_path / "call2" / name).write_text(json.dumps(second))
    both = json.loads(merge([out / name, tmp_path / "call2" / name], tmp_path / "both", gpu_check.GOALS).read_text())
    assert [s["status"] for s in both["steps"]] == [s["status"] for s in first["steps"]]
    assert both["figures"] == check["figures"] and both["budget_min"] == 2 * first["budget_min"]


def test_more_files_than_a_lent_machine_returns_fold_into_the_check(tmp_path):
    check = {"steps": [], "folded": False, "smoke": False, "slug": "x", "date": "2026-01-01T00:00:00+00:00",
             "device": {"device": "cpu"}, "commit": "c", "budget_min": 9, "elapsed_s": 1, "command": "python x"}
    for i in range(7):
        (tmp_path / f"s{i}-x-20260101.json").write_text(json.dumps({"i": i}))
        check["steps"].append({"name": f"s{i}", "status": "ok", "reason": "", "seconds": 1, "cap_s": 2, "command": "c",
                               "files": [f"s{i}-x-20260101.json"]})
        write_check(tmp_path, check, {}, gpu_check.GOALS, "auto")
        assert check["folded"] == (i + 1 + 2 > 8)  # seven bench JSONs and the check's two files do not fit in 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check-x-20260101.json", "gpu_check-x-20260101.md"]
    assert json.loads((tmp_path / "gpu_check-x-20260101.json").read_text())["steps"][6]["folded"] == {
        "s6-x-20260101.json": json.dumps({"i": 6})}


def test_a_stopped_check_stops_its_step_and_still_writes_its_results(tmp_path):
    running = tmp_path / "sleeper_running"  # the step's command writes it once it runs
    argv = [sys.executable, SCRIPT, "--out", str(tmp_path / "out"), "--steps", "sleeper", "later",
            "--add-step", "sleeper", "300",
            f"python -c 'import pathlib, time; pathlib.Path(\"{running}\").touch(); time.sleep(300)'",
            "--add-step", "later", "60", "python -c pass"]
    proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300  # a bound on a hang only
    while not running.exists():  # the step is running: the SIGTERM stops a running step
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    seen = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130 and "[1/2] sleeper: " in seen, seen
    check = json.loads(next((tmp_path / "out").glob("gpu_check-*.json")).read_text())
    assert [(s["name"], s["status"]) for s in check["steps"]] == [("sleeper", "interrupted"), ("later", "skipped")]
    assert check["steps"][0]["reason"] == "stopped by SIGTERM"
    assert check["steps"][1]["reason"] == "gpu_check was stopped (stopped by SIGTERM)"


def test_a_failure_reads_as_its_exception_or_its_last_meaningful_lines():
    chained = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n    f()\n"
               "KeyError: 'a'\n\nDuring handling of the above exception, another exception occurred:\n\n"
               "Traceback (most recent call last):\n  File \"x.py\", line 3, in <module>\n"
               "ValueError: the one that ended it\n  (a note)\n")
    assert failure_lines(chained) == ["ValueError: the one that ended it"]
    cli = "2026 WARNING something noisy\n\x1b[31merror: data.path 'x' matches no file; pass a glob\x1b[0m\n\n"
    assert failure_lines(cli) == ["error: data.path 'x' matches no file; pass a glob"]
    assert failure_lines("".join(f"line {i}\n" for i in range(9))) == [f"line {i}" for i in range(4, 9)]


def test_the_shim_gives_numpy_row_stack_back_and_runs_the_sitecustomize_it_shadows(tmp_path):
    fake = tmp_path / "fake" / "numpy"  # a numpy 2.5 without row_stack
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("def vstack(arrays):\n    return arrays\n")
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['SHADOWED_SITECUSTOMIZE'] = 'ran'\n")
    env = step_env(make_site(tmp_path / "site"), REPO)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), str(tmp_path / "fake"), str(other)])
    probe = "import numpy, os; print(numpy.row_stack is numpy.vstack, os.environ.get('SHADOWED_SITECUSTOMIZE'))"
    got = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert got.stdout.split() == ["True", "ran"], got.stderr


def test_steps_are_selected_by_name_or_group_in_the_order_given():
    names = lambda steps: [s.name for s in steps]  # noqa: E731
    assert names(gpu_check.select(["headline"], [], {})) == gpu_check.GROUPS["headline"]
    assert names(gpu_check.select(["headline"], ["gpu_tests", "sweep"], {}))[:2] == ["decoder", "generate_short"]
    assert names(gpu_check.select(["fsdp", "decoder"], [], {})) == ["fsdp", "decoder"]
    assert names(gpu_check.select(["all"], ["more"], {})) == gpu_check.GROUPS["headline"] + gpu_check.GROUPS["pipeline"]
    with pytest.raises(SystemExit, match="error: no step 'decodr'; steps: gpu_tests, decoder"):
        gpu_check.select(["decodr"], [], {})
    assert gpu_check.GROUPS["headline"] == ["gpu_tests", "decoder", "generate_short", "decode_profile",
                                            "generate_long", "generate_resonance"]
    assert gpu_check.GROUPS["pipeline"] == ["default_run", "sweep"]


def test_the_headline_fits_nine_minutes_and_with_the_default_run_a_lent_machines_fifteen():
    """A lent GPU gives a session 15 minutes, start-up included: the decoder's steps must fit ~9 of them by their
    caps, and the default run after them; the sweep is left for a call of its own."""
    caps = {s.name: s.cap_s for s in gpu_check.STEPS}
    headline = sum(caps[n] for n in gpu_check.GROUPS["headline"])
    assert headline <= 9 * 60
    assert headline + caps["default_run"] + 30 <= 14 * 60  # + set-up; a minute or so left for the start


def test_the_ray_site_is_packed_here_from_pinned_wheels_for_the_machines_python(tmp_path, monkeypatch):
    """bench/gpu_site.py (gpu_check --pack): pip downloads exact versions for CPython 3.12 on x86-64 and installs them
    into a folder; a failed download is one clear error naming where it must run; an oversized tarball is refused.
    pip is stood in for here (no network in the tests)."""
    from bench import gpu_site

    download, install = gpu_site.pip_commands(tmp_path / "whl", tmp_path / "site")
    pinned = [w for w in download if "==" in w]
    assert pinned == gpu_site.PACKAGES and all(re.fullmatch(r"[\w.]+==[\w.]+", w) for w in pinned)
    assert {"ray==2.60.0", "mlflow==3.17.2"} <= set(pinned) and "--no-deps" in download
    assert download[download.index("--python-version") + 1] == "3.12" and "cp312" in download
    assert "--target" in install and "--no-index" in install

    def fake_pip(cmd, **kw):
        if cmd[3] == "install":
            site = Path(cmd[cmd.index("--target") + 1])
            (site / "bin").mkdir(parents=True)
            (site / "bin" / "ray").write_text("#!/some/venv/bin/python3.11\nimport ray\n")
            (site / "ray" / "jars").mkdir(parents=True)
            (site / "ray" / "jars" / "big.jar").write_bytes(b"x" * 1000)
            (site / "ray" / "__init__.py").write_text("")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(gpu_site.subprocess, "run", fake_pip)
    out = gpu_site.pack(tmp_path / ".gpu")
    import tarfile
    with tarfile.open(out) as tar:
        names = tar.getnames()
        assert "ray/__init__.py" in names and not any("jars" in n for n in names)
        assert tar.extractfile("bin/ray").read().startswith(b"#!/usr/bin/env python3\n")
    monkeypatch.setattr(gpu_site, "LIMIT_BYTES", 10)
    with pytest.raises(RuntimeError, match="over the 0 MiB"):
        gpu_site.pack(tmp_path / "again")
    monkeypatch.setattr(gpu_site.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution"))
    with pytest.raises(RuntimeError, match="pip download failed .* needs PyPI, from here"):
        gpu_site.pack(tmp_path / "offline")
    reason = gpu_check.skip_reason(next(s for s in gpu_check.STEPS if s.name == "sweep"), {"modules": {}}, False)
    assert "python bench/gpu_check.py --pack" in reason


def test_every_goal_names_a_step_and_the_docs_show_every_step():
    steps = {s.name: s for s in gpu_check.STEPS}
    assert {g.step for g in gpu_check.GOALS} <= set(steps)
    assert len({s.name for s in gpu_check.STEPS}) == len(gpu_check.STEPS)
    section = (REPO / "docs" / "benchmarks.md").read_text().split("## Verifying a GPU: bench/gpu_check.py")[1]
    for s in gpu_check.STEPS:  # the table of steps: name, the command a user runs by hand, its goals
        assert f"| `{s.name}` |" in section and f"`{s.command}`" in section, s.name
    assert "mkdir -p /tmp/site" not in (REPO / "docs" / "benchmarks.md").read_text()  # no hand-set environment left


def test_the_goals_read_the_h100_results_committed_in_their_formats():
    """The extractors against real GPU JSONs (bench/results/, hermetic): each reads what the file holds, and a
    figure its format lacks is not measured rather than guessed."""
    res = REPO / "bench" / "results"
    goals = {g.figure: g for g in gpu_check.GOALS}
    mixer = json.loads((res / "mixer-nvidia-h100-80gb-hbm3-20261124.json").read_text())
    at_32k = next(r for r in mixer["ratios"] if r["seq_len"] == 32768)
    ratio = goals["resonance / attention training tokens/s at 32k"]
    assert measure_goal(ratio, mixer, exact=True) == at_32k["train_tokens_per_s"]
    assert measure_goal(goals["resonance trains at 131,072 tokens"], mixer, exact=True) == "oom"
    speed = json.loads((res / "train_speed-nvidia-h100-80gb-hbm3-20261123.json").read_text())
    flex_web = [r["mfu"] for r in speed["rows"] if (r["tier"], r["seq_len"], r["doc_len"], r["status"]) ==
                ("B", 32768, "web", "ok") and r["doc_masking"]]
    assert measure_goal(goals["tier B executed MFU at 32k, doc-masked, web documents"], speed,
                                  exact=True) == max(flex_web)
    # generate_B of 2026-11-24 predates prompt lengths in its rows: the goal at a 32-token prompt is not measured
    old = json.loads((res / "generate_B-nvidia-h100-80gb-hbm3-20261124.json").read_text())
    assert "prompt_len" not in old["rows"][0]
    assert measure_goal(goals["tier B decode tokens/s, batch 1, 32-token prompt"], old, exact=True) is None


def test_a_sweep_stopped_before_its_table_counts_the_trials_its_lines_said_had_ended():
    """The H100 sweep of 2026-11-27, stopped at its cap in its third trial (its stdout, committed): one trial
    finished and one stopped early are read from the `tune: trial` lines; the sweep's wall time is not measured."""
    from bench.gpu_report import sweep_record

    log = REPO / "bench" / "results" / "logs-nvidia-h100-80gb-hbm3-20261127" / "sweep.stdout.log"
    rec = sweep_record(log.read_text(), 266.0)
    assert rec["complete"] is False and rec["wall_s"] is None
    assert [(t["trial"], t["status"]) for t in rec["trials"]] == [("5ffa7_00000", "ok"), ("5ffa7_00001", "stopped")]
    goals = {g.figure: g for g in gpu_check.GOALS}
    assert measure_goal(goals["sweep trials that trained to the end"], rec, exact=True) == 1
    assert measure_goal(goals["sweep wall time (s)"], rec, exact=True) is None
    table = "| tier | batch | status |\n|---|---|---|\n| A | 1 | ok |\n| A | 2 | stopped (asha) |\n\nbest: x\n"
    whole = sweep_record(table, 300.0)
    assert whole["complete"] is True and whole["wall_s"] == 300.0 and whole["best"] == "x"
    assert [t["status"] for t in whole["trials"]] == ["ok", "stopped"]
