"""tune_spaces/mixer_tier.yaml, shrunk to the nano tier and a few hundred tokens per trial, run through
`python pipeline/run.py tune` against a real MLflow server: one parent run, a child per model family, and the
sweep table with both families side by side. About a minute on 2 cores."""
from __future__ import annotations

from pathlib import Path

import yaml

from pipeline.config import load_config
from pipeline.sweep.space import load_space
from pipeline.sweep.tune import TAG_SWEEP
from pipeline.tracking.tracker import PARENT_RUN_TAG

ROOT = Path(__file__).resolve().parents[3]
SPACE = ROOT / "tune_spaces" / "mixer_tier.yaml"


def test_the_shipped_space_sweeps_both_families_at_equal_tokens():
    space = load_space(SPACE, load_config("gpu"))
    assert space.params["model.mixer"].values() == ["attention", "resonance"]
    assert space.params["model.mixer"].kind == "grid" and space.params["model.tier"].kind == "grid"
    assert space.token_budget > 0 and space.scheduler["grace_period"] >= space.token_budget  # nobody stopped early


def test_mixer_sweep_gives_one_parent_with_a_child_per_family(ray_session, mlflow_server, sweep_files, tmp_path,
                                                             capsys):
    from mlflow.tracking import MlflowClient

    from pipeline.run import main

    doc = yaml.safe_load(SPACE.read_text())
    tiny_budget = 4 * 2 * 32  # 4 steps of 2 rows of 32 tokens
    doc.update(token_budget=tiny_budget, max_concurrent_trials=2,
               scheduler={**doc["scheduler"], "grace_period": tiny_budget},
               resources_per_trial={"num_workers": 1, "cpus_per_worker": 1, "use_gpu": "false"})
    doc["fixed"].update({"train.checkpoint_every": 2, "train.eval_every": 2, "train.log_every": 2,
                         "train.eval_batches": 1, "train.batch_size": 2})
    doc["params"]["model.tier"] = {"grid": ["nano"]}
    space = tmp_path / "mixer_tier.yaml"
    space.write_text(yaml.safe_dump(doc))
    uri, _ = mlflow_server
    corpus, runs = sweep_files  # shared with test_tune.py's sweep: one prepared dataset for both
    args = ["tune", "--space", str(space), "--preset", "test", f"--run.root={runs}",
            "--data.source=files", f"--data.path={corpus}", "--data.seq_len=32",
            "--data.vocab_size=400", "--data.max_documents=0", "--data.val_fraction=0.1",
            "--data.tokenize_actors=1", f"--tracking.tracking_uri={uri}", "--tracking.experiment=mixer-sweep",
            "--run.name=mixers"]
    assert main(args) == 0
    out = capsys.readouterr().out

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("mixer-sweep")
    parents = client.search_runs([exp.experiment_id], f"tags.`{TAG_SWEEP}` = 'mixers' and attributes.run_name = 'mixers'")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    children = client.search_runs([exp.experiment_id], f"tags.`{PARENT_RUN_TAG}` = '{parents[0].info.run_id}'")
    by_mixer = {c.data.params["model.mixer"]: c for c in children}
    assert sorted(by_mixer) == ["attention", "resonance"] and len(children) == 2
    for child in children:
        assert child.info.status == "FINISHED" and child.data.params["model.tier"] == "nano"
        assert child.data.metrics["train/tokens_seen"] == tiny_budget  # the same data budget for both
        assert child.data.metrics["val/loss"] > 0
    assert by_mixer["attention"].data.params["model.params"] != by_mixer["resonance"].data.params["model.params"]

    # The table: a model.mixer column, one row per family, printed and logged to the parent run
    table = (runs / "tune" / "mixers" / "sweep_table.md").read_text()
    assert ("| tier | batch size | model.mixer | tokens/s | MFU | timed steps | peak memory (GiB) | val/loss | status "
            "| trial |" in table)
    for mixer, child in by_mixer.items():
        assert f"| nano | 2 | {mixer} | " in table and f"{child.data.metrics['val/loss']:.4f} | ok |" in table
    assert "| nano | 2 | resonance | " in out
