"""One `train` reads its dataset's manifest.json once: the session reads it with the dataset (pipeline/data/stages.py
prepared) and hands the Manifest to the run's record, MLflow, the readers of both splits and the eval-time samples
(pipeline/train/local.py; under Ray Train the workers are handed it in their config). Counted in-process on
pipeline/storage.py read_bytes, as tests/pipeline/cli/test_eval_reads.py counts an eval's."""
from __future__ import annotations

import pytest

from tests.pipeline.cli.test_eval_reads import _count_reads


@pytest.mark.system  # docs/tests.md: over ~5 s (6.8 s in the quick tier on 2 idle cores)
def test_one_train_reads_the_manifest_once(files_dataset, tmp_path, monkeypatch, capsys):
    import pipeline.cli.train  # noqa: F401 -- the command's modules, so their own names for read_bytes are patched
    import pipeline.data.pack  # noqa: F401
    import pipeline.data.stages  # noqa: F401
    import pipeline.train.local  # noqa: F401
    import pipeline.train.handoff.text_generation  # noqa: F401
    from pipeline.run import main

    reads = _count_reads(monkeypatch)
    # tracked (a local store under run.root) and with samples at the evaluation: every reader of the manifest runs
    rc = main(["train", "--no-ray", "--preset", "test", f"--run.root={tmp_path / 'runs'}", *files_dataset.overrides,
               "--train.max_steps=2", "--train.eval_every=2", "--train.log_every=1", "--train.sample_tokens=2",
               "--run.name=reads"])
    out = capsys.readouterr().out
    assert rc == 0 and "checkpoint:" in out and out.split("checkpoint:")[1].split()[0].endswith("step_000002"), out
    manifests = [r for r in reads if r.endswith("manifest.json")]
    assert len(manifests) == 1, manifests
    samples = list((tmp_path / "runs").rglob("step_000002.txt"))  # the eval-time samples ran, on the handed manifest
    assert samples and samples[0].parent.name == "samples", samples
