"""tune_spaces/mixture_weights.yaml on the session's three-source mixture (built-in corpus, local JSONL, JSONL in the
bucket), shrunk to the nano tier and four steps per trial, run through `python pipeline/run.py tune` against a real
MLflow server: a child run per named mixture, the sweep table with a column per source's validation loss, and the
winning mixture in best_preset.yaml. The space's own rules (named mixtures, simplex draws, their errors) first.

    .venv/bin/python -m pytest -q tests/pipeline/sweep/test_mixture_sweep.py
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pipeline.config import load_config
from pipeline.mixture_spec import parse_mixture
from pipeline.sweep.space import DirichletWeights, SpaceError, load_space, resolve_mixture
from pipeline.sweep.trial import TAG_SWEEP
from pipeline.tracking.names import PARENT_RUN_TAG

ROOT = Path(__file__).resolve().parents[3]
SPACE = ROOT / "tune_spaces" / "mixture_weights.yaml"
SOURCES = [{"name": "web", "weight": 0.5, "source": "builtin"},
           {"name": "code", "weight": 0.5, "source": "files", "path": "code/*.jsonl"}]


def _space(tmp_path: Path, params: dict, mixture: list | None = SOURCES) -> Path:
    doc = {"params": params, "fixed": {"data.mixture": mixture} if mixture else {}}
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_the_shipped_space_names_three_mixtures_of_its_sources():
    space = load_space(SPACE, load_config("gpu"))
    names = [s.name for s in parse_mixture(space.fixed["data.mixture"])]
    assert list(space.mixtures()) == ["web_heavy", "balanced", "code_heavy"] and names == ["web", "code", "stories"]
    assert [s.weight for s in parse_mixture(space.mixtures()["code_heavy"])] == [0.3, 0.5, 0.2]
    assert space.token_budget > 0 and space.scheduler["grace_period"] >= space.token_budget  # compared at the end


def test_weights_drawn_on_the_simplex_and_the_space_errors(tmp_path):
    space = load_space(_space(tmp_path, {"data.mixture": {"simplex": {"web": 1.0, "code": 2.0}}}), load_config("test"))
    draw = DirichletWeights(space.params["data.mixture"].named)()
    weights = {k: float(v) for k, v in (x.split("=") for x in draw.split(","))}
    assert set(weights) == {"web", "code"} and abs(sum(weights.values()) - 1) < 1e-3 and min(weights.values()) >= 0
    base = space.fixed["data.mixture"]
    got = parse_mixture(resolve_mixture(draw, base, {}))
    assert [(s.name, s.weight) for s in got] == [("web", weights["web"]), ("code", weights["code"])]
    assert got[1].overrides()["data.path"] == "code/*.jsonl"  # the sources stay the base mixture's

    cases = [({"data.mixture": {"mixtures": {"a": {"web": 1, "books": 1}}}}, SOURCES,
              "params data.mixture mixtures a: 'books' is not a source of the base mixture (web, code)"),
             ({"data.mixture": {"simplex": {"web": 0}}}, SOURCES, "simplex: web=0 must be a number > 0"),
             ({"data.mixture": {"mixtures": {"a": {"web": 0, "code": 0}}}}, SOURCES, "every weight is 0"),
             ({"data.mixture": {"dirichlet": {"web": 1}}}, SOURCES, "is not a mixture distribution; write {KIND: ARGS}"),
             ({"data.mixture": {"mixtures": {"a": {"web": 1}}}}, None,
              "params data.mixture searches the weights of the base config's mixture, and it has none"),
             ({"data.path": {"grid": ["a", "b"]}}, SOURCES, "data.mixture's weights are the exception")]
    for params, mixture, message in cases:
        with pytest.raises(SpaceError) as err:
            load_space(_space(tmp_path, params, mixture), load_config("test"))
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.system
def test_a_sweep_over_three_named_mixtures(ray_session, mlflow_server, mixture_setup, tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    from pipeline.run import main

    doc = yaml.safe_load(SPACE.read_text())
    budget = 4 * 4 * 64  # 4 steps of 4 rows of 64 tokens
    named = {"std_heavy": {"std": 0.8, "topics": 0.1, "notes": 0.1}, "even": {"std": 0.34, "topics": 0.33,
             "notes": 0.33}, "notes_heavy": {"std": 0.2, "topics": 0.2, "notes": 0.6}}
    doc.update(token_budget=budget, max_concurrent_trials=3, scheduler={**doc["scheduler"], "grace_period": budget},
               resources_per_trial={"num_workers": 1, "cpus_per_worker": 1, "use_gpu": "false"},
               params={"data.mixture": {"mixtures": named}})
    doc["fixed"].update({"train.checkpoint_every": 2, "train.eval_every": 2, "train.log_every": 2,
                         "train.eval_batches": 1, "data.mixture": mixture_setup.mixture})
    space = tmp_path / "mixture_weights.yaml"
    space.write_text(yaml.safe_dump(doc))
    uri, _ = mlflow_server
    # the session's sources and their shared tokenizer are found in the cache by their hashes: nothing is prepared
    assert main(["tune", "--space", str(space), "--preset", "test", *mixture_setup.overrides,
                 f"--tracking.tracking_uri={uri}", "--tracking.experiment=mixture-sweep", "--run.name=mixes"]) == 0
    out = capsys.readouterr().out

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("mixture-sweep")
    parent = client.search_runs([exp.experiment_id], f"tags.`{TAG_SWEEP}` = 'mixes' and attributes.run_name = 'mixes'")
    children = client.search_runs([exp.experiment_id], f"tags.`{PARENT_RUN_TAG}` = '{parent[0].info.run_id}'")
    assert len(children) == 3 and all(c.info.status == "FINISHED" for c in children)
    by_weights = {}
    for child in children:
        p = child.data.params
        by_weights[(p["mixture/std/weight"], p["mixture/topics/weight"], p["mixture/notes/weight"])] = child
        assert child.data.metrics["train/tokens_seen"] == budget
        assert {"val/std/loss", "val/topics/loss", "val/notes/loss", "val/notes/bpb"} <= set(child.data.metrics)
        assert len(child.inputs.dataset_inputs) == 3  # one MLflow dataset input per source
    assert set(by_weights) == {("0.8", "0.1", "0.1"), ("0.34", "0.33", "0.33"), ("0.2", "0.2", "0.6")}

    table = (mixture_setup.run_root / "tune" / "mixes" / "sweep_table.md").read_text()
    header = next(line for line in table.splitlines() if line.startswith("| tier"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    assert cols[:3] == ["tier", "batch size", "data.mixture"] and cols[-2:] == ["status", "trial"]
    assert {"val/loss", "val/std/loss", "val/topics/loss", "val/notes/loss"} <= set(cols)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()
            if line.startswith("| nano")]
    assert sorted(r[2] for r in rows) == ["even", "notes_heavy", "std_heavy"]
    for r in rows:
        child = by_weights[tuple(str(named[r[2]][s]) for s in ("std", "topics", "notes"))]
        for s in ("std", "topics", "notes"):
            assert r[cols.index(f"val/{s}/loss")] == f"{child.data.metrics[f'val/{s}/loss']:.4f}"
        assert r[cols.index("status")] == "ok"
    assert "| nano | 4 | notes_heavy | " in out

    # the winning mixture is in the preset, as the list of sources with its weights
    preset = mixture_setup.run_root / "tune" / "mixes" / "best_preset.yaml"
    best = min(rows, key=lambda r: float(r[cols.index("val/loss")]))[2]
    assert yaml.safe_load(preset.read_text())["data"]["mixture"][2]["weight"] == named[best]["notes"]
    cfg = load_config(str(preset))
    assert {s.name: s.weight for s in parse_mixture(cfg.data.mixture)} == named[best]
    assert json.loads(cfg.data.mixture)[1]["path"] == mixture_setup.mixture[1]["path"]
