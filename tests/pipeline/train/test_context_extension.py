"""Context-extension phases (Ray-free): a 256 -> 1,024 run whose second phase changes the RoPE base continues
from the first phase's weights (its first loss is near the first phase's last, far below a fresh model's), keeps
the tokens per optimizer step, re-warms the learning rate inside the one schedule and resets AdamW's moments;
plus the phase keys' and RoPE fields' one-line errors, the long-32k preset's phases, and the resonance note."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from pipeline.config import ConfigError, load_config
from pipeline.train.engine import lr_lambda
from pipeline.train.session.train_session import Phase, TrainSession, keep_tokens_per_step, load_phases, parse_phases
from tests.pipeline.train.hf_helpers import build_dataset

SHORT, LONG = 256, 1024
PHASE1, PHASE2 = 20, 4


def _history(uri: str, run_id: str, name: str) -> dict[int, float]:
    from mlflow.tracking import MlflowClient

    return {m.step: m.value for m in MlflowClient(uri).get_metric_history(run_id, name)}


@pytest.fixture(scope="module")
def two_phase_run(tmp_path_factory, mlflow_server):
    """Phase 0: 20 steps at 256 tokens, RoPE base 10,000, 4 rows per step. Phase 1: 4 steps at 1,024 tokens,
    base 500,000, re-warmup over 3 steps, optimizer reset. Both datasets share one tokenizer and are packed here."""
    root = tmp_path_factory.mktemp("ctx_ext")
    cfg, ds_short = build_dataset(root / "short", seq_len=SHORT, overrides={
        "model.rope_theta": 10_000.0, "train.batch_size": 4, "train.lr": 5e-3, "train.warmup_steps": 4,
        "train.log_every": 1, "train.eval_every": 100, "train.checkpoint_every": 100, "run.root": str(root / "runs"),
        "tracking.tracking_uri": mlflow_server[0], "tracking.experiment": "context-extension",
        "tracking.system_metrics": False})
    long_cfg, ds_long = build_dataset(root / "long", seq_len=LONG, tokenizer=Path(cfg.data.tokenizer))
    phases = [Phase(PHASE1),
              Phase(PHASE2, {"data.seq_len": LONG, "data.dataset_dir": str(ds_long), "data.path": long_cfg.data.path,
                             "model.rope_theta": 500_000.0}, lr_warmup_steps=3, reset_optimizer=True)]
    run_dir = root / "runs" / "ext"
    run_dir.mkdir(parents=True)
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = TrainSession(cfg, run_dir, phases, use_ray=False).run()
    record = json.loads((run_dir / "run.json").read_text())
    return cfg, result, record, out.getvalue()


@pytest.mark.system
def test_the_long_phase_continues_the_short_one(two_phase_run, mlflow_server):
    cfg, result, record, printed = two_phase_run
    assert record["phases_done"] == 2 and record["status"] == "finished"
    assert record["phases"][1] == {"steps": PHASE2, "overrides": record["phases"][1]["overrides"],
                                   "lr_warmup_steps": 3, "reset_optimizer": True}
    meta = json.loads((Path(result.checkpoint) / "meta.json").read_text())
    assert meta["counters"]["step"] == PHASE1 + PHASE2 and meta["seq_len"] == LONG
    assert meta["config"]["model"]["rope_theta"] == 500_000.0
    # tokens per optimizer step kept: 4 rows of 256 -> 1 row of 1,024, and the phase line says so
    assert (meta["config"]["train"]["batch_size"], meta["config"]["train"]["grad_accum"]) == (1, 1)
    assert ("phase 1: seq_len 1,024; RoPE theta 500,000; 1 x 1 rows of 1,024 = 1,024 tokens per step (kept; "
            "train.batch_size x train.grad_accum adjusted from 4 x 1)") in printed

    loss = _history(mlflow_server[0], record["mlflow_run_id"], "train/loss")
    assert sorted(loss) == list(range(1, PHASE1 + PHASE2 + 1))
    fresh, first_long = loss[1], loss[PHASE1 + 1]
    last_short = sum(loss[s] for s in range(PHASE1 - 2, PHASE1 + 1)) / 3  # the last three: less noise
    assert fresh > math.log(400) - 0.3  # a fresh model: about ln(vocab)
    assert fresh - last_short > 1.0, (fresh, last_short)  # phase 0 learned something worth carrying over
    # The first step at 1,024 tokens with the new base is a step of the trained model, not of a fresh one.
    assert abs(first_long - last_short) < 0.25 * (fresh - last_short), (fresh, last_short, first_long)


@pytest.mark.system
def test_the_long_phase_rewarms_the_learning_rate_and_resets_adamw(two_phase_run, mlflow_server):
    cfg, result, record, _ = two_phase_run
    t = cfg.train
    lr = _history(mlflow_server[0], record["mlflow_run_id"], "train/lr")  # logged after step s: the lr of step s+1
    total = PHASE1 + PHASE2
    plain = {s: t.lr * lr_lambda(s, t.warmup_steps, total, t.min_lr_ratio) for s in range(total + 1)}
    assert lr[PHASE1] == pytest.approx(plain[PHASE1])  # phase 0 knew of no re-warmup
    for s in range(PHASE1 + 1, total + 1):  # phase 1's ramp 2/3, 3/3, then the schedule as it was
        ramp = min(1.0, (s - PHASE1 + 1) / 3)
        assert lr[s] == pytest.approx(plain[s] * ramp), s
    state = torch.load(Path(result.checkpoint) / "train_state.pt", weights_only=True)
    steps = {float(v["step"]) for v in state["optimizer"]["state"].values()}
    assert steps == {float(PHASE2)}, "AdamW's moments were not reset at the phase start"


def test_tokens_per_step_rules():
    base = load_config("test", {"data.seq_len": 256, "train.batch_size": 8, "train.grad_accum": 2})
    longer, note = keep_tokens_per_step(base, base.replace({"data.seq_len": 2048}), {"data.seq_len": 2048})
    assert (longer.train.batch_size, longer.train.grad_accum) == (1, 2) and "(kept;" in note
    shorter, _ = keep_tokens_per_step(base, base.replace({"data.seq_len": 128}), {"data.seq_len": 128})
    assert shorter.train.batch_size * shorter.train.grad_accum * 128 == 8 * 2 * 256
    assert shorter.train.batch_size * 128 <= 8 * 256
    over = {"data.seq_len": 2048, "train.batch_size": 2}
    explicit, note = keep_tokens_per_step(base, base.replace(over), over)
    assert explicit.train.batch_size == 2 and "set explicitly by the phase" in note
    odd, note = keep_tokens_per_step(base, base.replace({"data.seq_len": 1000}), {"data.seq_len": 1000})
    assert odd.train.batch_size * odd.train.grad_accum == 4 and "4,096 before" in note
    # a phase after an adjusted one, at the same seq_len, keeps the adjusted shape (not the base config's)
    again, note = keep_tokens_per_step(longer, base.replace({"data.seq_len": 2048}), {"data.seq_len": 2048})
    assert (again.train.batch_size, again.train.grad_accum) == (1, 2) and note == (
        "1 x 2 rows of 2,048 = 4,096 tokens per step")


@pytest.mark.parametrize("items, message", [
    ([{"steps": 5, "lr_warmup_steps": 2}], "phase 0 sets lr_warmup_steps, which applies where a phase continues"),
    ([{"steps": 5}, {"steps": 3, "lr_warmup_steps": 4}], "lr_warmup_steps=4; it must be an integer from 0 to"),
    ([{"steps": 5}, {"steps": 3, "reset_optimizer": "yes"}], "reset_optimizer='yes'; it must be true or false"),
    ([{"steps": 5}, {"steps": 3, "warmup": 2}], "must be a mapping with steps (and optional overrides, name,"),
    ([{"steps": 5}, {"steps": 3, "overrides": {"model.rope_scaling": "yarn"}}],
     "model.rope_scaling=yarn needs model.rope_original_max_len"),
])
def test_bad_phase_keys_are_one_line(items, message):
    with pytest.raises(ConfigError) as err:
        parse_phases(items, load_config("test"), "--phases p.yaml")
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("overrides, message", [
    ({"model.rope_theta": 1.0}, "model.rope_theta=1.0 is invalid; it must be a RoPE base > 1"),
    ({"model.rope_scaling": "ntk"}, "model.rope_scaling='ntk' is not allowed; choose one of: none, linear, yarn"),
    ({"model.rope_factor": 4}, "model.rope_factor=4.0 has no effect with model.rope_scaling=none"),
    ({"model.rope_scaling": "linear", "model.rope_factor": 0}, "model.rope_factor=0.0 is invalid; it must be > 0"),
    ({"model.rope_scaling": "yarn", "model.rope_factor": 4, "model.rope_original_max_len": 64,
      "model.rope_beta_fast": 0.5}, "model.rope_beta_fast=0.5 must be greater than model.rope_beta_slow=1.0"),
    ({"model.rope_scaling": "llama3", "model.rope_factor": 8, "model.rope_original_max_len": 64,
      "model.rope_high_freq_factor": 1.0}, "model.rope_high_freq_factor=1.0 must be greater than"),
    ({"model.rope_scaling": "llama3", "model.rope_factor": 0.5, "model.rope_original_max_len": 64},
     "model.rope_factor=0.5 is invalid with model.rope_scaling=llama3; it must be >= 1"),
])
def test_bad_rope_fields_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config("test", overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_long_32k_preset_brings_its_two_phases(monkeypatch):
    import pipeline.config as config

    monkeypatch.setattr(config, "_cuda", lambda: False)
    cfg = load_config("long-32k")
    phases = load_phases(None, cfg, preset="long-32k")
    assert (cfg.model.tier, cfg.data.seq_len, cfg.model.rope_theta) == ("nano", 256, 10_000.0)
    assert [p.steps for p in phases] == [150, 50] and phases[1].lr_warmup_steps == 10
    assert phases[1].overrides["data.seq_len"] == 1024 and phases[1].overrides["model.rope_scaling"] == "yarn"
    assert load_phases(None, cfg, preset="cpu") == [Phase(cfg.train.max_steps)]
    monkeypatch.setattr(config, "_cuda", lambda: True)
    gpu = load_config("long-32k")
    long_phase = load_phases(None, gpu, preset="long-32k")[1]
    assert (gpu.model.tier, gpu.data.seq_len, long_phase.overrides["data.seq_len"]) == ("A", 4096, 32768)
    assert gpu.replace(long_phase.overrides).model.rope_factor == 8.0


def test_resonance_ignores_rope_and_says_so_once(capsys):
    import pipeline.train.engine as engine

    engine._ROPE_NOTED = False
    cfg = load_config("test", {"model.mixer": "resonance", "model.rope_theta": 10_000.0})
    assert engine.model_rope(cfg) is None and engine.model_rope(cfg) is None
    assert capsys.readouterr().out.count("model.mixer=resonance has no RoPE; model.rope_theta and "
                                         "model.rope_scaling are ignored") == 1
    assert engine.model_rope(load_config("test", {"model.rope_theta": 10_000.0})).theta == 10_000.0


def test_a_refused_phases_file_leaves_no_run_directory(tmp_path):
    """`train --phases` with a file it refuses ends in one line before the run's directory is made: a rerun with
    the file fixed under the same --run.name is not told that the run already exists."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[3]
    phases = tmp_path / "p.yaml"
    phases.write_text("- steps: 5\n- steps: 3\n  warmup: 2\n")
    root = tmp_path / "runs"
    proc = subprocess.run([sys.executable, str(repo / "pipeline" / "run.py"), "train", "--no-ray", "--preset", "test",
                           "--phases", str(phases), f"--run.root={root}", "--run.name=ctx",
                           "--tracking.enabled=false"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    last = (proc.stdout + proc.stderr).strip().splitlines()[-1]
    assert last.startswith("error: ") and "must be a mapping with steps" in last, last
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not (root / "ctx").exists()
