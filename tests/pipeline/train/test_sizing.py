"""A run sized to its data (pipeline/train/session/sizing.py): the rules on their own, then the `gpu` preset's rules run on
CPU at a small scale through `python pipeline/run.py` -- the default run on a GPU, with the nano tier standing in for
tier B and 4,096-token rows for 32,768."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.train.session.sizing import MIN_SEQ_LEN, cap_steps, fold_accumulation, rows_at, shorter_seq_len


def test_rows_shrink_to_the_longest_power_of_two_that_fills_min_rows():
    issue = 16 * 32769 + 100  # the built-in corpus at vocab 32,000 on one GPU image: 16 rows of 32k
    assert rows_at(issue, 32768) == 16
    assert shorter_seq_len(issue, 32768, 256) == 1024 and rows_at(issue, 1024) == 511 and rows_at(issue, 2048) == 255
    assert shorter_seq_len(644_583, 32768, 256) == 2048  # the same corpus on this machine's Python: 314 rows
    assert shorter_seq_len(10**9, 32768, 256) == 32768  # a real corpus keeps its rows
    assert shorter_seq_len(1000, 32768, 256) == MIN_SEQ_LEN  # never below the floor, however small the corpus
    assert shorter_seq_len(1000, 64, 256) == 64  # nor longer than asked
    assert shorter_seq_len(700_000, 3000, 256) == 2048  # from a length that is no power of two: the next one below


def test_accumulation_folds_into_the_micro_batch_as_rows_shrink():
    assert fold_accumulation(1, 8, 16) == (8, 1)  # 16x shorter rows: the 8 micro-batches become one of 8 rows
    assert fold_accumulation(1, 8, 2) == (2, 4)
    assert fold_accumulation(2, 6, 4) == (6, 2)  # the largest divisor of 6 that is at most 4: 3
    assert fold_accumulation(4, 1, 32) == (4, 1)


@pytest.mark.parametrize("tokens", [50_000, 644_583, 5_000_000, 50_000_000, 2_000_000_000])
def test_the_gpu_preset_never_passes_over_its_data_more_than_four_times(tokens):
    """The gpu preset's rules over corpora from 50k tokens to 2B: the rows shrink only while the corpus is short of
    256 rows of 32k, rows per step stay 8, and the run makes at most 4 passes (exactly 4 when the corpus is small)."""
    cfg = load_config("gpu")
    seq = shorter_seq_len(tokens, cfg.data.seq_len, cfg.data.min_rows)
    batch, accum = fold_accumulation(cfg.train.batch_size, cfg.train.grad_accum, cfg.data.seq_len // seq)
    assert batch * accum == 8 and batch * seq <= cfg.data.seq_len
    rows = rows_at(tokens, seq)
    train_rows = rows - max(1, round(rows * cfg.data.val_fraction))
    sized, line = cap_steps(cfg.replace({"data.seq_len": seq, "train.batch_size": batch, "train.grad_accum": accum}),
                            train_rows)
    t = sized.train
    epochs = t.max_steps * batch * accum / train_rows
    assert epochs <= cfg.train.max_epochs
    if rows_at(tokens, 32768) >= 256:  # a real corpus: the preset as written
        assert seq == 32768 and (batch, accum) == (1, 8)
    if line:  # the cap bound: about max_epochs passes, the schedule scaled with it
        assert epochs > cfg.train.max_epochs - 0.1 and t.max_steps < 2000
        assert t.warmup_steps == max(1, round(100 * t.max_steps / 2000))
        assert t.eval_every == max(1, round(200 * t.max_steps / 2000))
        assert t.checkpoint_every == max(1, round(500 * t.max_steps / 2000))
        assert f"caps train.max_steps 2,000 -> {t.max_steps:,}" in line
    else:
        assert t.max_steps == 2000 and line == ""


@pytest.mark.system
def test_the_gpu_preset_default_run_at_a_small_scale(ray_session, mlflow_server, tmp_path, capfd):
    """`python pipeline/run.py` as on a GPU, with the gpu preset's rules (at most 4 epochs, 1 x 8 rows per step,
    2,000 steps, warmup 100, eval every 200, checkpoint every 500) and its sizes made small: nano, rows of at most
    4,096 tokens, data.min_rows 64, the first 20 built-in documents at vocab 512, no Ray Train. The corpus fills
    too few rows of 4,096, is packed again at the longest length that fills 64, the steps are capped at 4 passes,
    the console says so and ends with the command for a real corpus, and the run trains exactly that."""
    from mlflow.tracking import MlflowClient

    from pipeline.data.shards import load_manifest
    from pipeline.cli.train import REAL_CORPUS_COMMAND
    from pipeline.run import main

    uri, _ = mlflow_server
    # (no --ray.use_gpu=false: with --no-ray nothing reads it, and the command line refuses it)
    args = ["--preset", "gpu", "--no-ray", "--model.tier=nano", "--data.seq_len=4096", "--data.vocab_size=512",
            "--data.max_documents=20", "--data.min_rows=64", f"--run.root={tmp_path}", "--run.name=sized",
            f"--tracking.tracking_uri={uri}", "--tracking.experiment=sizing", "--max-new-tokens=8"]
    assert main(args) == 0
    out, err = capfd.readouterr()
    console = (out + err).splitlines()
    assert len(console) <= 150, "\n".join(console)

    record = json.loads((tmp_path / "sized" / "run.json").read_text())
    cfg = record["config"]
    first, second = sorted((tmp_path / "datasets").iterdir(), key=lambda d: -load_manifest(d).seq_len)
    m32k, m = load_manifest(first), load_manifest(second)
    tokens = m32k.counts["tokens_total"]
    seq = shorter_seq_len(tokens, 4096, 64)
    assert m32k.seq_len == 4096 and m32k.rows("train") + m32k.rows("val") < 64  # too few rows of the longest
    assert m.seq_len == seq == cfg["data.seq_len"] < 4096 and m.counts["tokens_total"] == tokens
    assert m.rows("train") + m.rows("val") == rows_at(tokens, seq) >= 64 > rows_at(tokens, 2 * seq)
    batch, accum = fold_accumulation(1, 8, 4096 // seq)
    assert (cfg["train.batch_size"], cfg["train.grad_accum"]) == (batch, accum) and batch * accum == 8
    steps = math.floor(4 * (m.rows("train") // batch) / accum)
    assert cfg["train.max_steps"] == steps < 2000 and record["phases"] == [{"steps": steps, "overrides": {}}]
    assert record["datasets"] == [str(second)]

    meta = json.loads((Path(record["checkpoint"]) / "meta.json").read_text())
    assert meta["counters"]["step"] == steps
    assert meta["counters"]["tokens_seen"] <= 4 * m.rows("train") * seq  # at most 4 passes over the data
    assert meta["counters"]["epoch"] == 3  # in its 4th pass at the end

    sized = [ln for ln in console if ln.startswith("size: ")]
    assert len(sized) == 2, "\n".join(console)
    assert sized[0].startswith(f"size: {m32k.rows('train') + m32k.rows('val')} rows of 4,096 tokens are fewer than "
                               f"data.min_rows=64: packing the corpus ({tokens:,} tokens) again at data.seq_len={seq}")
    assert f"micro-batch 1 x 8 accumulated -> {batch} x {accum}" in sized[0]
    assert sized[1].startswith(f"size: train.max_epochs=4 over {m.rows('train'):,} training rows at 8 rows per step "
                               f"caps train.max_steps 2,000 -> {steps}")
    assert [ln for ln in console if ln.startswith("==> prepare")] == [
        "==> prepare: built-in corpus, seq_len 4096, vocab 512", f"==> prepare: built-in corpus, seq_len {seq}, vocab 512"]
    assert any(ln.startswith("==> eval") for ln in console) and any(ln.startswith("==> generate") for ln in console)
    last = out.splitlines()
    assert last[-1] == f"  {REAL_CORPUS_COMMAND}" and "passed over it 4.0 times" in last[-2]
    assert "The minimum number of concurrent actors" not in out + err  # the pool fits the corpus's blocks

    run = MlflowClient(uri).get_run(record["mlflow_run_id"])  # the MLflow run's params are the sized config
    assert run.data.params["data.seq_len"] == str(seq) and run.data.params["train.max_steps"] == str(steps)
    assert run.info.status == "FINISHED"


def test_the_real_corpus_preset_is_the_gpu_preset_on_fineweb_edu_at_32k():
    gpu, real = load_config("gpu"), load_config("fineweb-32k")
    assert real.data.source == "hf" and real.data.hf_name == "HuggingFaceFW/fineweb-edu" and real.data.hf_streaming
    assert real.data.seq_len == 32768 and real.data.min_rows == 0 and real.model.tier == "B"
    differs = {k for k, v in real.flat().items() if gpu.flat()[k] != v}
    assert differs == {"data.source", "data.hf_name", "data.hf_config", "data.hf_streaming", "data.max_documents",
                       "data.min_rows"}
