"""The simulated device memory limit and the max-batch finder, on the engine's real train_step.

    .venv/bin/python -m pytest tests/pipeline/train/test_max_batch.py -q

CPU: memory is counted per live tensor storage (pipeline/train/memory/limit.py), so these tests check that the
count behaves like a device: the floor is the weights + gradients + Adam state, it grows with the batch,
and the same step fails just below its own measured peak and passes just above it. The finder's answer is
then checked independently: batch N trains under the limit, N + 1 raises torch.OutOfMemoryError.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.config import load_config
from pipeline.train.engine import Engine
from model.tiers import TIERS
from pipeline.train.max_batch import find_max_batch
from pipeline.train.max_batch import main as max_batch_main
from pipeline.train.memory.limit import GIB, MemoryLimit
from pipeline.data.synthetic import synthetic_batches

ROOT = Path(__file__).resolve().parents[3]
VOCAB, SEQ = 300, 32
CPU = torch.device("cpu")


def _cfg(**over):
    return load_config("test", {"data.seq_len": SEQ, "data.vocab_size": VOCAB, **over})


def _batch(bs: int) -> dict[str, torch.Tensor]:
    return next(synthetic_batches(n_sequences=bs, seq_len=SEQ, vocab_size=VOCAB, batch_size=bs, seed=7))


def _step_peak(engine: Engine, bs: int) -> int:
    """Peak bytes of one steady-state step (the optimizer state already exists)."""
    cap = MemoryLimit(1.0, CPU)
    with cap.during(engine.module, engine.optimizer):
        engine.train_step([_batch(bs)])
    return cap.peak_bytes


@pytest.fixture(scope="module")
def engine():
    e = Engine(_cfg(), VOCAB, CPU)
    e.train_step([_batch(1)])  # allocates the Adam state: later steps see steady-state memory
    return e


def test_cpu_count_floor_and_growth(engine):
    param_bytes = sum(p.numel() * p.element_size() for p in engine.module.parameters())
    peaks = {bs: _step_peak(engine, bs) for bs in (2, 4, 8, 16)}
    # weights + gradients + two Adam moments are all live during the optimizer step
    assert peaks[2] >= 4 * param_bytes
    assert peaks[2] < peaks[4] < peaks[8] < peaks[16]
    # activations grow linearly with the batch: equal increments per added sequence, within 15%
    per_seq = [(peaks[b2] - peaks[b1]) / (b2 - b1) for b1, b2 in ((4, 8), (8, 16))]
    assert per_seq[1] == pytest.approx(per_seq[0], rel=0.15)
    # the tokens themselves are in there: at least the int64 batch plus fp32 hidden states per token
    assert per_seq[0] > (SEQ + 1) * 8 + SEQ * engine.module.decoder.tier.d_model * 4


def test_same_step_fails_just_below_its_peak_and_passes_just_above(engine):
    peak = _step_peak(engine, 8)
    below = MemoryLimit(peak * 0.97 / GIB, CPU)
    with pytest.raises(torch.OutOfMemoryError, match=r"would be live on a simulated [\d.]+ MiB device"):
        with below.during(engine.module, engine.optimizer):
            engine.train_step([_batch(8)])
    engine.optimizer.zero_grad(set_to_none=True)
    above = MemoryLimit(peak * 1.03 / GIB, CPU)
    with above.during(engine.module, engine.optimizer):
        engine.train_step([_batch(8)])
    assert above.peak_bytes == peak  # the count is deterministic for the same step


def test_engine_reports_the_simulated_peak():
    e = Engine(_cfg(**{"train.memory_limit_gib": 0.5}), VOCAB, CPU)
    e.train_step([_batch(4)])
    m = e.pull_train_metrics()
    assert 0 < m["train/peak_mem_gib"] < 0.5
    assert m["train/peak_mem_gib"] == pytest.approx(e.memory_limit.peak_gib())


def _fits(bs: int, limit_gib: float) -> bool:
    """Independent check on a fresh engine: warm step at 1, then one step at bs under the limit."""
    e = Engine(_cfg(**{"train.memory_limit_gib": limit_gib}), VOCAB, CPU)
    e.train_step([_batch(1)])
    try:
        e.train_step([_batch(bs)])
        return True
    except torch.OutOfMemoryError:
        return False


LIMIT_GIB = 6 / 1024  # 6 MiB: fits somewhere between 2 and 32 sequences of 33 tokens at nano


@pytest.fixture(scope="module")
def found_6mib():
    return find_max_batch(_cfg(), memory_limit_gib=LIMIT_GIB, upper=256, device=CPU)


def test_finder_answer_is_exact_on_a_simulated_device(found_6mib):
    found, limit = found_6mib, LIMIT_GIB
    n = found.max_batch
    assert 2 <= n < 128, found
    assert found.simulated and found.tier == "nano" and found.seq_len == SEQ
    sizes = [t.batch_size for t in found.tries]
    assert sizes[:3] == [1, 2, 4]  # doubling first ...
    assert not all(t.fits for t in found.tries)  # ... until a size failed, then bisection
    assert all(t.fits == (t.batch_size <= n) for t in found.tries)
    assert _fits(n, limit) and not _fits(n + 1, limit)


@pytest.mark.system  # docs/tests.md: over ~5 s (6.7 s in the quick tier on 2 idle cores)
def test_finder_stops_at_upper_and_reports_zero_when_nothing_fits():
    capped = find_max_batch(_cfg(), memory_limit_gib=1.0, upper=3, device=CPU)
    assert capped.max_batch == 3 and max(t.batch_size for t in capped.tries) == 3
    nothing = find_max_batch(_cfg(), memory_limit_gib=1e-4, upper=8, device=CPU)  # 100 KiB < the weights
    assert nothing.max_batch == 0


@pytest.mark.system  # docs/tests.md: over ~5 s (7.6 s in the quick tier on 2 idle cores)
def test_cli_matches_the_function(tmp_path, found_6mib):
    out = tmp_path / "mb.json"
    cmd = [sys.executable, "-m", "pipeline.train.max_batch", "--preset", "test", "--tier", "nano", "--seq-len", str(SEQ),
           "--memory-limit-gib", str(LIMIT_GIB), "--max", "256", "--json", str(out), f"--data.vocab_size={VOCAB}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert f"largest micro-batch that fits: {result['max_batch']}" in proc.stdout
    assert result["max_batch"] == found_6mib.max_batch
    assert [t["batch_size"] for t in result["tries"]] == [t.batch_size for t in found_6mib.tries]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the note of a search on a CPU")
@pytest.mark.system
def test_cli_shows_each_probe_as_it_starts_and_as_it_ends():
    """A probe is one training step, minutes long on a CPU for a large tier: each says when it starts."""
    cmd = [sys.executable, "-m", "pipeline.train.max_batch", "--preset", "test", "--tier", "nano", "--seq-len", str(SEQ),
           "--memory-limit-gib", str(LIMIT_GIB), "--max", "256", f"--data.vocab_size={VOCAB}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[1].startswith("note: no GPU here: the finder is meant for one; each probe is a real training step "
                               "on the CPU") and "the search stops after --max-seconds 300" in lines[1]
    assert lines[3] == "  batch     1: first step (creates the optimizer state; not measured) ..."
    probes = lines[4:-1]
    assert len(probes) >= 6 and len(probes) % 2 == 0, proc.stdout
    for start, end in zip(probes[::2], probes[1::2]):  # each probe: its start line, then its result
        size = start.split(":")[0]
        assert start == f"{size}: training step ...", proc.stdout
        assert end.startswith(f"{size}: fits  peak ") or end.startswith(f"{size}: OOM   peak "), proc.stdout


@pytest.mark.system
@pytest.mark.skipif(torch.cuda.is_available(), reason="the bound and the note of a search on a CPU")
def test_a_long_cpu_search_is_bounded_by_max_seconds():
    """As `--tier B --seq-len 32768` on a CPU (one step takes minutes): the search ends at --max-seconds (300 s by
    default on a CPU) with one line. Here tier A at 16k tokens, which the memory model fits at batch 2 in 6 GiB
    with activation checkpointing (so no probe ends early by running out of memory) and the counted memory capped
    at 6 GiB to spare the test machine."""
    cmd = [sys.executable, "-m", "pipeline.train.max_batch", "--tier", "A", "--seq-len", "16384", "--max-seconds",
           "15", "--memory-limit-gib", "6", "--model.activation_checkpointing=all"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=170)  # a bound on a hang
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "  batch     1: first step (creates the optimizer state; not measured) ..." in proc.stdout
    if proc.returncode == 1:  # the first steps did not end in 15 s (a CPU of a few cores: minutes)
        assert proc.stderr.strip().splitlines() == [
            "error: the max-batch search measured nothing within --max-seconds 15 (the first training steps of tier "
            "A at seq_len 16384 did not end in time on this device); run it on a GPU, raise --max-seconds, or ask "
            "the memory model: python -m pipeline.train.max_batch --tier A --seq-len 16384 --workers 1 --device cuda "
            "--memory-limit-gib 80 (an 80 GiB GPU)"], proc.stderr
    else:  # a fast CPU: some probes ended, and the answer is a lower bound
        assert proc.returncode == 0, proc.stderr
        last = proc.stdout.strip().splitlines()[-1]
        assert last.startswith("largest micro-batch that fits: at least ") and "--max-seconds 15" in last, last


def test_cli_bad_tier_is_one_clear_line(capsys):
    assert max_batch_main(["--tier", "Z", "--preset", "test"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: model.tier='Z' is not allowed; choose one of: {', '.join(TIERS)}"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_finder_on_gpu_with_a_capped_allocator():
    dev = torch.device("cuda", 0)
    cfg = load_config("test", {"data.seq_len": 1024, "data.vocab_size": 32000, "model.tier": "A",
                               "model.compile": "off"})
    found = find_max_batch(cfg, memory_limit_gib=4.0, upper=512, device=dev)
    assert 1 <= found.max_batch < 512, found
    ok = [t for t in found.tries if t.fits]
    assert ok and all(t.peak_gib <= 4.0 for t in ok)  # the allocator never went past the cap
    assert any(not t.fits for t in found.tries)
    torch.cuda.set_per_process_memory_fraction(1.0, dev)
