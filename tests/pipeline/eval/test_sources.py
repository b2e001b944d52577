"""Bits per byte counts the bytes the predicted text really has: the UTF-8 bytes of the documents, nothing for EOS,
nothing for SentencePiece's dropped leading space, padded rows not at all (Ray-free, the session's tokenizer:
tests/pipeline/conftest.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.eval.sources import _Counted, source_names, source_table


def test_bytes_counted_are_the_utf8_bytes_of_the_predicted_documents(tok_path):
    from pipeline.data.tokenizer import Tokenizer

    tok = Tokenizer(tok_path)
    docs = ["def f(x):\n    return x  # ünïcode ✓", "Hello world, thé café.\n\n  indented", "plain text"]
    stream = [tok.eos_id]  # a row starting right after an EOS: its first target begins a document
    for d in docs:
        stream += tok.encode(d) + [tok.eos_id]
    width = len(stream)
    rows = torch.tensor([stream, stream], dtype=torch.int64)  # the second row is padding
    size, lead = tok.utf8_bytes()
    counted = _Counted([{"tokens": rows, "pad": torch.tensor([False, True])}], size, lead, tok.eos_id)
    assert len(list(counted)) == 1
    assert counted.bytes == sum(len(d.encode("utf-8")) for d in docs)
    assert counted.tokens == width - 1  # the targets of the one counted row


def test_the_eval_table_has_a_row_per_source_then_the_mixture():
    m = {"eval/loss": 2.0, "eval/ppl": float(np.exp(2.0)), "eval/accuracy": 0.5}
    for name, loss in (("web", 1.5), ("code", 2.5)):
        m.update({f"eval/{name}/loss": loss, f"eval/{name}/ppl": float(np.exp(loss)), f"eval/{name}/bpb": loss / 2,
                  f"eval/{name}/accuracy": 0.5})
    assert source_names(m, "eval") == ["web", "code"]
    lines = source_table(m, {"web": 0.5, "code": 0.5}).splitlines()
    assert [ln.split()[0] for ln in lines] == ["source", "web", "code", "mixture"]
    assert lines[1].split()[1:4] == ["50.0%", "1.5000", "4.48"]


@pytest.mark.system
def test_a_mixture_reads_each_source_validation_split_once_per_run(s3_bucket, fault_proxy, tmp_path):
    """`train --no-ray` on a mixture of two datasets in the bucket, with 4 and then 8 evaluations, every S3 request
    counted by the session's proxy: each source's validation shards get the same GETs in both runs (one reader per
    source for the run, as a single dataset has), not twice as many."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from bench.data_wait import upload
    from pipeline.data.synthetic import write_synthetic_dataset
    from tests.conftest import proxy_env

    root = Path(__file__).resolve().parents[3]
    mixture = []
    for i, name in enumerate(("a", "b")):
        write_synthetic_dataset(tmp_path / name, n_train=64, n_val=24, seq_len=64, vocab_size=512, seed=i,
                                rows_per_shard=8)
        upload(tmp_path / name, f"{s3_bucket}/evalmix/{name}")
        mixture.append({"name": name, "weight": 0.5, "dataset_dir": f"{s3_bucket}/evalmix/{name}"})

    def val_gets(eval_every: int) -> dict[str, int]:
        fault_proxy.clear()
        fault_proxy.reset_log()
        res = subprocess.run([sys.executable, str(root / "pipeline" / "run.py"), "train", "--no-ray", "--preset",
                              "test",
                              f"--run.root={tmp_path / 'runs'}", f"--run.name=every{eval_every}",
                              f"--data.mixture={json.dumps(mixture)}", "--train.max_steps=16",
                              f"--train.eval_every={eval_every}", "--train.checkpoint_every=16",
                              "--train.sample_tokens=0", "--tracking.enabled=false"],
                             capture_output=True, text=True, timeout=600, cwd=root, env=proxy_env(fault_proxy))
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        return {n: fault_proxy.count(rf"^GET \S*/evalmix/{n}/val-\d+\.parquet ") for n in ("a", "b")}

    four, eight = val_gets(4), val_gets(2)
    assert all(four[n] > 0 for n in four), four
    assert eight == four, (four, eight)  # before: {'a': 48, 'b': 48} against {'a': 24, 'b': 24}
