"""One `eval` reads the checkpoint's meta.json and its dataset's manifest.json once each: the command
(pipeline/cli/eval.py) loads the checkpoint once and hands the meta and the Manifest to every reader and measure.
Counted in-process on pipeline/storage.py read_bytes, which every read of either file goes through (read_text too),
wrapped to record the location and read for real; bench/eval_command_reads.py counts the same on an S3 server."""
from __future__ import annotations

import sys

import torch

from pipeline.config import load_config
from pipeline.data.synthetic import write_synthetic_dataset

SEQ, VOCAB = 32, 256


def _checkpoint(tmp_path):
    from pipeline.train.engine import Engine

    ds = tmp_path / "ds"
    write_synthetic_dataset(ds, n_train=64, n_val=16, seq_len=SEQ, vocab_size=VOCAB, seed=1, rows_per_shard=8)
    cfg = load_config("test", {"data.seq_len": SEQ, "data.dataset_dir": str(ds), "model.compile": "off"})
    engine = Engine(cfg, VOCAB, torch.device("cpu"))
    return engine.save(tmp_path / "ckpt" / "step_000000", extra={"dataset_dir": str(ds)})


def _count_reads(monkeypatch) -> list[str]:
    """The locations every storage read goes to from now on (modules that imported read_bytes by name included)."""
    import pipeline.cli.eval  # noqa: F401 -- the command's modules, so their own names for read_bytes are patched
    import pipeline.data.mixture  # noqa: F401
    import pipeline.eval.long_context  # noqa: F401
    import pipeline.train.engine  # noqa: F401
    from pipeline import storage

    reads: list[str] = []
    real = storage.read_bytes

    def counted(location):
        reads.append(str(location))
        return real(location)

    for mod in list(sys.modules.values()):
        if getattr(mod, "read_bytes", None) is real:
            monkeypatch.setattr(mod, "read_bytes", counted)
    return reads


def test_one_eval_reads_meta_and_manifest_once(tmp_path, monkeypatch, capsys):
    from pipeline.run import main

    ckpt = _checkpoint(tmp_path)
    reads = _count_reads(monkeypatch)
    rc = main(["eval", "--checkpoint", str(ckpt), f"--run.root={tmp_path / 'runs'}", "--by-position",
               "--seq-len", "2x"])
    out = capsys.readouterr().out
    assert rc == 0 and "eval/loss=" in out and "eval_2x/loss=" in out, out
    manifests = [r for r in reads if r.endswith("/manifest.json")]
    metas = [r for r in reads if r.endswith("/meta.json")]
    assert len(manifests) == 1, manifests
    assert len(metas) == 1, metas
