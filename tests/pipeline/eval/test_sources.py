"""Bits per byte counts the bytes the predicted text really has: the UTF-8 bytes of the documents, nothing for EOS,
nothing for SentencePiece's dropped leading space, padded rows not at all (Ray-free, the session's tokenizer:
tests/pipeline/conftest.py)."""
from __future__ import annotations

import numpy as np
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
