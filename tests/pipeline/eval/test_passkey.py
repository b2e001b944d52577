"""Passkey retrieval (pipeline/eval/passkey.py) tells models apart, through the eval stage, from full and
FSDP-sharded checkpoints, for both model families; and `python pipeline/run.py eval --by-position --seq-len 2x
--passkey` end to end, what it shows while it runs and what it logs to the run that trained the checkpoint.

    .venv/bin/python -m pytest -q tests/pipeline/eval/test_passkey.py

The set-up, Ray-free and made here: a SentencePiece tokenizer trained on Python's help topics and the prompt's own
sentences (so that its words are single pieces and a CPU-sized row holds a haystack), and a dataset whose text is
synthetic: documents of random word pieces (no digit among them), so the haystack is noise the key cannot be
confused with. A nano attention model then trains briefly on passkey rows built by the harness itself (prompts of
TRAINED_LEN tokens from the training split's text, followed by their key), its loss on the tokens a reader could
copy: the answer and the key's second mention in the key sentence. That model is trained once per session (~100 s
on 2 cores, `setup`); the tests that read it are `system`, the others take `base`, which has no trained model
(the eval CLI's run on `base`'s untrained checkpoint, a subprocess of its own, is `system` too).
"""
from __future__ import annotations

import math
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipeline.config import load_config
from pipeline.eval import passkey as pk

ROW = 96  # training rows: a TRAINED_LEN-token prompt and its answer
TRAINED_LEN = ROW - 6  # the prompt length trained on (the answer, a space and 5 digits, fills the row)
# The copy is learned around step 1,100 (mean loss over each 100 steps: 0.12 at 1,100, 0.018 at 1,200, 0.004 at
# 1,500, on a 2-core VM on 2026-11-28). At LR 2e-3 the same run there was still at 0.10 by step 1,500 and
# retrieved 70 % of the keys (the test asks 80 %), while an earlier machine had reached ~0 by 1,200: the float
# order of another CPU's kernels moves when the copy is found, so the LR leaves a margin on both sides.
# On CI's machine (2026-12-01) the model of step 1,500 retrieved 2 of 8 keys at depth 100 %. So training stops
# when the copy is learned, not at a fixed step: when the mean loss of the last LEARNED_WINDOW steps is below
# LEARNED_LOSS (step 1,200 on the 2-core VM on 2026-12-02), or at MAX_STEPS (the test then fails on the grid).
BATCH, LR = 8, 4e-3
LEARNED_WINDOW, LEARNED_LOSS, MAX_STEPS = 100, 0.005, 3000
HORIZON = 2000  # schedule: warmup 30 steps, cosine towards 0.1 x LR over HORIZON steps, then 0.1 x LR
WINDOW = 128  # the dataset's seq_len
ROOT = Path(__file__).resolve().parents[3]
# the bound on a hang of a test that reads the trained model: its first one pays the training, ~100 s on 2 idle
# cores and past 600 s on a loaded machine
TRAIN_TIMEOUT_S = 1800


@dataclass
class Setup:
    tmp: Path
    dataset: Path
    tokenizer: "pk.Tokenizer"  # noqa: F821  pipeline/data/tokenizer.py's
    trained: Path | None  # full checkpoint of the passkey-trained model (None in `base`)
    untrained: Path
    trained_steps: int = 0  # the steps `setup` took to learn the copy (at most MAX_STEPS)


def write_dataset(ds: Path, tok_path: Path, n_train: int, n_val: int, seed: int = 0) -> None:
    """A real dataset directory (shards + manifest + tokenizer) whose documents are random non-digit word pieces."""
    from pipeline.data.shards import SCHEMA_VERSION, Manifest, shard_schema, windows_table, write_manifest, write_shard
    from pipeline.data.tokenizer import Tokenizer, file_sha256

    tok = Tokenizer(tok_path)
    pieces = [i for i in range(4, tok.vocab_size) if not any(c.isdigit() for c in tok.id_to_piece(i))
              and tok.id_to_piece(i) != "▁" and not tok.id_to_piece(i).startswith("<0x")]
    rng = np.random.default_rng(seed)
    width, n = WINDOW + 1, n_train + n_val
    stream = rng.choice(np.asarray(pieces), size=n * width)
    stream[rng.integers(0, n * width, size=n * width // 150)] = tok.eos_id  # documents of ~150 pieces
    windows = stream.reshape(n, width)
    ds.mkdir(parents=True)
    shutil.copyfile(tok_path, ds / "tokenizer.model")
    schema, shards = shard_schema(WINDOW, tok.vocab_size), {}
    for split, lo, hi in (("train", 0, n_train), ("val", n_train, n)):
        shards[split] = [write_shard(ds / f"{split}-00000.parquet",
                                     [windows_table(windows[lo:hi], np.arange(lo, hi), tok.eos_id, tok.vocab_size)],
                                     schema)]
    write_manifest(ds, Manifest(
        schema_version=SCHEMA_VERSION, seq_len=WINDOW, vocab_size=tok.vocab_size, pad_id=tok.pad_id,
        unk_id=tok.unk_id, bos_id=tok.bos_id, eos_id=tok.eos_id, token_type="uint16", tokenizer_file="tokenizer.model",
        tokenizer_sha256=file_sha256(tok_path), settings_hash=f"passkey-test-{seed}", source={"kind": "synthetic"},
        settings={"seq_len": WINDOW}, counts={"documents": 0, "tokens_total": int(stream.size),
                                              "tokens_kept": int(stream.size)},
        packing_efficiency=1.0, remainder_policy="synthetic", doc_length={}, shards=shards))


def config(mixer: str = "attention"):
    return load_config("test", {"model.tier": "nano", "model.mixer": mixer, "model.tie_embeddings": mixer == "attention",
                                "data.seq_len": WINDOW, "data.vocab_size": 1000, "train.batch_size": 4,
                                "model.compile": "off", "train.sample_tokens": 0, "tracking.enabled": False})


def passkey_rows(tok, haystack: np.ndarray, rng: np.random.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (n, ROW + 1), mask (n, ROW)): harness prompts of TRAINED_LEN tokens followed by their key; mask marks
    the targets trained on (the answer, and the key's second mention after its first digit)."""
    rows, mask = np.zeros((n, ROW + 1), np.int64), np.zeros((n, ROW), bool)
    for i in range(n):
        key = str(rng.integers(10_000, 100_000))
        prompt = pk.build_prompt(tok, haystack, key, TRAINED_LEN, float(rng.random()), int(rng.integers(len(haystack))))
        answer = tok.encode(" " + key)
        rows[i, :len(prompt) + len(answer)] = prompt + answer
        mask[i, len(prompt) - 1:len(prompt) - 1 + len(answer)] = True
        digits = answer[-5:]
        second = max(j for j in range(len(prompt) - 5) if prompt[j:j + 5] == digits)
        mask[i, second:second + 4] = True  # targets second + 1 .. second + 4: its digits 2..5
    return torch.from_numpy(rows), torch.from_numpy(mask)


def save(engine, path: Path, dataset: Path) -> Path:
    return engine.save(path, extra={"dataset_dir": str(dataset)})


@pytest.fixture(scope="session")
def base(tmp_path_factory) -> Setup:
    """The cheap part of the set-up (tokenizer, dataset, untrained checkpoint), for the tests that need no trained
    model; `trained` is still None here."""
    import pydoc_data.topics

    from pipeline.data.tokenizer import Tokenizer, train_tokenizer
    from pipeline.train.engine import Engine

    tmp = tmp_path_factory.mktemp("passkey")
    texts = [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)][:60]
    template = pk.INTRO + pk.NEEDLE.format(key="12345") + pk.QUESTION
    tok_path = train_tokenizer(texts + [template] * 200, 1000, tmp / "tokenizer.model", num_threads=1)
    dataset = tmp / "dataset"
    write_dataset(dataset, tok_path, n_train=64, n_val=16)
    tok = Tokenizer(tok_path)

    untrained = Engine(config(), tok.vocab_size, torch.device("cpu"))
    save(untrained, tmp / "untrained", dataset)
    return Setup(tmp, dataset, tok, None, tmp / "untrained")


@pytest.fixture(scope="session")
def setup(base) -> Setup:
    """`base` with the one passkey-trained model (trained until it copies the key, on CPU: the expensive part) that every test needing a
    trained model shares."""
    from pipeline.train.engine import Engine

    tmp, dataset, tok = base.tmp, base.dataset, base.tokenizer
    engine = Engine(config(), tok.vocab_size, torch.device("cpu"))
    decoder = engine.module.decoder.train()
    train_hay = pk.haystack_tokens(dataset, split="train")  # training prompts: the other split's text
    rng = np.random.default_rng(1)
    opt = torch.optim.AdamW(decoder.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 30) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, s / HORIZON)))))
    recent: list[float] = []
    for step in range(1, MAX_STEPS + 1):
        tokens, mask = passkey_rows(tok, train_hay, rng, BATCH)
        hidden = decoder(tokens[:, :-1])  # (B, ROW, D): one prompt per row, no document masking
        logits = hidden[mask] @ decoder.output_weight.T  # only the trained targets' logits
        loss = F.cross_entropy(logits, tokens[:, 1:][mask])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(decoder.parameters(), 1.0)
        opt.step()
        sched.step()
        recent = (recent + [loss.item()])[-LEARNED_WINDOW:]
        if len(recent) == LEARNED_WINDOW and sum(recent) / LEARNED_WINDOW < LEARNED_LOSS:
            break  # the copy is learned
    return Setup(tmp, dataset, tok, save(engine, tmp / "trained", dataset), base.untrained, step)


def quiet(_: str) -> None:
    pass


@pytest.fixture(scope="session")
def grids(setup):
    """The passkey grid at the trained length, 8 keys per depth, for the trained and the untrained model, read
    through the eval stage (Engine + checkpoint load; haystacks from the validation split)."""
    from pipeline.cli.eval import evaluate_long_context

    return {name: evaluate_long_context(ckpt, passkey=True, passkey_lengths=[TRAINED_LEN], passkey_trials=8,
                                        echo=quiet).passkey
            for name, ckpt in (("trained", setup.trained), ("untrained", setup.untrained))}


@pytest.mark.system
@pytest.mark.timeout(TRAIN_TIMEOUT_S)
def test_the_grid_tells_a_model_that_retrieves_from_one_that_cannot(setup, grids):
    trained, untrained = grids["trained"], grids["untrained"]
    assert trained.lengths == untrained.lengths == [TRAINED_LEN] and trained.accuracy.shape == (1, 5)
    # Trained briefly on passkey rows: retrieves the key at its trained length, at every depth
    learned = f"trained {setup.trained_steps} steps\n{trained.table()}"
    assert trained.mean_accuracy >= 0.8, learned
    assert trained.accuracy.min() >= 0.5, learned
    # Untrained: chance is 1e-5 per key (40 keys here), and at most 0.1 per digit for a model answering digits
    assert untrained.mean_accuracy == 0.0, untrained.table()
    assert untrained.digit_accuracy.mean() <= 0.1 + 4 * math.sqrt(0.1 * 0.9 / 200), untrained.examples
    assert all(len(e["key"]) == 5 and e["length"] == TRAINED_LEN for e in trained.examples)


@pytest.mark.system
@pytest.mark.timeout(TRAIN_TIMEOUT_S)
def test_a_sharded_checkpoint_gives_the_same_answers(setup, grids):
    from pipeline.cli.eval import evaluate_long_context
    from pipeline.train.checkpoints.state import SHARDED, read_checkpoint_meta
    from pipeline.train.engine import Engine
    from pipeline.train.distributed.process_group import process_group

    with process_group(0, 1):  # FSDP over a one-worker group: the sharded layout, in this process
        engine = Engine(config().replace({"train.parallel": "fsdp"}), setup.tokenizer.vocab_size, torch.device("cpu"))
        assert engine.sharded
        engine.load(setup.trained)
        sharded = save(engine, setup.tmp / "sharded", setup.dataset)
    assert read_checkpoint_meta(sharded)["layout"] == SHARDED
    grid = evaluate_long_context(sharded, passkey=True, passkey_lengths=[TRAINED_LEN], passkey_trials=8,
                                 echo=quiet).passkey  # consolidated on load, in a process without a group
    np.testing.assert_array_equal(grid.accuracy, grids["trained"].accuracy)
    assert grid.examples == grids["trained"].examples


def test_the_resonance_family_runs_every_measure(base):
    from pipeline.cli.eval import evaluate_long_context
    from pipeline.train.engine import Engine

    engine = Engine(config("resonance"), base.tokenizer.vocab_size, torch.device("cpu"))
    ckpt = save(engine, base.tmp / "resonance", base.dataset)
    lines: list[str] = []
    report = evaluate_long_context(ckpt, by_position=True, factors=[2], passkey=True,
                                   passkey_lengths=[TRAINED_LEN, 2 * WINDOW], passkey_trials=2, echo=lines.append)
    assert report.passkey.lengths == [TRAINED_LEN, 2 * WINDOW] and report.passkey.mean_accuracy == 0.0
    assert report.metrics["eval_2x/rows"] == 16 and report.metrics["eval_2x/loss"] > 0
    assert [b.name for b in report.positions["eval"].buckets] == ["1-64", "64-128"]
    assert [b.name for b in report.positions["eval_2x"].buckets] == ["1-64", "64-256", "256-257"]
    assert lines[0].startswith("eval by position (rows of 128 tokens") and lines[-1].startswith("passkey: accuracy 0.000")


@dataclass
class EvalRun:
    res: subprocess.CompletedProcess
    uri: str  # the MLflow store of the run that "trained" the checkpoint
    run_id: str


@pytest.fixture(scope="module")
def eval_cli_run(base) -> EvalRun:
    """ONE `python pipeline/run.py eval --by-position --seq-len 2x --passkey` as a user runs it, in a subprocess
    whose output goes to a pipe (as to a log file), on `base`'s untrained checkpoint put in a run directory whose
    record names an MLflow run. What it prints (the progress and the pictures' paths) and what it logs to that run
    are two tests of this one run (they were two runs, one of them with a tokenizer and a dataset of its own)."""
    from pipeline.tracking.tracker import open_tracker
    from pipeline.train.session.run_dir import write_run_file

    uri = f"sqlite:///{base.tmp / 'mlflow.db'}"
    cfg = config().replace({"tracking.enabled": True, "tracking.tracking_uri": uri, "tracking.system_metrics": False,
                            "run.root": str(base.tmp / "runs")})
    run_dir = base.tmp / "runs" / "passkey-run"
    ckpt = run_dir / "checkpoints" / "phase0" / "step_000000"
    shutil.copytree(base.untrained, ckpt)
    tracker = open_tracker(cfg, run_name="passkey-run")
    tracker.finish()
    write_run_file(run_dir, {"config": cfg.flat(), "mlflow_run_id": tracker.run_id})
    res = subprocess.run([sys.executable, str(ROOT / "pipeline" / "run.py"), "eval", "--checkpoint", str(ckpt),
                          "--by-position", "--seq-len", "2x", "--passkey", "--passkey-lengths",
                          f"{TRAINED_LEN},{2 * WINDOW}", "--passkey-trials", "2"],
                         capture_output=True, text=True, timeout=600, cwd=base.tmp)
    return EvalRun(res, uri, tracker.run_id)


@pytest.mark.system
def test_eval_cli_logs_every_measure_to_the_run_that_trained_the_checkpoint(eval_cli_run):
    from mlflow.tracking import MlflowClient

    res, uri, run_id = eval_cli_run.res, eval_cli_run.uri, eval_cli_run.run_id
    assert res.returncode == 0 and "Traceback" not in res.stdout + res.stderr, res.stdout[-3000:] + res.stderr
    out = res.stdout
    assert "eval by position (rows of 128 tokens" in out and "eval 2x: rows of 257 tokens" in out
    assert "passkey: accuracy " in out and f"eval: long-context metrics and pictures logged to MLflow run " \
                                           f"{run_id}" in out
    client = MlflowClient(tracking_uri=uri)
    metrics = client.get_run(run_id).data.metrics
    for name in ("eval/loss", "eval/pos_loss/1-64", "eval/pos_tokens/64-128", "eval/cum_ppl/128", "eval_2x/loss",
                 "eval_2x/pos_loss/256-257", f"passkey/accuracy/{TRAINED_LEN}", f"passkey/accuracy/{2 * WINDOW}",
                 "passkey/accuracy", "passkey/digit_accuracy"):
        assert name in metrics and [m.step for m in client.get_metric_history(run_id, name)] == [0], name
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"position_loss.png", "passkey_heatmap.png", "passkey_grid.json"} <= artifacts


@pytest.mark.system
def test_long_eval_shows_progress_per_batch_and_prints_where_its_pictures_are(eval_cli_run):
    """What the eval shows while it runs and when it ends: progress per batch of each long measure (plain lines in
    a log, as training's progress; pipeline/console.py progress), and the paths of the pictures it logged to the
    run's MLflow store."""
    res, run_id = eval_cli_run.res, eval_cli_run.run_id
    assert res.returncode == 0 and "Traceback" not in res.stdout + res.stderr, res.stdout[-3000:] + res.stderr
    out = res.stdout
    # 16 validation rows in batches of 4: by position 4 batches; 2x rows of 2 windows, 2 per batch: 8 batches (the
    # first validation row has a window before it: the stream is 64 train windows then 16 val); passkey: 2 lengths
    for desc, total in (("eval by position", 4), ("eval 2x", 8)):
        counts = [int(n) for n in re.findall(rf"^{desc}  batch (\d+)/{total}  elapsed \d+m\d\ds  eta (?:\d+m\d\ds|\?)$",
                                             out, re.M)]
        assert counts and counts[0] == 1 and counts[-1] == total and counts == sorted(counts), out
    assert re.search(r"^passkey  batch 1/\d+  elapsed", out, re.M), out
    # each measure's progress comes before its result
    assert out.index("eval 2x  batch 1/8") < out.index("eval 2x: rows of 257 tokens")

    assert f"eval: long-context metrics and pictures logged to MLflow run {run_id}" in out
    paths = [Path(p) for p in re.findall(r"^eval: (/\S+\.(?:png|json))$", out, re.M)]
    assert [p.name for p in paths] == ["position_loss.png", "passkey_heatmap.png", "passkey_grid.json"], out
    for p in paths:
        assert p.is_file() and run_id in str(p), p


@pytest.mark.parametrize("argv, error", [
    (["eval", "--seq-len", "1x"], "--seq-len '1x': give factors of the trained row length of at least 2"),
    (["eval", "--passkey", "--passkey-lengths", "1k"], "--passkey-lengths '1k': give positive token counts"),
    (["eval", "--passkey-lengths", "64"], "--passkey-lengths sets the passkey grid: add --passkey"),
    (["eval", "--passkey", "--passkey-trials", "0"], "--passkey-trials 0: give at least 1 key per grid cell"),
    (["train", "--by-position"], "--by-position, --seq-len and --passkey are options of the eval stage"),
])
def test_bad_long_context_options_are_one_line_before_anything_loads(argv, error, capsys):
    from pipeline.run import main

    assert main(argv + ["--checkpoint", "/nonexistent/checkpoint"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {error}"), err


def test_a_prompt_too_short_for_its_fixed_text_is_a_clear_error(base):
    from pipeline.eval.passkey import PasskeyError, passkey_grid
    from pipeline.train.engine import Engine

    decoder = Engine(config(), base.tokenizer.vocab_size, torch.device("cpu")).module.decoder
    with pytest.raises(PasskeyError, match=r"every passkey length \(40\) is shorter than the prompt's fixed text"):
        passkey_grid(decoder, base.tokenizer, pk.haystack_tokens(base.dataset), [40])
