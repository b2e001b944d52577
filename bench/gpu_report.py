"""bench/gpu_check.py's report: what each step measured (its bench JSON, pytest's JUnit XML, the console of the
default run or the sweep), every figure against its goal, and the check's JSON and markdown table; --merge.

The goals themselves are data in bench/gpu_check.py (GOALS): a figure, its step, how to read it from that step's
record, and its goal. A figure the record lacks is "not measured", never a number made up.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

MAX_FILES = 8  # what a lent GPU machine returns from $OUT


@dataclass(frozen=True)
class Check:
    text: str                                   # the goal as the table shows it
    ok: Callable[[Any], bool] | None = None     # None: a figure shown without a goal


def at_least(x: float, unit: str = "") -> Check:
    return Check(f"≥ {x:,g}{unit}", lambda v: v >= x)


def at_most(x: float, unit: str = "") -> Check:
    return Check(f"≤ {x:,g}{unit}", lambda v: v <= x)


def between(lo: float, hi: float) -> Check:
    return Check(f"{lo:g} to {hi:g}", lambda v: lo <= v <= hi)


def exactly(x: float) -> Check:
    return Check(f"= {x:,g}", lambda v: v == x)


def equals(x: str) -> Check:
    return Check(x, lambda v: v == x)


INFO = Check("—")


@dataclass(frozen=True)
class Goal:
    figure: str
    step: str
    value: Callable[[dict, bool], Any]  # (the step's record, exact shapes?) -> the figure
    check: Check
    fmt: str = "{:,.2f}"


def measure_goal(goal: Goal, record: dict | None, exact: bool) -> Any:
    """The figure, or None when the record lacks it (a step that did not run, a JSON without that row or key)."""
    if record is None:
        return None
    try:
        return goal.value(record, exact)
    except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError, AttributeError, StopIteration):
        return None


# ------------------------------------------------------------------------------------------- what a step measured
def pytest_record(junit: Path) -> dict:
    """Counts from pytest's --junitxml file."""
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    return {"tests": n["tests"], "passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"],
            "failed": n["failures"], "errors": n["errors"], "skipped": n["skipped"]}


def default_run_record(stdout: str, stderr: str, seconds: float) -> dict:
    """What the default run's console says: how long it is (both streams), its final eval loss, its sizing lines."""
    lines = stdout.splitlines() + stderr.splitlines()
    losses = [float(m.group(1)) for ln in lines if ln.startswith("eval: ")
              for m in [re.search(r"loss=([0-9.]+)", ln)] if m]
    rec = {"console_lines": len(lines), "wall_s": round(seconds, 1),
           "size_lines": [ln for ln in lines if ln.startswith("size:")]}
    if losses:
        rec["final_eval_loss"] = losses[-1]
    return rec


_TRIAL_LINE = re.compile(r"^tune: trial (\S+) (finished|stopped early by the scheduler|failed): (.*?)  \[")


def sweep_record(stdout: str, seconds: float) -> dict:
    """The trial table `python pipeline/run.py tune` prints (markdown) as rows, and its `best:` line. A sweep stopped
    before its table (gpu_check's cap) gives the trials its `tune: trial ... finished|stopped early|failed` lines
    said had ended, "complete": false and no wall time (the sweep's was not measured)."""
    lines = stdout.splitlines()
    trials: list[dict] = []
    head = None
    for ln in lines:
        if ln.startswith("| tier |"):
            head, trials = [c.strip() for c in ln.strip().strip("|").split("|")], []
        elif head and ln.startswith("|") and not ln.startswith("|---"):
            cells = [c.strip() for c in ln.strip().strip("|").split("|")]
            if len(cells) == len(head):
                row = dict(zip(head, cells))
                row["status"] = row.get("status", "").split(" ")[0]  # "stopped (reason)" -> stopped
                trials.append(row)
        elif head and not ln.startswith("|"):
            head = None
    best = [ln[len("best: "):] for ln in lines if ln.startswith("best: ")]
    if trials or best:
        return {"trials": trials, "wall_s": round(seconds, 1), "complete": True, **({"best": best[-1]} if best else {})}
    ended = [m.groups() for m in map(_TRIAL_LINE.match, lines) if m]
    status = {"finished": "ok", "stopped early by the scheduler": "stopped", "failed": "failed"}
    return {"trials": [{"trial": t, "status": status[what], "result": rest} for t, what, rest in ended],
            "wall_s": None, "complete": False}


# ------------------------------------------------------------------------------------------------------ the report
def _show(goal: Goal, value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return goal.fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def figures(goals: list[Goal], steps: list[dict], records: dict[str, dict], smoke: bool) -> list[dict]:
    """Every goal of a step in this check: the figure read from that step's record, against its goal."""
    by_name = {s["name"]: s for s in steps}
    rows = []
    for goal in goals:
        step = by_name.get(goal.step)
        if step is None:
            continue
        value = measure_goal(goal, records.get(goal.step), exact=not smoke)
        if value is None:
            shown = "not measured" + ("" if step["status"] == "ok" else f" ({step['status']})")
            result = "not measured"
        else:
            shown = _show(goal, value)
            try:
                passed = goal.check.ok(value) if goal.check.ok else None
            except TypeError:  # "oom" where a number was due
                passed = False
            result = "n/a (smoke)" if smoke else "—" if passed is None else "pass" if passed else "FAIL"
        rows.append({"figure": goal.figure, "goal": goal.check.text, "step": goal.step, "value": value,
                     "measured": shown, "result": result})
    return rows


def markdown(check: dict) -> str:
    """The figure | goal | measured | pass/fail table, then the steps."""
    dev = check["device"]
    lines = [f"# gpu_check: {dev.get('gpu', dev.get('device', 'unknown'))}, {check['date'][:10]}, "
             f"commit {check['commit']}", ""]
    if check["smoke"]:
        lines += ["`--smoke`: every step at its smallest on this machine, to test the plumbing; the figures are at "
                  "smoke shapes and say nothing against the goals.", ""]
    lines += [f"Budget {check['budget_min']:g} min, {check['elapsed_s']:.0f} s used: `{check['command']}`", "",
              "| figure | goal | measured | pass/fail |", "|---|---|---|---|"]
    lines += [f"| {f['figure']} | {f['goal']} | {f['measured']} | {f['result']} |" for f in check["figures"]]
    lines += ["", "| step | status | seconds | cap (s) | command | files; reason |", "|---|---|---|---|---|---|"]
    for s in check["steps"]:
        what = "; ".join(x for x in (", ".join(s["files"]), s["reason"]) if x).replace("|", "\\|")
        lines.append(f"| {s['name']} | {s['status']} | {s['seconds']:.0f} | {s['cap_s']:.0f} | `{s['command']}` | "
                     f"{what} |")
    return "\n".join(lines) + "\n"


def atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def check_stem(check: dict) -> str:
    return f"gpu_check-{check['slug']}-{check['date'][:10].replace('-', '')}"


def write_check(out: Path, check: dict, records: dict[str, dict], goals: list[Goal], fold: str) -> Path:
    """The figures, then the check's JSON and table, each written atomically. Folding (auto: when the files would
    outnumber what a lent machine returns) moves every bench file's text into its step in the check's JSON, all of
    them, so that --merge undoes it simply."""
    files = [f for s in check["steps"] for f in s["files"] if "folded" not in s]
    if fold == "always" or (fold == "auto" and (check["folded"] or len(files) + 2 > MAX_FILES)):
        check["folded"] = True
        for s in check["steps"]:
            if s["files"] and "folded" not in s:
                s["folded"] = {f: (out / f).read_text() for f in s["files"]}
                for f in s["files"]:
                    (out / f).unlink()
    check["figures"] = figures(goals, check["steps"], records, check["smoke"])
    path = out / f"{check_stem(check)}.json"
    atomic_write(path, json.dumps(check, indent=2, default=str) + "\n")
    atomic_write(out / f"{check_stem(check)}.md", markdown(check))
    return path


def merge(paths: list[Path], out: Path, goals: list[Goal], fold: str = "never") -> Path:
    """One check from the checks of several calls: every step of each (a later run of a step replaces an earlier
    one; a skip never replaces a run), their bench files (beside each check, or folded into it) written to `out`,
    the figures read again, one JSON and one table."""
    out.mkdir(parents=True, exist_ok=True)
    checks = [json.loads(p.read_text()) for p in paths]
    steps: dict[str, dict] = {}
    texts: dict[str, dict[str, str]] = {}
    for p, c in zip(paths, checks):
        for s in c["steps"]:
            if s["status"] == "skipped" and s["name"] in steps:
                continue
            s = dict(s)
            folded = s.pop("folded", None)
            texts[s["name"]] = folded if folded is not None else {
                f: (p.parent / f).read_text() for f in s["files"] if (p.parent / f).is_file()}
            steps[s["name"]] = s
    records = {}
    for name, files in texts.items():
        for f, text in files.items():
            atomic_write(out / f, text)
        first_json = next((t for f, t in files.items() if f.endswith(".json")), None)
        if first_json is not None:
            records[name] = json.loads(first_json)
        elif "record" in steps[name]:
            records[name] = steps[name]["record"]
    check = dict(checks[0], steps=list(steps.values()), folded=False, smoke=any(c["smoke"] for c in checks),
                 budget_min=sum(c["budget_min"] for c in checks), elapsed_s=sum(c["elapsed_s"] for c in checks),
                 command=" ; ".join(c["command"] for c in checks), merged_from=[p.name for p in paths],
                 commit=", ".join(dict.fromkeys(c["commit"] for c in checks)))
    return write_check(out, check, records, goals, fold)
