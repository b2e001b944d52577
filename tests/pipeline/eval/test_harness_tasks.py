"""The downstream tasks' settings, names and report without a model (quick tier): the eval config section's one-line
errors, how eval.tasks is resolved, the harness's result keys to metric names, the report's metrics, tags and
console line, the cloze items made from held-out documents, the curves' picture, and a sweep ranked by a task."""
from __future__ import annotations

import json

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.eval.builtin_tasks import CLOZE_WORDS, cloze_items, write_items
from pipeline.eval.harness_tasks import (TaskError, TaskReport, TaskResult, _metric_name, failed_report,
                                         resolve_tasks, summary_line)
from pipeline.tracking.names import parse_task_metric, task_metric, task_seconds, task_status_tag, task_stderr


@pytest.mark.parametrize("field, value, words", [
    ("eval.tasks", "hellaswag,--limit", "separated by commas"),
    ("eval.tasks", "two words", "separated by commas"),
    ("eval.num_fewshot", "-2", "-1 for each task's own"),
    ("eval.limit", "2.5", "a count >= 1, or a share"),
    ("eval.limit", "-1", "a count >= 1, or a share"),
    ("eval.every_checkpoints", "0", "must be > 0"),
    ("eval.gpus", "2", "in [0, 1]"),
    ("eval.cpus", "-1", "must be >= 0"),
])
def test_bad_eval_settings_are_one_line(field, value, words):
    with pytest.raises(ConfigError) as err:
        load_config("test", [f"--{field}={value}"])
    assert field in str(err.value) and words in str(err.value) and "\n" not in str(err.value)


def test_the_cpu_preset_scores_the_cloze_task_and_the_test_preset_nothing():
    assert load_config("cpu").eval.tasks == "builtin_cloze"
    assert load_config("test").eval.tasks == ""
    assert load_config("test", ["--eval.tasks=builtin_cloze, arc_easy", "--eval.limit=0.5"]).eval.limit == 0.5


def test_tasks_resolve_to_what_the_harness_is_handed(tmp_path):
    good = tmp_path / "mine.yaml"
    good.write_text("task: my_qa\ndataset_path: json\ndoc_to_text: !function utils.prompt\n")
    specs = resolve_tasks(f"hellaswag,{good}")
    assert [(s.name, s.task, s.include_path) for s in specs] == [("hellaswag", "hellaswag", None),
                                                                  ("my_qa", "my_qa", str(tmp_path))]
    with pytest.raises(TaskError, match="does not exist"):
        resolve_tasks(str(tmp_path / "missing.yaml"))
    (tmp_path / "nameless.yml").write_text("dataset_path: json\n")
    with pytest.raises(TaskError, match="no `task:` name"):
        resolve_tasks(str(tmp_path / "nameless.yml"))
    with pytest.raises(TaskError, match="held-out documents"):
        resolve_tasks("builtin_cloze")  # no dataset (a registered model)


def test_result_keys_become_metric_names():
    assert _metric_name("acc,none") == "acc"
    assert _metric_name("exact_match,strict-match") == "exact_match_strict-match"
    assert _metric_name("alias") is None
    assert parse_task_metric(task_metric("builtin_cloze", "acc_norm")) == ("builtin_cloze", "acc_norm")
    assert parse_task_metric("val/loss") is None


def test_the_report_names_its_metrics_tags_and_line():
    report = TaskReport(50, [TaskResult("builtin_cloze", {"acc": 0.31}, {"acc": 0.03}, samples=40, seconds=2.0),
                             TaskResult("hellaswag", failed="ConnectionError: offline")])
    assert report.metrics() == {task_metric("builtin_cloze", "acc"): 0.31, task_stderr("builtin_cloze", "acc"): 0.03,
                                task_seconds("builtin_cloze"): 2.0}
    assert report.tags() == {task_status_tag("builtin_cloze"): "ok at step 50",
                             task_status_tag("hellaswag"): "FAILED at step 50: ConnectionError: offline"}
    line = summary_line(report, 3.25)
    assert line == "eval: tasks at step 50 (3.2 s): builtin_cloze acc=0.31±0.03; hellaswag FAILED"
    failed = failed_report("a,b", 7, "the checkpoint did not load")
    assert failed.failures == {"a": "the checkpoint did not load", "b": "the checkpoint did not load"}


def test_cloze_items_are_passages_and_their_next_words_in_four_orders(tmp_path):
    docs = [" ".join(f"w{d}_{i}" for i in range(80)) for d in range(6)] + ["too short to be used"]
    items = cloze_items(docs, seed=3)
    assert len(items) == 6 and items == cloze_items(docs, seed=3)
    for item in items:
        assert len(item["choices"]) == 4 and len(set(item["choices"])) == 4
        assert len({tuple(sorted(c.split())) for c in item["choices"]}) == 1  # the same words in each
        answer = item["choices"][item["label"]].split()
        context = item["context"].split()
        assert len(answer) == CLOZE_WORDS
        assert [int(w.split("_")[1]) for w in context + answer] == list(range(len(context) + CLOZE_WORDS))
    path = write_items(tmp_path / "x" / "builtin_cloze.jsonl", items)
    assert [json.loads(line) for line in path.read_text().splitlines()] == items


def test_the_curves_picture_has_a_panel_per_task(tmp_path):
    from pipeline.tracking.task_curves import plot_task_curves

    png = plot_task_curves({"builtin_cloze": {"acc": [(50, 0.3, 0.03), (100, 0.35, 0.03)]}},
                           tmp_path / "eval_tasks.png", title="t", failed={"hellaswag": "FAILED at step 50: x"})
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_sweep_ranks_by_a_task_metric(tmp_path):
    from pipeline.sweep.report import OK, TrialRow
    from pipeline.sweep.results import best_by_task
    from pipeline.sweep.space import SpaceError, load_space

    path = tmp_path / "space.yaml"
    path.write_text("rank_by: eval/builtin_cloze/acc_norm\nrank_mode: max\nfixed: {eval.tasks: builtin_cloze}\n"
                    "params:\n  train.lr: {choice: [0.001, 0.003]}\n")
    space = load_space(path)
    assert (space.rank_by, space.rank_mode, space.metric) == ("eval/builtin_cloze/acc_norm", "max", "val/loss")
    path.write_text("rank_by: val/loss\nparams:\n  train.lr: {choice: [0.001]}\n")
    with pytest.raises(SpaceError, match="not a downstream task's metric"):
        load_space(path)
    rows = [TrialRow(str(i), {}, "nano", 4, None, None, 3.0 - i, OK, extra={space.rank_by: v})
            for i, v in enumerate([0.30, 0.42, 0.35])]
    assert best_by_task(rows, space.rank_by, "max").trial_id == "1"
    assert best_by_task(rows, space.rank_by, "min").trial_id == "0"
