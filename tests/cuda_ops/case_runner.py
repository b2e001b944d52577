"""What every CUDA-simulator script of this package ends with: run its case_* functions, print one JSON line.

    if __name__ == "__main__":
        report_cases(globals())       # {case name: "ok" | traceback}, read by the test module that started the script
"""
from __future__ import annotations

import json
import traceback


def report_cases(namespace: dict) -> None:
    """Run every `case_*` callable of `namespace` (a script's globals) in name order and print {name: "ok" |
    traceback} as one JSON line; a failing case does not stop the others (the pytest side fails each separately)."""
    report = {}
    for name, fn in sorted(namespace.items()):
        if name.startswith("case_") and callable(fn):
            try:
                fn()
                report[name] = "ok"
            except Exception:
                report[name] = traceback.format_exc()
    print(json.dumps(report))
