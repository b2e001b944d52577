"""Fixtures of the sweep tests."""
from __future__ import annotations

import json
from pathlib import Path

import pytest


def write_corpus(path: Path) -> Path:
    """60 documents of Python's own help topics (no download), one JSON line each."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    with open(path, "w") as f:
        for k in sorted(topics)[:60]:
            f.write(json.dumps({"text": topics[k][:3000]}) + "\n")
    return path


@pytest.fixture(scope="package")
def sweep_files(tmp_path_factory) -> tuple[Path, Path]:
    """(corpus, run root) shared by the two end-to-end sweeps (test_tune.py's batch-size sweep and
    test_mixer_sweep.py's): one corpus file with the same data settings under one run root, so whichever runs
    second finds the dataset the first prepared in the content-hash cache instead of preparing it again
    (~10 s on 2 cores). Each sweep keeps its own <root>/tune/<name> and MLflow experiment."""
    d = tmp_path_factory.mktemp("sweep_files")
    return write_corpus(d / "corpus.jsonl"), d / "runs"
