"""Downstream tasks with lm-evaluation-harness over a loaded longtrain model: the harness owns the tasks, prompts,
few-shot sampling and metrics; pipeline/eval/harness_model.py answers its requests. Offline: nothing is downloaded.

    python pipeline/run.py eval runs/<run> --tasks builtin_cloze,hellaswag --limit 200   # pipeline/cli/eval.py
    python pipeline/run.py --eval.tasks=builtin_cloze,arc_easy                           # at each checkpoint

    require_harness()                                               # one line naming the extra when it is missing
    specs = resolve_tasks("builtin_cloze,my_tasks/qa.yaml", dataset_dir, manifest, tokenizer)
    report = score_tasks(LongtrainLM(decoder, tokenizer, seq_len), specs, num_fewshot=-1, limit=0, step=200)
    print(report.table()); log_task_report(report, tracking_uri, run_id)

A task is named as the harness names it: a name from its registry (hellaswag, arc_easy, lambada_openai: their
data must already be in the Hugging Face cache, since HF_DATASETS_OFFLINE and HF_HUB_OFFLINE are set unless the
environment says otherwise), a path to a task YAML of one's own (`dataset_path: json` with `data_files` reads local
files; its `task:` names it), or one of the tasks made from the dataset's held-out documents (builtin_cloze,
builtin_docs: pipeline/eval/builtin_tasks.py). Each task is scored on its own: one that fails (data not in the
cache, a broken YAML, an error while scoring) is one line and a FAILED mark for that task alone.

Metric names (pipeline/tracking/names.py): eval/<task>/<metric> and eval/<task>/<metric>_stderr at the
checkpoint's step (a metric under a filter other than the harness's `none` is <metric>_<filter>), the tag
longtrain.eval_task.<task> (ok or FAILED), and the picture eval_tasks.png of every task's curve over the steps.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from pipeline.config import eval_task_names
from pipeline.tracking.names import TASK_FAILED, task_metric, task_seconds, task_status_tag, task_stderr

EXTRA_LINE = ("lm-evaluation-harness is not installed, which eval.tasks and `eval --tasks` need; install the eval "
              "extra: pip install -e '.[eval]'")
OFFLINE_ENV = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")


class HarnessMissing(ImportError):
    """lm-eval is not installed; the message is the one line that names the extra."""


class TaskError(ValueError):
    """A task cannot be named as given (a YAML path that does not exist, a YAML without `task:`)."""


def harness_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("lm_eval") is not None


def require_harness() -> None:
    if not harness_installed():
        raise HarnessMissing(EXTRA_LINE)


def offline() -> None:
    """Nothing is downloaded: the Hugging Face libraries stay offline unless the environment set them already."""
    for name in OFFLINE_ENV:
        os.environ.setdefault(name, "1")


def quiet_harness() -> None:
    """The harness's and the datasets library's progress bars and INFO lines off (a line per request phase of every
    task, at every checkpoint): what a task scored or why it failed is said by the callers' own lines."""
    import functools
    import logging

    import datasets
    import lm_eval.api.task
    import lm_eval.evaluator
    from tqdm import tqdm

    datasets.disable_progress_bars()
    # the harness records `git describe` of the working directory in its results: not this model's (longtrain logs
    # its own commit), and git's "fatal: not a git repository" on stderr outside a checkout
    lm_eval.evaluator.get_git_commit_hash = lambda: None
    for module in (lm_eval.api.task, lm_eval.evaluator):
        if getattr(module, "tqdm", None) is tqdm:
            module.tqdm = functools.partial(tqdm, disable=True)
    for noisy in ("lm_eval", "lm-eval", "datasets", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


@dataclass
class TaskSpec:
    name: str  # the name it is shown and logged under (the YAML's `task:` for a file)
    task: Any  # what the harness is handed: a registry name or a task config dict
    include_path: str | None = None  # a YAML's folder: the harness indexes it for the YAML's `include:`s


def resolve_tasks(text: str, dataset_dir: str | Path | None = None, manifest=None, tokenizer=None) -> list[TaskSpec]:
    """eval.tasks as the harness is to be handed them. Builtin tasks need the dataset (its held-out documents);
    a YAML path is read here (TaskError when it does not exist or names no task); a registry name is passed on."""
    from pipeline.eval.builtin_tasks import BUILTIN_TASKS, builtin_task_config

    offline()
    specs = []
    for name in eval_task_names(text):
        if name in BUILTIN_TASKS:
            if dataset_dir is None:
                raise TaskError(f"{name} is made from a dataset's held-out documents, and this model has no dataset "
                                f"(a registered model); name registry tasks or task YAMLs instead")
            specs.append(TaskSpec(name, builtin_task_config(name, dataset_dir, manifest, tokenizer)))
        elif name.endswith((".yaml", ".yml")):
            path = Path(name).expanduser()
            if not path.is_file():
                raise TaskError(f"task file {name} does not exist; eval.tasks takes registry names (hellaswag), "
                                f"task YAML paths, or {', '.join(BUILTIN_TASKS)}")
            try:  # the harness's own loader reads its tags (!function); here only the task's name is wanted
                doc = yaml.load(path.read_text(), Loader=_NameOnlyLoader) or {}
            except yaml.YAMLError as exc:
                raise TaskError(f"task file {name} is not valid YAML: {str(exc).splitlines()[0]}") from None
            if not isinstance(doc, dict) or not isinstance(doc.get("task"), str):
                raise TaskError(f"task file {name} has no `task:` name; a harness task YAML names its task")
            specs.append(TaskSpec(doc["task"], doc["task"], str(path.resolve().parent)))
        else:
            specs.append(TaskSpec(name, name))
    return specs


class _NameOnlyLoader(yaml.SafeLoader):
    """SafeLoader that reads the harness's tags (!function module.name) as plain strings."""


_NameOnlyLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


@dataclass
class TaskResult:
    name: str
    metrics: dict[str, float] = field(default_factory=dict)  # metric (acc, acc_norm, ...) -> value
    stderr: dict[str, float] = field(default_factory=dict)
    samples: int = 0  # examples scored
    seconds: float = 0.0
    failed: str | None = None  # the one line of a task that could not be scored
    table: str = ""  # the harness's own table of this task (make_table)


@dataclass
class TaskReport:
    step: int
    results: list[TaskResult] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        """{eval/<task>/<metric>: value, eval/<task>/<metric>_stderr: value} of every task that was scored."""
        out: dict[str, float] = {}
        for r in self.results:
            for metric, value in r.metrics.items():
                out[task_metric(r.name, metric)] = value
            for metric, value in r.stderr.items():
                out[task_stderr(r.name, metric)] = value
            if r.metrics:
                out[task_seconds(r.name)] = r.seconds
        return {k: v for k, v in out.items() if math.isfinite(v)}

    @property
    def failures(self) -> dict[str, str]:
        return {r.name: r.failed for r in self.results if r.failed}

    def tags(self) -> dict[str, str]:
        """longtrain.eval_task.<task>: ok or FAILED, with the step (and the reason)."""
        return {task_status_tag(r.name): (f"{TASK_FAILED} at step {self.step}: {r.failed}" if r.failed
                                          else f"ok at step {self.step}") for r in self.results}

    def table(self) -> str:
        """The harness's table for the tasks scored, then one line per task that failed."""
        lines = [r.table.rstrip() for r in self.results if r.table]
        lines += [f"{r.name}: {TASK_FAILED}: {r.failed}" for r in self.results if r.failed]
        return "\n".join(lines)


def _metric_name(key: str) -> str | None:
    """The harness's result key `acc,none` -> acc, `exact_match,strict-match` -> exact_match_strict-match; None for
    what is not a metric (alias, name, sample_len) and for stderr keys (handled with their metric)."""
    if "," not in key:
        return None
    metric, filt = key.split(",", 1)
    return metric if filt == "none" else f"{metric}_{filt}"


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:300]


def score_tasks(lm, specs: list[TaskSpec], *, num_fewshot: int = -1, limit: float = 0.0, step: int = 0,
                echo: Callable[[str], None] = print, seed: int = 1234) -> TaskReport:
    """Score each task with `lm` (harness_model.LongtrainLM, or any harness LM) through lm_eval.simple_evaluate,
    one task at a time; a task that fails is recorded with its one line (echoed), the others go on."""
    offline()
    quiet_harness()
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import make_table

    report = TaskReport(step)
    managers: dict[tuple, Any] = {}
    for spec in specs:
        start = time.perf_counter()
        result = TaskResult(spec.name)
        try:
            registry = isinstance(spec.task, str) and spec.include_path is None
            key = (registry, spec.include_path)
            if key not in managers:  # indexing the registry's YAMLs takes seconds: only when a name needs it
                managers[key] = TaskManager(include_defaults=registry, include_path=spec.include_path)
            out = simple_evaluate(model=lm, tasks=[spec.task], task_manager=managers[key],
                                  num_fewshot=None if num_fewshot < 0 else num_fewshot,
                                  limit=None if not limit else (int(limit) if limit >= 1 else limit),
                                  log_samples=False, random_seed=seed, numpy_random_seed=seed,
                                  torch_random_seed=seed, fewshot_random_seed=seed)
            if out is None or not out.get("results"):
                raise RuntimeError("the harness returned no results")
            for task, values in out["results"].items():
                name = spec.name if task == spec.name or len(out["results"]) == 1 else task
                part = result if name == spec.name else TaskResult(name)
                for key_, value in values.items():
                    metric = _metric_name(key_)
                    if metric is None or not isinstance(value, (int, float)) or "_stderr" in key_.split(",")[0]:
                        continue
                    part.metrics[metric] = float(value)
                    err = values.get(key_.replace(",", "_stderr,", 1))
                    if isinstance(err, (int, float)):
                        part.stderr[metric] = float(err)
                if part is not result:
                    report.results.append(part)
            result.samples = sum(int(v.get("effective", v.get("original", 0)))
                                 for v in (out.get("n-samples") or {}).values())
            result.table = make_table(out)
        except Exception as exc:  # noqa: BLE001 -- any task's failure is that task's alone
            result.failed = _one_line(exc)
            echo(f"eval: task {spec.name} {TASK_FAILED}: {result.failed}")
        result.seconds = time.perf_counter() - start
        report.results.append(result)
    return report


def summary_line(report: TaskReport, seconds: float | None = None) -> str:
    """One console line: `eval: tasks at step 50 (12.3 s): builtin_cloze acc=0.312±0.033 ...; hellaswag FAILED`."""
    parts = []
    for r in report.results:
        if r.failed:
            parts.append(f"{r.name} {TASK_FAILED}")
            continue
        shown = [f"{m}={v:.4g}" + (f"±{r.stderr[m]:.2g}" if m in r.stderr else "") for m, v in r.metrics.items()]
        parts.append(f"{r.name} " + " ".join(shown))
    took = f" ({seconds:.1f} s)" if seconds is not None else ""
    return f"eval: tasks at step {report.step}{took}: " + "; ".join(parts)


def failed_report(specs_text: str, step: int, reason: str) -> TaskReport:
    """A report in which every task of eval.tasks failed for one `reason` (the model did not load, the harness is
    missing): each gets its FAILED mark."""
    return TaskReport(step, [TaskResult(name, failed=reason) for name in eval_task_names(specs_text)])


def log_task_report(report: TaskReport, tracking_uri: str, run_id: str, title: str | None = None,
                    attempts: int = 3) -> str | None:
    """The report's metrics at its step, its tags, and eval_tasks.png redrawn from the run's whole history, into an
    existing MLflow run (its status unchanged). A local SQLite store written by training at the same time can be
    busy: each write is tried `attempts` times. Returns where the picture is (None when nothing was scored yet)."""
    from mlflow.tracking import MlflowClient

    from pipeline.tracking.lineage import log_metrics_to_run
    from pipeline.tracking.task_curves import log_task_plot

    def tried(fn, *args, **kwargs):
        for attempt in range(attempts):
            try:
                return fn(*args, **kwargs)
            except Exception:  # noqa: BLE001 -- "database is locked" and the like: wait, then once more
                if attempt == attempts - 1:
                    raise
                time.sleep(1.0 + attempt)

    tried(log_metrics_to_run, tracking_uri, run_id, report.metrics(), report.step)
    client = MlflowClient(tracking_uri=tracking_uri)
    for key, value in report.tags().items():
        tried(client.set_tag, run_id, key, value)
    return tried(log_task_plot, client, run_id, title=title)
