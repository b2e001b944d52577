"""Fixtures of the sweep tests."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest


def write_corpus(path: Path) -> Path:
    """60 documents of Python's own help topics (no download), one JSON line each."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    with open(path, "w") as f:
        for k in sorted(topics)[:60]:
            f.write(json.dumps({"text": topics[k][:3000]}) + "\n")
    return path


@pytest.fixture(scope="package")
def sweep_files(tmp_path_factory) -> tuple[Path, Path]:
    """(corpus, run root) shared by the two end-to-end sweeps (test_tune.py's batch-size sweep and
    test_mixer_sweep.py's): one corpus file with the same data settings under one run root, so whichever runs
    second finds the dataset the first prepared in the content-hash cache instead of preparing it again
    (~10 s on 2 cores). Each sweep keeps its own <root>/tune/<name> and MLflow experiment."""
    d = tmp_path_factory.mktemp("sweep_files")
    return write_corpus(d / "corpus.jsonl"), d / "runs"


MIXER_SPACE = Path(__file__).resolve().parents[3] / "tune_spaces" / "mixer_tier.yaml"
MIXER_BUDGET = 4 * 2 * 32  # tokens per trial: 4 steps of 2 rows of 32 tokens
PASSKEY_LENGTHS = [160]  # the vocab-400 tokenizer's passkey prompt needs ~140 tokens of fixed text


@dataclass
class MixerSweep:
    """tune_spaces/mixer_tier.yaml run on nano at a tiny budget (one parent run, a child per model family), with
    train.eval_by_position on, and each child's final checkpoint then evaluated by the eval stage's long-context
    measures (by position, 2x rows, passkey) logged into that child run."""
    uri: str  # the session's MLflow server
    experiment: str
    out: str  # what `python pipeline/run.py tune` printed
    runs: Path  # run.root
    checkpoints: dict[str, Path]  # model.mixer -> the trial's last checkpoint
    reports: dict  # model.mixer -> pipeline/eval/long_context.py LongContextReport


@pytest.fixture(scope="package")
def mixer_sweep(ray_session, mlflow_server, sweep_files, tmp_path_factory) -> MixerSweep:
    """The mixer sweep of test_mixer_sweep.py, shared with the MLflow UI browser test (test_mlflow_ui.py)."""
    import contextlib
    import io

    import yaml
    from mlflow.tracking import MlflowClient

    from pipeline.cli.eval import evaluate_long_context
    from pipeline.eval.long_context import log_long_context
    from pipeline.run import main
    from pipeline.train.checkpoints.state import read_checkpoint_meta

    tmp = tmp_path_factory.mktemp("mixer_sweep")
    doc = yaml.safe_load(MIXER_SPACE.read_text())
    doc.update(token_budget=MIXER_BUDGET, max_concurrent_trials=2,
               scheduler={**doc["scheduler"], "grace_period": MIXER_BUDGET},
               resources_per_trial={"num_workers": 1, "cpus_per_worker": 1, "use_gpu": "false"})
    doc["fixed"].update({"train.checkpoint_every": 2, "train.eval_every": 2, "train.log_every": 2,
                         "train.eval_batches": 1, "train.batch_size": 2, "train.eval_by_position": True})
    doc["params"]["model.tier"] = {"grid": ["nano"]}
    space = tmp / "mixer_tier.yaml"
    space.write_text(yaml.safe_dump(doc))
    uri, _ = mlflow_server
    corpus, runs = sweep_files  # shared with test_tune.py's sweep: one prepared dataset for both
    args = ["tune", "--space", str(space), "--preset", "test", f"--run.root={runs}",
            "--data.source=files", f"--data.path={corpus}", "--data.seq_len=32",
            "--data.vocab_size=400", "--data.max_documents=0", "--data.val_fraction=0.1",
            "--data.tokenize_actors=1", f"--tracking.tracking_uri={uri}", "--tracking.experiment=mixer-sweep",
            "--run.name=mixers"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(args) == 0

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("mixer-sweep")
    checkpoints, reports = {}, {}
    for meta_file in sorted((runs / "tune" / "mixers" / "trials").rglob("meta.json")):
        meta = read_checkpoint_meta(meta_file.parent)
        if meta["counters"]["step"] == 4:  # each trial's last checkpoint
            checkpoints[meta["config"]["model"]["mixer"]] = meta_file.parent
    for mixer, ckpt in sorted(checkpoints.items()):
        child = client.search_runs([exp.experiment_id], f"params.`model.mixer` = '{mixer}'")[0]
        reports[mixer] = evaluate_long_context(ckpt, by_position=True, factors=[2], passkey=True,
                                               passkey_lengths=PASSKEY_LENGTHS, passkey_trials=2, echo=lambda s: None)
        log_long_context(reports[mixer], uri, child.info.run_id, title=child.info.run_name)
    return MixerSweep(uri, "mixer-sweep", out.getvalue(), runs, checkpoints, reports)
