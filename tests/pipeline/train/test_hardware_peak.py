"""The device peak behind MFU: the table, and LONGTRAIN_PEAK_TFLOPS for devices it does not know."""
from __future__ import annotations

import pytest
import torch

from pipeline.train.memory.hardware import PEAK_ENV, PEAK_MEMORY_BYTES_PER_S, PeakFlopsError, peak_flops, peak_memory_bandwidth


def test_a_cpu_has_no_peak_unless_one_is_given(monkeypatch):
    monkeypatch.delenv(PEAK_ENV, raising=False)
    assert peak_flops(torch.device("cpu")) is None
    monkeypatch.setenv(PEAK_ENV, "1.5")
    assert peak_flops(torch.device("cpu")) == 1.5e12


@pytest.mark.parametrize("bad", ["fast", "0", "-3", "inf", "nan"])
def test_a_bad_manual_peak_is_one_clear_error(monkeypatch, bad):
    monkeypatch.setenv(PEAK_ENV, bad)
    with pytest.raises(PeakFlopsError, match=f"{PEAK_ENV}=.* is not a peak"):
        peak_flops(torch.device("cpu"))


def test_engine_reports_both_mfu_figures_with_a_manual_peak(monkeypatch):
    from pipeline.config import load_config
    from pipeline.data.synthetic import synthetic_batches
    from pipeline.train.engine import Engine

    monkeypatch.setenv(PEAK_ENV, "0.001")  # 1 GFLOP/s: a CPU's MFU figures become visible
    cfg = load_config("cpu", {"model.tier": "nano", "data.seq_len": 32, "train.batch_size": 2, "model.compile": "off",
                              "train.max_steps": 2, "train.warmup_steps": 1})
    engine = Engine(cfg, 96, torch.device("cpu"))
    engine.train_step([next(synthetic_batches(n_sequences=4, seq_len=32, vocab_size=96, batch_size=2,
                                              doc_lengths="5"))])
    m = engine.pull_train_metrics()
    assert 0 < m["train/mfu"] < m["train/mfu_causal_equiv"]  # short documents: fewer FLOPs computed than counted


def test_peak_memory_bandwidth_table_orders_specific_names_first():
    assert peak_memory_bandwidth(torch.device("cpu")) is None
    names = [name for name, _ in PEAK_MEMORY_BYTES_PER_S]
    # first match wins: a more specific name must come before any name it contains
    for i, name in enumerate(names):
        assert not any(other in name for other in names[:i]), name
    assert dict(PEAK_MEMORY_BYTES_PER_S)["H100"] == 3.35e12
