"""What `python pipeline/run.py eval --by-position --seq-len 2x --passkey` shows while it runs and when it ends: progress
per batch of each long measure (plain lines in a log, as training's progress; pipeline/console.py progress), and the
paths of the pictures it logged to the run's MLflow store.

    .venv/bin/python -m pytest -q tests/pipeline/eval/test_eval_console.py

Ray-free: an untrained nano checkpoint beside a synthetic dataset (tests/pipeline/eval/test_passkey.py's helpers).
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.pipeline.eval.test_passkey import TRAINED_LEN, WINDOW, config, write_dataset

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.system
def test_long_eval_shows_progress_per_batch_and_prints_where_its_pictures_are(tmp_path):
    import pydoc_data.topics

    from pipeline.data.tokenizer import Tokenizer, train_tokenizer
    from pipeline.eval import passkey as pk
    from pipeline.tracking.tracker import open_tracker
    from pipeline.train.engine import Engine
    from pipeline.train.session.run_dir import write_run_file

    texts = [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)][:60]
    template = pk.INTRO + pk.NEEDLE.format(key="12345") + pk.QUESTION
    tok_path = train_tokenizer(texts + [template] * 200, 1000, tmp_path / "tokenizer.model", num_threads=1)
    dataset = tmp_path / "dataset"
    write_dataset(dataset, tok_path, n_train=64, n_val=16)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = config().replace({"tracking.enabled": True, "tracking.tracking_uri": uri, "tracking.system_metrics": False,
                            "run.root": str(tmp_path / "runs")})
    run_dir = tmp_path / "runs" / "console-run"
    ckpt = run_dir / "checkpoints" / "phase0" / "step_000000"
    Engine(config(), Tokenizer(tok_path).vocab_size, torch.device("cpu")).save(
        ckpt, extra={"dataset_dir": str(dataset)})
    tracker = open_tracker(cfg, run_name="console-run")
    tracker.finish()
    write_run_file(run_dir, {"config": cfg.flat(), "mlflow_run_id": tracker.run_id})

    res = subprocess.run([sys.executable, str(ROOT / "pipeline" / "run.py"), "eval", "--checkpoint", str(ckpt),
                          "--by-position", "--seq-len", "2x", "--passkey", "--passkey-lengths",
                          f"{TRAINED_LEN},{2 * WINDOW}", "--passkey-trials", "1"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert res.returncode == 0 and "Traceback" not in res.stdout + res.stderr, res.stdout[-3000:] + res.stderr
    out = res.stdout
    # 16 validation rows in batches of 4: by position 4 batches; 2x rows of 2 windows, 2 per batch: 8 batches (the
    # first validation row has a window before it: the stream is 64 train windows then 16 val); passkey: 2 lengths
    for desc, total in (("eval by position", 4), ("eval 2x", 8)):
        counts = [int(n) for n in re.findall(rf"^{desc}  batch (\d+)/{total}  elapsed \d+m\d\ds  eta \d+m\d\ds$",
                                             out, re.M)]
        assert counts and counts[0] == 1 and counts[-1] == total and counts == sorted(counts), out
    assert re.search(r"^passkey  batch 1/\d+  elapsed", out, re.M), out
    # each measure's progress comes before its result
    assert out.index("eval 2x  batch 1/8") < out.index("eval 2x: rows of 257 tokens")

    assert f"eval: long-context metrics and pictures logged to MLflow run {tracker.run_id}" in out
    paths = [Path(p) for p in re.findall(r"^eval: (/\S+\.(?:png|json))$", out, re.M)]
    assert [p.name for p in paths] == ["position_loss.png", "passkey_heatmap.png", "passkey_grid.json"], out
    for p in paths:
        assert p.is_file() and tracker.run_id in str(p), p
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
