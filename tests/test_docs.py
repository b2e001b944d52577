"""The commands in README.md and docs/*.md still work: every `python pipeline/run.py ...` line of a code block or
inline code goes through the CLI's argument parser and config loading (and its space file, when it names one)
without running; every other `python` command (benchmarks, `python -m ...`) through its own argument parser; the
console examples that show an error print exactly that error; `python -m model` runs; and the README stays short.

    .venv/bin/python -m pytest -q tests/test_docs.py
"""
from __future__ import annotations

import argparse
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.cli.train import REAL_CORPUS_COMMAND

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 300
# Words that stand for something the reader fills in: such an argument is parsed, never opened.
PLACEHOLDER = re.compile(r"<[^>]*>|\b(DIR|RUN|FILE|NAME|PATH)\b")


def _blocks(text: str) -> list[tuple[str, list[str]]]:
    """(language, lines) of every fenced code block."""
    out, lang, lines = [], None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if lang is None:
                lang, lines = line[3:].strip(), []
            else:
                out.append((lang, lines))
                lang = None
        elif lang is not None:
            lines.append(line)
    return out


def _commands(text: str) -> list[tuple[str, str | None]]:
    """(command, the error line shown after it or None) for every command a reader is shown: lines of shell code
    blocks (continuations joined, `$ ` prompts and `VAR=value` prefixes dropped) and inline code that starts with
    python; `ray job submit ... -- CMD` gives CMD."""
    found: list[tuple[str, str | None]] = []
    for lang, lines in _blocks(text):
        if lang not in ("", "bash", "sh", "console", "shell"):
            continue
        joined: list[str] = []
        for line in lines:
            if joined and joined[-1].endswith("\\"):
                joined[-1] = joined[-1][:-1] + " " + line.strip()
            else:
                joined.append(line)
        for i, line in enumerate(joined):
            cmd = line[2:] if line.startswith("$ ") else line
            nxt = joined[i + 1] if i + 1 < len(joined) else ""
            found.append((cmd, nxt if line.startswith("$ ") and nxt.startswith("error: ") else None))
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    found += [(" ".join(m.split()), None) for m in re.findall(r"`((?:python3?|\.venv/bin/python) [^`]+)`", prose)]
    out = []
    for cmd, error in found:
        cmd = cmd.split(" && ")[-1]  # the install commands end with the one to run
        if " -- " in cmd and "ray job submit" in cmd:
            cmd = cmd.split(" -- ", 1)[1]
        try:
            words = shlex.split(cmd, comments=True) if cmd.strip() else []
        except ValueError:  # an output line shown in a console block ("the space's params"), not a command
            if re.match(r"\s*([A-Z_]+=\S*\s+)*(\.venv/bin/)?python", cmd):
                raise
            continue
        for j, w in enumerate(words):  # a redirection or a pipe ends the command
            if re.match(r"\d?>|\||<", w):
                words = words[:j]
                break
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            words = words[1:]
        if words and re.fullmatch(r"(\.venv/bin/)?python3?", words[0]) and "$" not in cmd:
            out.append((shlex.join(words[1:]), error))
    return out


ALL = sorted({(doc.name, cmd, err) for doc in DOCS for cmd, err in _commands(doc.read_text())},
             key=lambda c: (c[0], c[1], c[2] or ""))
# and the command a run sized to the built-in corpus prints at its end
PRINTED = [("pipeline/run.py's console", REAL_CORPUS_COMMAND.split(" ", 1)[1], None)]
RUN_PY = [c for c in ALL if c[1].startswith("pipeline/run.py")] + PRINTED
OTHER = [c for c in ALL if not c[1].startswith(("pipeline/run.py", "-m pytest", "../shared/"))]


def test_the_readme_is_short_and_every_doc_it_links_exists():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    links = re.findall(r"\]\((docs/[^)#]+)", text)
    assert {ROOT / link for link in links} == set(DOCS[1:]), "README.md links one line to every docs/*.md"
    assert len(RUN_PY) >= 30 and len(OTHER) >= 10  # the extraction finds the commands (a format change would not)


@pytest.mark.parametrize("doc, command, error", RUN_PY, ids=[f"{c[0]}: {c[1]}" for c in RUN_PY])
def test_every_pipeline_command_parses_and_loads_its_config(doc, command, error, capsys):
    from pipeline.config import ConfigError, field_types
    from pipeline.run import build_config, main, parse_args
    from pipeline.sweep.space import load_space

    argv = shlex.split(command)[1:]
    if "--help" in argv:
        with pytest.raises(SystemExit) as done:
            parse_args(argv)
        out = capsys.readouterr().out
        assert done.value.code == 0 and all(f"\n  {f} " in out for f in field_types())  # every field, one line each
        return
    args, rest = parse_args(argv)
    # Hermetic: a documented file is one the repository holds (or a placeholder the reader fills in), never one a
    # line before it writes somewhere else: such a file existed only on the machine that once ran that line.
    for flag in ("space", "preset", "phases", "prompts_file"):
        value = getattr(args, flag, None)
        if value and not PLACEHOLDER.search(value) and (value.endswith((".yaml", ".yml", ".json", ".txt"))
                                                        or "/" in value):
            assert not Path(value).is_absolute() and (ROOT / value).resolve().is_relative_to(ROOT), (
                f"{doc}: `python {command}` names {value}, outside the repository: commit the file (tune_spaces/ "
                f"for a space) and name it by its path in the repository")
    if args.preset and PLACEHOLDER.search(args.preset):
        args.preset = None  # a preset the reader's own sweep writes (runs/tune/<sweep>/best_preset.yaml)
    try:
        cfg = build_config(args, rest)
    except ConfigError as exc:
        if error is None:
            pytest.fail(f"{doc}: `python {command}`: {exc}")
        # a console example of a bad command line: this exact line on stderr, exit code 2
        assert main(argv) == 2 and capsys.readouterr().err.strip() == error
        return
    # (an example whose error comes from its data, not its command line, needs that data: its command is checked)
    if args.space:
        load_space(ROOT / args.space, cfg)


def _parse_only(words: list[str]) -> argparse.Namespace:
    """Run `python WORDS` up to its argument parser, then stop: the parsed arguments, or SystemExit from argparse."""

    class Parsed(Exception):
        pass

    real = argparse.ArgumentParser.parse_known_args

    def parse_and_stop(self, args=None, namespace=None):
        raise Parsed(real(self, args, namespace)[0])

    argv = sys.argv
    try:
        argparse.ArgumentParser.parse_known_args = parse_and_stop
        if words[0] == "-m":
            sys.argv = [words[1], *words[2:]]
            runpy.run_module(words[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = words
            runpy.run_path(str(ROOT / words[0]), run_name="__main__")
    except Parsed as parsed:
        return parsed.args[0]
    finally:
        argparse.ArgumentParser.parse_known_args = real
        sys.argv = argv
    pytest.fail(f"`python {shlex.join(words)}` did not parse its arguments with argparse")


@pytest.mark.parametrize("doc, command, error", OTHER, ids=[f"{c[0]}: {c[1]}" for c in OTHER])
def test_every_other_python_command_parses_its_arguments(doc, command, error):
    words = shlex.split(command)
    _parse_only(words)  # argparse exits 2 on an argument the script no longer takes


def test_python_m_model_runs(capsys):
    from model.__main__ import main

    main([])
    out = capsys.readouterr().out
    assert all(re.search(rf"\b{tier}\b", out) for tier in ("nano", "A", "B", "C", "D"))


def test_the_phases_example_loads(tmp_path):
    from pipeline.config import load_config
    from pipeline.train.session.train_session import load_phases

    examples = [yaml.safe_load("\n".join(lines)) for doc in DOCS for lang, lines in _blocks(doc.read_text())
                if lang == "yaml"]
    phases = [e for e in examples if isinstance(e, list) and e and all(isinstance(p, dict) and "steps" in p for p in e)]
    assert phases
    for i, example in enumerate(phases):
        path = tmp_path / f"phases-{i}.yaml"
        path.write_text(yaml.safe_dump(example))
        assert [p.steps for p in load_phases(str(path), load_config("cpu"))] == [p["steps"] for p in example]


NUMBER_WORDS = {2: "Two", 3: "Three", 4: "Four", 5: "Five", 6: "Six", 7: "Seven", 8: "Eight"}


def test_the_docs_counts_are_true():
    """docs/sweeps.md said "three ship" beside four space files: the count, the table and tune_spaces/ agree, and
    the presets table of docs/configuration.md lists exactly the built-in presets."""
    from pipeline.config import PRESETS

    spaces = sorted(p.name for p in (ROOT / "tune_spaces").glob("*.yaml"))
    sweeps = (ROOT / "docs" / "sweeps.md").read_text()
    assert f"{NUMBER_WORDS[len(spaces)]} ship with the project" in sweeps
    assert sorted(re.findall(r"^\| `tune_spaces/([\w.]+)` \|", sweeps, re.M)) == spaces
    configuration = (ROOT / "docs" / "configuration.md").read_text()
    presets = configuration.split("## Presets", 1)[1].split("\n## ", 1)[0]
    assert sorted(re.findall(r"^\| `([\w-]+)` \|", presets, re.M)) == sorted(PRESETS)


def test_one_checkpoint_layout_is_shared_by_run_py_the_hints_and_the_docs(tmp_path):
    """Checkpoint paths used to appear in three layouts (runs/<run>/checkpoint in run.py's docstring,
    runs/<run>/checkpoints/step_000100 in an error's hint, another in docs/export.md), none of them the Ray
    layout. Now pipeline/train/session/run_dir.py's LAYOUT is quoted whole by run.py's docstring and docs/training.md, the
    "which checkpoint?" errors end with its CHECKPOINT_HINT, and every runs/<run>/... path anywhere follows it."""
    import textwrap

    import pipeline.run
    from pipeline.train.engine import CheckpointError, read_checkpoint_meta
    from pipeline.train.session.run_dir import CHECKPOINT_HINT, LAYOUT

    assert textwrap.indent(LAYOUT, "    ") in pipeline.run.__doc__
    assert f"```text\n{LAYOUT}\n```" in (ROOT / "docs" / "training.md").read_text()
    with pytest.raises(CheckpointError) as err:
        read_checkpoint_meta(tmp_path)
    assert str(err.value).endswith(CHECKPOINT_HINT)
    sources = [*DOCS, *sorted((ROOT / "pipeline").rglob("*.py"))]
    paths = {m for f in sources for m in re.findall(r"runs/<run>/([\w<>./-]*)", f.read_text())}
    follows = re.compile(r"(run\.json|ray(/phase(<i>|\d)(/checkpoint_(<time>|…)/?)?)?/?|"
                         r"checkpoints/phase(<i>|\d)/step_(<NNNNNN>|\d{6})/?|data_audit/?|hf_model|)")
    assert sorted(p for p in paths if not follows.fullmatch(p)) == []


# Files named in docstrings that live outside this repository, with where they are: an external name is listed here on
# purpose, so that a module of ours that is renamed or removed cannot pass as someone else's file.
EXTERNAL_FILES = {
    "sitecustomize.py": "Python's site module imports it at start-up",
    "setup_worker.py": "Ray's ray/_private/workers/setup_worker.py",
    "generate/base.py": "litgpt's generate/base.py",
    "modeling_rope_utils.py": "transformers' models' RoPE utilities",
    "/pipeline/run.py": "<a checkout>/pipeline/run.py, of this repository",
    "examples/minhash_deduplication.py": "datatrove's example of FineWeb's MinHash recipe",
}
_PY_NAME = re.compile(r"(?<![\w./-])([\w./-]*\w\.py)\b")


def _docstrings(path: Path):
    import ast

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                yield node, doc


def test_every_module_a_docstring_names_exists():
    """A docstring that names a file of ours (`pipeline/train/checkpoints/index.py`, or a bare `loop.py`) names one
    that exists: by its path from the repository's root or from its room, or, bare, by its file name. A file of
    another project is named in EXTERNAL_FILES or found in an installed package."""
    import sysconfig

    ours = {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py")
            if not {".venv", ".git", ".tmp"} & set(p.relative_to(ROOT).parts)}
    names = {Path(p).name for p in ours}
    site = Path(sysconfig.get_paths()["purelib"])
    stale = []
    for path in sorted(ROOT.joinpath(d) for d in ("pipeline", "model", "cuda_ops", "bench", "tests")):
        for source in sorted(path.rglob("*.py")):
            for node, doc in _docstrings(source):
                for name in _PY_NAME.findall(doc):
                    if name in EXTERNAL_FILES or (site / name).exists():
                        continue
                    if ("/" in name and not any(p == name or p.endswith("/" + name) for p in ours)) or \
                            ("/" not in name and name not in names):
                        where = getattr(node, "name", "the module")
                        stale.append(f"{source.relative_to(ROOT)} ({where}): {name}")
    assert not stale, "docstrings name modules that do not exist:\n" + "\n".join(stale)


# A metric name: a stage prefix, a slash, then no spaces (prose that mentions one, "train/data_wait reading ...", is
# not a name). The families names.py builds (`{prefix}/loss`, `{prefix}/pos_loss/{bucket}`) are found in f-strings.
_METRIC = re.compile(r"^(train|val|eval|passkey|sweep|dedup|mixture|system|eval_\d+x)/\S*$")
_FAMILY = re.compile(r"\{\}/(\{\}/)?(loss|ppl|accuracy|bpb|rows|pos_loss|pos_docs|pos_tokens|cum_ppl)(/|$)")


def _string_literals(tree) -> list[tuple[int, str]]:
    """(line, text) of every string in the code that is not a docstring; an f-string as its literal parts with `{}`
    for each value."""
    import ast

    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    found, parts = [], set()
    for n in ast.walk(tree):
        if isinstance(n, ast.JoinedStr):
            parts.update(id(v) for v in n.values)
            found.append((n.lineno, "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in n.values)))
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs | parts:
            found.append((n.lineno, n.value))
    return found


def test_metric_names_are_spelled_only_in_names_py():
    """pipeline/tracking/names.py is the one spelling of every metric name: the engine, the loop, evaluation, sweeps
    and benchmarks use its constants and functions, so a rename cannot miss a place."""
    import ast

    names_py = ROOT / "pipeline" / "tracking" / "names.py"
    written = []
    for room in ("pipeline", "model", "cuda_ops", "bench"):
        for source in sorted((ROOT / room).rglob("*.py")):
            if source == names_py:
                continue
            for line, text in _string_literals(ast.parse(source.read_text())):
                if _METRIC.match(text) or _FAMILY.search(text):
                    written.append(f"{source.relative_to(ROOT)}:{line}: {text!r}")
    assert not written, "metric names written outside pipeline/tracking/names.py:\n" + "\n".join(written)


def test_a_metric_name_written_out_is_found():
    """The check above is not blind: a metric name and a family written in a module are both found."""
    import ast

    code = 'LOSS = "val/loss"\nx = f"{prefix}/pos_loss/{b}"\n"""train/loss in a docstring is prose"""\n'
    hits = [t for _, t in _string_literals(ast.parse(code)) if _METRIC.match(t) or _FAMILY.search(t)]
    assert hits == ["{}/pos_loss/{}", "val/loss"]


def test_the_docs_stand_alone():
    """No doc, README or docstring points outside the repository: no relative link that leaves it, no design
    document or shared folder beside the checkout (what was decided is written in docs/design.md)."""
    outside = []
    for doc in DOCS:
        text = doc.read_text()
        for target in re.findall(r"\]\(([^)#\s]+)", text):
            if "://" in target or target.startswith("mailto:"):
                continue
            resolved = (doc.parent / target).resolve()
            if ROOT not in resolved.parents and resolved != ROOT:
                outside.append(f"{doc.relative_to(ROOT)}: link {target}")
        outside += [f"{doc.relative_to(ROOT)}: {m}" for m in re.findall(r"\.\./shared\S*|\bDESIGN\.md\b", text)]
    for room in ("pipeline", "model", "cuda_ops", "bench", "tests"):
        for source in sorted((ROOT / room).rglob("*.py")):
            if source == Path(__file__).resolve():
                continue
            for m in re.findall(r"\.\./shared\S*|\bDESIGN\.md\b", source.read_text()):
                outside.append(f"{source.relative_to(ROOT)}: {m}")
    assert not outside, "points outside the repository:\n" + "\n".join(outside)
