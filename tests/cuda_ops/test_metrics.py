"""cuda_ops.metrics.TokenMetrics: sums, the single transfer in pull(), reset, and the DDP all_reduce hook.

    .venv/bin/python -m pytest tests/cuda_ops/test_metrics.py -q
"""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cuda_ops.cross_entropy import CEResult
from cuda_ops.metrics import TokenMetrics


def _ce(loss, n, c, device="cpu"):
    return CEResult(torch.tensor(loss, dtype=torch.float32, device=device),
                    torch.tensor(n, dtype=torch.int64, device=device), torch.tensor(c, dtype=torch.int64, device=device))


def test_pull_matches_the_sums_then_resets():
    m = TokenMetrics("cpu")
    m.add(_ce(12.5, 10, 4))                                                # a CEResult
    m.add(torch.tensor(7.5), torch.tensor(5), torch.tensor(1))             # three tensors
    m.add(3.0, 5, 2)                                                       # Python numbers
    out = m.pull()
    assert out["tokens"] == 20 and isinstance(out["tokens"], int)
    assert out["loss"] == pytest.approx(23.0 / 20)
    assert out["ppl"] == pytest.approx(math.exp(23.0 / 20))
    assert out["accuracy"] == pytest.approx(7 / 20)
    empty = m.pull()  # reset by the previous pull
    assert empty["tokens"] == 0 and all(math.isnan(empty[k]) for k in ("loss", "ppl", "accuracy"))
    m.add(_ce(2.0, 1, 1))
    assert m.pull() == {"loss": 2.0, "ppl": math.exp(2.0), "accuracy": 1.0, "tokens": 1}


def test_accumulators_are_fp64_and_int64_and_detached():
    m = TokenMetrics()
    w = torch.tensor(16777216.0, requires_grad=True)  # 2**24: adding 1.0 in fp32 would be lost
    m.add(w * 1.0, torch.tensor(1), torch.tensor(0))
    m.add(torch.tensor(1.0), torch.tensor(1, dtype=torch.int32), torch.tensor(1, dtype=torch.int32))
    assert m.loss_sum.dtype == torch.float64 and m.n_tokens.dtype == torch.int64
    assert not m.loss_sum.requires_grad and m.loss_sum.grad_fn is None
    assert m.pull()["loss"] == 16777217.0 / 2


def test_add_and_pull_make_no_hidden_transfers(monkeypatch):
    m = TokenMetrics()
    calls = []
    real_tolist = torch.Tensor.tolist

    def no_sync(self, *a, **k):
        raise AssertionError("a tensor was read on the host")

    for name in ("item", "__bool__", "__float__", "__int__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, no_sync)
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: calls.append(1) or real_tolist(self))
    for _ in range(3):
        m.add(_ce(1.5, 3, 2))
    assert calls == []
    out = m.pull()
    monkeypatch.undo()
    assert calls == [1] and out["tokens"] == 9 and out["loss"] == pytest.approx(1.5 / 3)


def test_ppl_overflow_and_nan():
    m = TokenMetrics()
    m.add(1000.0, 1, 0)
    assert m.pull()["ppl"] == math.inf
    m.add(float("nan"), 1, 0)
    assert math.isnan(m.pull()["ppl"])


def test_add_needs_all_three_counts():
    with pytest.raises(TypeError, match="n_tokens and n_correct"):
        TokenMetrics().add(torch.tensor(1.0), torch.tensor(1))


def test_all_reduce_is_a_noop_without_torch_distributed():
    m = TokenMetrics()
    m.add(4.0, 2, 1)
    assert m.all_reduce() is m
    assert m.pull()["tokens"] == 2


def _rank_worker(rank, world, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        m = TokenMetrics("cpu")
        m.add(_ce(10.0 * (rank + 1), 4 * (rank + 1), rank))  # rank 0: 10, 4, 0   rank 1: 20, 8, 1
        out = m.all_reduce().pull()
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(out, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.system  # docs/tests.md: over ~5 s (7.2 s in the quick tier on 2 idle cores)
def test_all_reduce_sums_over_ranks(tmp_path):
    mp.spawn(_rank_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert out["tokens"] == 12 and out["loss"] == pytest.approx(30.0 / 12) and out["accuracy"] == 1 / 12


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_add_does_not_sync_on_gpu():
    m = TokenMetrics("cuda")
    batches = [_ce(float(i), 10, i, device="cuda") for i in range(5)]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for b in batches:
            m.add(b)
        m.add(0.5, 1, 1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert m.pull() == pytest.approx({"loss": 10.5 / 51, "ppl": math.exp(10.5 / 51), "accuracy": 11 / 51,
                                      "tokens": 51})
