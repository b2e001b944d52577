#!/usr/bin/env bash
# The project's environment in .venv: Python's venv, torch 2.13.0 (the CPU build; any torch >= 2.10 works) and the
# project with its `dev` extra, what the main job and the tests need (a GPU node's install: README.md).
# pip is told not to byte-compile, because it compiles one file at a time; compileall then compiles the same
# site-packages on every core. On 2 cores: 134 s of pip, then 70 s, against 274 s for pip compiling (docs/tests.md).
# Without the compiled files, every process that imports torch, Ray or MLflow would compile them again where
# PYTHONDONTWRITEBYTECODE is set (20 CPU-s instead of 8 for each Ray worker).
set -euo pipefail
cd "$(dirname "$0")"
python3 -m venv .venv
.venv/bin/pip install -q --no-compile torch==2.13.0 -e '.[dev]'
# Its output is the few files that do not compile (templates and test data inside some packages), which pip's own
# compile step passes over silently too; so is its exit status.
.venv/bin/python -m compileall -q -j 0 .venv/lib/python3*/site-packages >/dev/null || true
