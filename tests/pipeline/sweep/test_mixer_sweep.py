"""tune_spaces/mixer_tier.yaml, shrunk to the nano tier and a few hundred tokens per trial, run through
`python pipeline/run.py tune` against a real MLflow server (the package fixture `mixer_sweep`, conftest.py): one
parent run, a child per model family, the sweep table with both families side by side, and in each child the loss
by position in the document at every evaluation (train.eval_by_position, under Ray Train) and the eval stage's
long-context measures. About a minute on 2 cores."""
from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.sweep.space import load_space
from pipeline.sweep.trial import TAG_SWEEP
from pipeline.tracking.names import PARENT_RUN_TAG
from tests.pipeline.sweep.conftest import MIXER_BUDGET, MIXER_SPACE, PASSKEY_LENGTHS


def test_the_shipped_space_sweeps_both_families_at_equal_tokens():
    space = load_space(MIXER_SPACE, load_config("gpu"))
    assert space.params["model.mixer"].values() == ["attention", "resonance"]
    assert space.params["model.mixer"].kind == "grid" and space.params["model.tier"].kind == "grid"
    assert space.token_budget > 0 and space.scheduler["grace_period"] >= space.token_budget  # nobody stopped early


def _children(mixer_sweep):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mixer_sweep.uri)
    exp = client.get_experiment_by_name(mixer_sweep.experiment)
    parents = client.search_runs([exp.experiment_id], f"tags.`{TAG_SWEEP}` = 'mixers' and attributes.run_name = 'mixers'")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    children = client.search_runs([exp.experiment_id], f"tags.`{PARENT_RUN_TAG}` = '{parents[0].info.run_id}'")
    return client, {c.data.params["model.mixer"]: c for c in children}, len(children)


@pytest.mark.system
def test_mixer_sweep_gives_one_parent_with_a_child_per_family(mixer_sweep):
    _, by_mixer, n_children = _children(mixer_sweep)
    assert sorted(by_mixer) == ["attention", "resonance"] and n_children == 2
    for child in by_mixer.values():
        assert child.info.status == "FINISHED" and child.data.params["model.tier"] == "nano"
        assert child.data.metrics["train/tokens_seen"] == MIXER_BUDGET  # the same data budget for both
        assert child.data.metrics["val/loss"] > 0
    assert by_mixer["attention"].data.params["model.params"] != by_mixer["resonance"].data.params["model.params"]

    # The table: a model.mixer column, one row per family, printed and logged to the parent run
    table = (mixer_sweep.runs / "tune" / "mixers" / "sweep_table.md").read_text()
    assert ("| tier | batch size | model.mixer | tokens/s | MFU | timed steps | peak memory (GiB) | val/loss | status "
            "| trial |" in table)
    for mixer, child in by_mixer.items():
        assert f"| nano | 2 | {mixer} | " in table and f"{child.data.metrics['val/loss']:.4f} | ok |" in table
    assert "| nano | 2 | resonance | " in mixer_sweep.out


@pytest.mark.system
def test_each_family_logs_loss_by_position_at_every_evaluation_and_the_long_context_eval(mixer_sweep, tmp_path):
    client, by_mixer, _ = _children(mixer_sweep)
    for mixer, child in by_mixer.items():
        run_id, metrics = child.info.run_id, child.data.metrics
        # Rows of 32 tokens: one bucket, 1-32; evaluated at steps 2 and 4 by the Ray Train workers
        assert [m.step for m in client.get_metric_history(run_id, "val/pos_loss/1-32")] == [2, 4]
        assert metrics["val/pos_tokens/1-32"] > 0 and metrics["val/pos_docs/1-32"] >= 1
        assert 0 < metrics["val/pos_loss/1-32"] < 10 and metrics["val/cum_ppl/32"] > 1
        # The eval stage on the final checkpoint, logged at its step: by position, 2x rows, passkey
        report = mixer_sweep.reports[mixer]
        assert report.step == 4 and metrics["eval/pos_loss/1-32"] == report.positions["eval"].buckets[0].loss
        assert metrics["eval_2x/loss"] == report.metrics["eval_2x/loss"] > 0
        assert {b.name for b in report.positions["eval_2x"].buckets} == {"1-64", "64-65"}
        assert metrics["passkey/accuracy"] == report.passkey.mean_accuracy
        assert report.passkey.lengths == PASSKEY_LENGTHS and report.passkey.accuracy.shape == (1, 5)
        # The pictures: position_loss.png with a line per evaluation, the passkey heatmap and its grid
        artifacts = {a.path for a in client.list_artifacts(run_id)}
        assert {"position_loss.png", "passkey_heatmap.png", "passkey_grid.json"} <= artifacts, artifacts
        png = Path(client.download_artifacts(run_id, "position_loss.png", str(tmp_path)))
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
