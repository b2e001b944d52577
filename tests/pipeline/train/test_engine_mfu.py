"""The engine's utilization figures: train/mfu counts the attention pairs the batches' documents allowed,
train/mfu_causal_equiv keeps the whole-row formula, and the count stays on the device between log steps."""
from __future__ import annotations

import pytest
import torch

from model.flops import flops_per_token, matmul_params
from model.tiers import get_tier
from pipeline.config import load_config
from pipeline.data.synthetic import synthetic_batches
from pipeline.train.engine import Engine
from tests.model.test_attention_flops import brute_force_pairs

VOCAB, SEQ, FAKE_PEAK = 96, 32, 1e12


def make_engine(doc_masking: bool) -> Engine:
    cfg = load_config("cpu", {"model.tier": "nano", "data.seq_len": SEQ, "data.vocab_size": 256,
                              "train.batch_size": 3, "train.max_steps": 4, "train.warmup_steps": 1,
                              "model.compile": "off", "model.doc_masking": doc_masking})
    engine = Engine(cfg, VOCAB, torch.device("cpu"))
    engine.peak_flops = FAKE_PEAK  # a CPU has no peak in the table; a made-up one turns the MFU figures on
    return engine


def run_steps(engine: Engine, n_steps: int) -> list[dict[str, torch.Tensor]]:
    it = iter(synthetic_batches(n_sequences=64, seq_len=SEQ, vocab_size=VOCAB, batch_size=3, seed=5,
                                doc_lengths="6"))  # geometric, mean 6: several documents per 32-token row
    engine.pull_train_metrics()  # start a fresh interval
    seen = []
    for _ in range(n_steps):
        micro = [next(it), next(it)]  # two micro-batches per step: accumulation counts both
        engine.train_step(micro)
        seen += micro
    return seen


def test_mfu_counts_within_document_pairs_and_causal_equiv_keeps_the_old_formula():
    engine = make_engine(doc_masking=True)
    batches = run_steps(engine, n_steps=2)
    m = engine.pull_train_metrics()
    tier = get_tier("nano")
    tokens = sum(b["tokens"].shape[0] * SEQ for b in batches)
    pairs = sum(brute_force_pairs(b["doc_ids"][:, :-1]) for b in batches)  # the model sees T of T+1 columns
    executed = 6 * matmul_params(tier, VOCAB) * tokens + 12 * tier.n_layers * tier.n_heads * tier.head_dim * pairs
    assert m["train/executed_flops_per_token"] == pytest.approx(executed / tokens, rel=1e-12)
    # today's formula, untouched: whole-row causal FLOPs per token x tokens/s over the peak
    assert m["train/mfu_causal_equiv"] == pytest.approx(
        flops_per_token(tier, SEQ, VOCAB) * m["train/tokens_per_s"] / FAKE_PEAK, rel=1e-12)
    # both divide by the same interval: their ratio is executed FLOPs over whole-row causal FLOPs
    assert pairs < 0.5 * len(batches) * 3 * SEQ * SEQ / 2  # short documents: most causal pairs are skipped
    ratio = executed / (flops_per_token(tier, SEQ, VOCAB) * tokens)
    assert ratio < 1
    assert m["train/mfu"] / m["train/mfu_causal_equiv"] == pytest.approx(ratio, rel=1e-12)
    # the counter was reset by the pull: the next interval starts from zero
    run_steps(engine, n_steps=1)
    assert engine._interval_attention_pairs.item() > 0
    engine.pull_train_metrics()
    assert engine._interval_attention_pairs.item() == 0


def test_without_doc_masking_both_figures_count_the_whole_causal_row():
    engine = make_engine(doc_masking=False)
    run_steps(engine, n_steps=1)
    m = engine.pull_train_metrics()
    tier = get_tier("nano")
    per_pair = 12 * tier.n_layers * tier.n_heads * tier.head_dim
    # T(T+1)/2 pairs per row: the causal-equivalent T^2/2 plus the diagonal's T/2
    assert m["train/executed_flops_per_token"] == pytest.approx(
        flops_per_token(tier, SEQ, VOCAB) + per_pair / 2, rel=1e-12)
    assert m["train/mfu"] / m["train/mfu_causal_equiv"] == pytest.approx(
        1 + per_pair / 2 / flops_per_token(tier, SEQ, VOCAB), rel=1e-12)


def test_counting_pairs_reads_nothing_back_to_the_host(monkeypatch):
    """Counting is queued device work: with every tensor-to-host read disabled, a micro-batch is still counted."""
    engine = make_engine(doc_masking=True)
    batch = next(iter(synthetic_batches(n_sequences=8, seq_len=SEQ, vocab_size=VOCAB, batch_size=3, seed=1,
                                        doc_lengths="6")))

    def no_host_reads(*_a, **_k):
        raise AssertionError("a host read while counting attention pairs")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "numpy", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, no_host_reads)
    engine._count_attention_pairs(batch["tokens"], batch["doc_ids"])
    monkeypatch.undo()
    assert engine._interval_attention_pairs.item() == brute_force_pairs(batch["doc_ids"][:, :-1])


@pytest.mark.parametrize("ac, checkpointed", [("none", 0), ("every_2", 1), ("all", 2)])
def test_hfu_adds_the_forward_checkpointing_recomputes(ac, checkpointed):
    """train/hfu = train/mfu plus one more forward (a third of training) of the checkpointed blocks' matmuls and
    attention, never of the output projection; per-GPU tokens/s and TFLOP/s follow the executed count."""
    cfg = load_config("cpu", {"model.tier": "nano", "data.seq_len": SEQ, "data.vocab_size": 256,
                              "train.batch_size": 3, "model.compile": "off", "model.activation_checkpointing": ac})
    engine = Engine(cfg, VOCAB, torch.device("cpu"))
    engine.peak_flops = FAKE_PEAK
    run_steps(engine, n_steps=1)
    m = engine.pull_train_metrics()
    tier = get_tier("nano")
    executed = m["train/executed_flops_per_token"]
    blocks = executed - 6 * VOCAB * tier.d_model  # every block's matmuls and attention, per token
    recomputed = checkpointed / tier.n_layers * blocks / 3
    assert m["train/hfu"] == pytest.approx(m["train/mfu"] * (executed + recomputed) / executed, rel=1e-9)
    assert m["train/tokens_per_s_per_gpu"] == m["train/tokens_per_s"]  # one worker
    assert m["train/tflops_per_gpu"] == pytest.approx(m["train/mfu"] * FAKE_PEAK / 1e12, rel=1e-9)
