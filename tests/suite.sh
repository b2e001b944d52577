#!/usr/bin/env bash
# The whole test suite, what CI runs (.ci/run, after .ci/browser.sh): every test but the `exclusive` ones on 2 pytest
# processes (pytest-xdist, a test file's tests on one process, so its module set-up runs once, and the files that share
# a costly session fixture on one process together: tests/file_order.py GROUPS), then the `exclusive`
# ones (tests/pipeline/test_busy_machine.py: their CPU hogs would starve a test beside them) by themselves.
# Each file's seconds go to $TMPDIR/longtrain-file-seconds.json (copy it over tests/slow_files.json to refresh the
# order, tests/file_order.py; `=PATH`, one argument: as two, a PATH already there from an earlier run is taken for a
# test path, pytest roots the run in its folder and never reads tests/conftest.py). docs/tests.md has the tiers, their
# times and why. Extra arguments go to both runs.
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
[ -x "$py" ] || py=python3
"$py" -m pytest -q -n 2 --dist loadfile -m "not exclusive" --durations=15 \
    --record-file-seconds="${TMPDIR:-/tmp}/longtrain-file-seconds.json" "$@"
"$py" -m pytest -q -m exclusive --durations=5 "$@"
