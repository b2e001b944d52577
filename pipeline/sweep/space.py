"""Search spaces as data: load and validate a tune_spaces/*.yaml file into a `Space`.

    from pipeline.sweep.space import load_space
    space = load_space("tune_spaces/bs_tier.yaml", base_cfg)     # SpaceError (a ValueError) when invalid
    space.param_space()                                          # {"train.batch_size": tune.grid_search([...])}

A space file (every key but `params` optional; defaults shown):

    description: "..."
    metric: val/loss                # a stable metric name from pipeline/tracking/names.py
    mode: min                       # min | max
    num_samples: 1                  # times the grid is repeated / random configs drawn
    max_concurrent_trials: 0        # 0 = as many as the cluster's CPUs/GPUs fit
    token_budget: 0                 # > 0: each trial trains this many tokens (train.max_steps follows from batch)
    skip_unfit_batch: false         # ask the max-batch finder first; sizes that cannot fit are recorded as oom
    scheduler: {type: asha, time_attr: train/tokens_seen, grace_period: 4096, reduction_factor: 2, max_t: 0}
    resources_per_trial: {num_workers: 1, cpus_per_worker: 1, use_gpu: auto}
    fixed: {train.max_steps: 200}   # config overrides every trial gets
    params:                         # config field path -> distribution
      train.batch_size: {grid: [1, 2, 4, 8]}
      train.lr: {loguniform: [1.0e-4, 3.0e-3]}
      model.tier: {choice: [nano, A]}
      train.warmup_steps: {randint: [0, 200]}          # integers lo <= x < hi
      train.grad_clip: 1.0                             # a plain value: fixed
      data.mixture:                                    # the weights of the base config's data.mixture, either
        mixtures: {web_heavy: {web: 0.8, code: 0.2}, balanced: {web: 0.5, code: 0.5}}   # named mixtures, a grid
        # simplex: {web: 1.0, code: 1.0}               # or drawn on the simplex (Dirichlet), num_samples trials

Every key of `params` and `fixed` is a config field path (pipeline/config.py) and every value is checked
by the config's own validation against the base config, so a typo or an impossible value fails here,
before Ray starts, with a message naming the file, the key and what is allowed.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.config import Config, ConfigError, close_fields, field_types
from pipeline.tracking.names import parse_task_metric
from pipeline.tracking.names import (TRAIN_ACCURACY, TRAIN_LOSS, TRAIN_MFU, TRAIN_PEAK_MEM_GIB, TRAIN_PPL,
                                     TRAIN_TOKENS_PER_S, TRAIN_TOKENS_SEEN, VAL_ACCURACY, VAL_LOSS, VAL_PPL)

METRIC_NAMES = (TRAIN_LOSS, TRAIN_PPL, TRAIN_ACCURACY, TRAIN_TOKENS_PER_S, TRAIN_MFU, TRAIN_PEAK_MEM_GIB,
                TRAIN_TOKENS_SEEN, VAL_LOSS, VAL_PPL, VAL_ACCURACY)
DISTRIBUTIONS = {
    "grid": "grid search over a list of values",
    "choice": "one of a list of values, drawn at random",
    "uniform": "[lo, hi] float, uniform",
    "loguniform": "[lo, hi] float, uniform in log space (lo > 0)",
    "randint": "[lo, hi] integer lo <= x < hi",
    "lograndint": "[lo, hi] integer lo <= x < hi, uniform in log space (lo > 0)",
}
# data.mixture's own distributions: the weights of the base config's mixture (its sources stay the same)
MIXTURE_DISTRIBUTIONS = {
    "mixtures": "named mixtures, a grid: {NAME: {SOURCE: weight, ...}, ...}",
    "simplex": "weights drawn on the simplex: {SOURCE: concentration, ...} (a Dirichlet; 1 each = uniform)",
}
SCHEDULERS = ("asha", "fifo")
TOP_LEVEL = ("description", "metric", "mode", "num_samples", "max_concurrent_trials", "token_budget",
             "skip_unfit_batch", "scheduler", "resources_per_trial", "fixed", "params", "rank_by", "rank_mode")
SCHEDULER_KEYS = ("type", "time_attr", "grace_period", "reduction_factor", "max_t")
RESOURCE_KEYS = {"num_workers": "ray.num_workers", "cpus_per_worker": "ray.cpus_per_worker", "use_gpu": "ray.use_gpu"}
# Fields a sweep decides itself, or that would make trials share one dataset they cannot share.
_NOT_SEARCHABLE_PREFIXES = ("run.", "tracking.", "data.")
_NOT_SEARCHABLE = ("ray.address", "ray.storage_path", "train.memory_limit_gib")


class SpaceError(ValueError):
    """A search space file is invalid; the message names the file, the key and the fix."""


@dataclass
class Dist:
    kind: str  # one of DISTRIBUTIONS, MIXTURE_DISTRIBUTIONS, or "value"
    args: list[Any]
    # data.mixture only: `mixtures` name -> the mixture inline (data.mixture's value); `simplex` source -> concentration
    named: dict[str, Any] = field(default_factory=dict)

    def to_tune(self) -> Any:
        from ray import tune

        if self.kind == "value":
            return self.args[0]
        if self.kind == "grid":
            return tune.grid_search(list(self.args))
        if self.kind == "mixtures":  # trials see the name; trial_config turns it into the mixture
            return tune.grid_search(list(self.named))
        if self.kind == "simplex":
            return tune.sample_from(DirichletWeights(self.named))
        return getattr(tune, self.kind)(*self.args) if self.kind != "choice" else tune.choice(list(self.args))

    def values(self) -> list[Any] | None:
        """The finite set of values this can take, or None for a continuous range."""
        if self.kind == "value":
            return [self.args[0]]
        if self.kind == "mixtures":
            return list(self.named.values())
        return list(self.args) if self.kind in ("grid", "choice") else None


class DirichletWeights:
    """Tune's sample_from for `simplex`: weights drawn from a Dirichlet with these concentrations (normalized gamma
    draws; 1 each = uniform on the simplex), as `web=0.312,code=0.688` (what the trial's table row shows)."""

    def __init__(self, alphas: dict[str, float]):
        self.alphas = dict(alphas)

    def __call__(self, spec: Any = None) -> str:
        import numpy as np

        draws = {name: float(np.random.gamma(alpha)) for name, alpha in self.alphas.items()}
        total = sum(draws.values()) or 1.0
        return ",".join(f"{name}={draws[name] / total:.4f}" for name in self.alphas)


def resolve_mixture(value: Any, base_mixture: str, named: dict[str, str]) -> Any:
    """A trial's data.mixture value as the config takes it: a named mixture's list, or `web=0.3,code=0.7` (simplex
    weights) applied to the base mixture's sources; anything else unchanged."""
    from pipeline.mixture_spec import mixture_json, parse_mixture, with_weights

    if not isinstance(value, str):
        return value
    if value in named:
        return named[value]
    if _WEIGHTS.fullmatch(value) and base_mixture:
        weights = {k: float(v) for k, v in (item.split("=") for item in value.split(","))}
        return mixture_json(with_weights(parse_mixture(base_mixture), weights))
    return value


# Ray Tune's and other sweep tools' names for a space's top-level keys (tune.TuneConfig, tune.Tuner, W&B sweeps)
TOP_LEVEL_ALIASES = {"num_trials": "num_samples", "trials": "num_samples", "samples": "num_samples",
                     "max_concurrent": "max_concurrent_trials", "concurrency": "max_concurrent_trials",
                     "resources": "resources_per_trial", "param_space": "params", "config": "params",
                     "search_space": "params", "parameters": "params", "constants": "fixed",
                     "search_alg": "scheduler", "goal": "mode"}

_WEIGHTS = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*=[0-9.eE+-]+(,[A-Za-z0-9][A-Za-z0-9_.-]*=[0-9.eE+-]+)*")


@dataclass
class Space:
    name: str
    path: Path
    description: str = ""
    metric: str = VAL_LOSS
    mode: str = "min"
    # A downstream task's metric (eval/<task>/<metric>, fixed.eval.tasks scores it) the report ranks the trials by, read
    # from each trial's MLflow run after the sweep; Tune still schedules on `metric` (the task's scores come from Ray
    # Train's validation hook, not from the trials' reports)
    rank_by: str = ""
    rank_mode: str = "max"
    num_samples: int = 1
    max_concurrent_trials: int = 0
    token_budget: int = 0
    skip_unfit_batch: bool = False
    scheduler: dict[str, Any] = field(default_factory=lambda: {"type": "asha", "time_attr": TRAIN_TOKENS_SEEN,
                                                                "grace_period": 4096, "reduction_factor": 2,
                                                                "max_t": 0})
    resources: dict[str, Any] = field(default_factory=dict)  # ray.* field paths -> values
    fixed: dict[str, Any] = field(default_factory=dict)
    params: dict[str, Dist] = field(default_factory=dict)

    def param_space(self) -> dict[str, Any]:
        """Tune's param_space: field paths -> tune distributions (the trial function gets field paths)."""
        return {k: d.to_tune() for k, d in self.params.items()}

    def overrides(self) -> dict[str, Any]:
        """What every trial's config gets before its own params: resources then fixed values."""
        return {**self.resources, **self.fixed}

    def mixtures(self) -> dict[str, str]:
        """The named mixtures searched (name -> data.mixture), {} when none."""
        d = self.params.get("data.mixture")
        return dict(d.named) if d is not None and d.kind == "mixtures" else {}

    def values_of(self, key: str, base: Config) -> list[Any]:
        """Every value `key` takes in this sweep (the base value when it is not searched)."""
        if key in self.params:
            return self.params[key].values() or []
        return [base.replace(self.overrides()).flat()[key]]


def _fail(path: Path, msg: str) -> SpaceError:
    return SpaceError(f"search space {path}: {msg}")


def _close_keys(unknown: list[Any]) -> str:
    """' did you mean 'num_samples'?' for the first unknown top-level key that is another tool's name for one, a
    near spelling of one, or a config field path (which goes under params or fixed); '' when none is."""
    import difflib

    for key in map(str, unknown):
        if key in field_types():
            return f" {key!r} is a config field: put it under params (searched) or fixed;"
        close = ([TOP_LEVEL_ALIASES[key.lower()]] if key.lower() in TOP_LEVEL_ALIASES
                 else difflib.get_close_matches(key, TOP_LEVEL, n=1, cutoff=0.75))
        if close:
            return f" did you mean {close[0]!r} (for {key!r})?"
    return ""


def _check_key(path: Path, section: str, key: Any, searchable: bool) -> str:
    if not isinstance(key, str) or key not in field_types():
        close = close_fields(str(key))
        hint = f" did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise _fail(path, f"{section} key {key!r} is not a config field;{hint} `python pipeline/run.py --help` "
                          f"lists every field")
    if searchable and (key.startswith(_NOT_SEARCHABLE_PREFIXES) or key in _NOT_SEARCHABLE) and key != "data.mixture":
        raise _fail(path, f"params key {key!r} cannot be searched: run.*, tracking.*, ray.address, "
                          f"ray.storage_path and train.memory_limit_gib are set by the sweep, and data.* fields "
                          f"go under `fixed` (all trials share one prepared dataset; data.mixture's weights are the "
                          f"exception: {', '.join(MIXTURE_DISTRIBUTIONS)})")
    return key


def _check_value(path: Path, section: str, key: str, value: Any, base: Config) -> Any:
    """The value as the config coerces it; the config's own validation message on failure."""
    try:
        return base.replace({key: value}).flat()[key]
    except ConfigError as exc:
        raise _fail(path, f"{section} {key}: {exc}") from None


def _parse_mixture_dist(path: Path, spec: Any, base: Config) -> Dist:
    """data.mixture: named mixtures (a grid) or simplex draws over the base config's mixture's sources."""
    from pipeline.mixture_spec import MixtureSpecError, mixture_json, parse_mixture, with_weights

    kinds = ", ".join(f"{k} ({v})" for k, v in MIXTURE_DISTRIBUTIONS.items())
    if not base.data.mixture:
        raise _fail(path, "params data.mixture searches the weights of the base config's mixture, and it has none; "
                          "set data.mixture (its sources) under `fixed` or on the command line")
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in MIXTURE_DISTRIBUTIONS:
        raise _fail(path, f"params data.mixture: {spec!r} is not a mixture distribution; write {{KIND: ARGS}} with "
                          f"KIND one of: {kinds}")
    sources = parse_mixture(base.data.mixture)
    names = [s.name for s in sources]
    kind, args = next(iter(spec.items()))
    if not isinstance(args, dict) or not args:
        raise _fail(path, f"params data.mixture: {kind} needs a non-empty mapping, got {args!r}")

    def weights_of(label: str, mapping: Any, *, positive: bool) -> dict[str, float]:
        if not isinstance(mapping, dict) or not mapping:
            raise _fail(path, f"params data.mixture {label}: give {{SOURCE: number, ...}}, got {mapping!r}")
        out = {}
        for source, w in mapping.items():
            if source not in names:
                raise _fail(path, f"params data.mixture {label}: {source!r} is not a source of the base mixture "
                                  f"({', '.join(names)})")
            ok = isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w)
            if not ok or w < 0 or (positive and w == 0):
                raise _fail(path, f"params data.mixture {label}: {source}={w!r} must be a number "
                                  f"{'> 0' if positive else '>= 0'}")
            out[str(source)] = float(w)
        return out

    try:
        if kind == "mixtures":
            named = {}
            for name, mapping in args.items():
                value = mixture_json(with_weights(sources, weights_of(f"mixtures {name}", mapping, positive=False)))
                named[str(name)] = _check_value(path, "params", "data.mixture", value, base)
            return Dist(kind, list(named), named)
        alphas = weights_of("simplex", args, positive=True)
        mean = mixture_json(with_weights(sources, alphas))  # the Dirichlet's mean: one valid value of the range
        return Dist(kind, [mean], alphas)
    except MixtureSpecError as exc:
        raise _fail(path, f"params data.mixture: {exc}") from None


def _parse_dist(path: Path, key: str, spec: Any, base: Config) -> Dist:
    if key == "data.mixture":
        return _parse_mixture_dist(path, spec, base)
    kinds = ", ".join(f"{k} ({v})" for k, v in DISTRIBUTIONS.items())
    if not isinstance(spec, dict):
        return Dist("value", [_check_value(path, "params", key, spec, base)])
    if len(spec) != 1 or next(iter(spec)) not in DISTRIBUTIONS:
        raise _fail(path, f"params {key}: {spec!r} is not a distribution; write {{KIND: ARGS}} with KIND one of: "
                          f"{kinds}")
    kind, args = next(iter(spec.items()))
    typ = field_types()[key]
    if kind in ("grid", "choice"):
        if not isinstance(args, list) or not args:
            raise _fail(path, f"params {key}: {kind} needs a non-empty list of values, got {args!r}")
        return Dist(kind, [_check_value(path, "params", key, v, base) for v in args])
    bad = (not isinstance(args, list) or len(args) != 2
           or not all(isinstance(a, (int, float)) and not isinstance(a, bool) and math.isfinite(a) for a in args))
    if bad:
        raise _fail(path, f"params {key}: {kind} needs [lo, hi] (two numbers), got {args!r}")
    lo, hi = args
    want = float if kind in ("uniform", "loguniform") else int
    if typ is not want:
        other = "uniform/loguniform" if typ is float else "randint/lograndint" if typ is int else "grid/choice"
        raise _fail(path, f"params {key}: {kind} draws {want.__name__}s but {key} is a {typ.__name__}; use {other}")
    if want is int and not (float(lo).is_integer() and float(hi).is_integer()):
        raise _fail(path, f"params {key}: {kind} bounds must be integers, got {args!r}")
    if not lo < hi:
        raise _fail(path, f"params {key}: {kind} needs lo < hi, got {args!r}")
    if kind.startswith("log") and lo <= 0:
        raise _fail(path, f"params {key}: {kind} needs lo > 0, got {args!r}")
    top = hi if want is float else hi - 1  # randint's upper bound is exclusive
    for v in (lo, top):
        _check_value(path, "params", key, want(v), base)
    return Dist(kind, [want(lo), want(hi)])


def _number(path: Path, key: str, value: Any, *, integer: bool, minimum: float, above: bool = False) -> Any:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (not integer or float(value).is_integer()) and (value > minimum if above else value >= minimum)
    if not ok:
        kind = "an integer" if integer else "a number"
        raise _fail(path, f"{key}={value!r} is invalid; it must be {kind} {'>' if above else '>='} {minimum}")
    return int(value) if integer else float(value)


def _mapping(path: Path, key: str, value: Any) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _fail(path, f"{key} must be a mapping, got {value!r}")
    return value


def load_space(path: str | Path, base: Config | None = None) -> Space:
    """Read and validate a search space against `base` (default Config()); SpaceError on any problem."""
    import yaml

    path = Path(path)
    base = base or Config()
    if not path.is_file():
        found = sorted(p.name for p in Path("tune_spaces").glob("*.yaml")) if Path("tune_spaces").is_dir() else []
        raise SpaceError(f"search space {path} does not exist" + (f"; tune_spaces/ holds {', '.join(found)}"
                                                                  if found else ""))
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise _fail(path, f"not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(doc, dict):
        raise _fail(path, "must be a YAML mapping with at least `params`")
    unknown = [k for k in doc if k not in TOP_LEVEL]
    if unknown:
        raise _fail(path, f"unknown key(s) {unknown};{_close_keys(unknown)} valid keys: {', '.join(TOP_LEVEL)}")
    space = Space(name=path.stem, path=path.resolve(), description=str(doc.get("description", "")))

    space.metric = doc.get("metric", space.metric)
    if space.metric not in METRIC_NAMES:
        raise _fail(path, f"metric={space.metric!r} is not a tracked metric; choose one of: {', '.join(METRIC_NAMES)}")
    space.mode = doc.get("mode", space.mode)
    if space.mode not in ("min", "max"):
        raise _fail(path, f"mode={space.mode!r} is not allowed; choose min or max")
    space.rank_by = str(doc.get("rank_by", "") or "")
    if space.rank_by and parse_task_metric(space.rank_by) is None:
        raise _fail(path, f"rank_by={space.rank_by!r} is not a downstream task's metric; name one as "
                          f"eval/<task>/<metric>, e.g. eval/builtin_cloze/acc_norm (with fixed: eval.tasks)")
    space.rank_mode = doc.get("rank_mode", space.rank_mode)
    if space.rank_mode not in ("min", "max"):
        raise _fail(path, f"rank_mode={space.rank_mode!r} is not allowed; choose min or max")
    space.num_samples = _number(path, "num_samples", doc.get("num_samples", 1), integer=True, minimum=1)
    space.max_concurrent_trials = _number(path, "max_concurrent_trials", doc.get("max_concurrent_trials", 0),
                                          integer=True, minimum=0)
    space.token_budget = _number(path, "token_budget", doc.get("token_budget", 0), integer=True, minimum=0)
    space.skip_unfit_batch = doc.get("skip_unfit_batch", False)
    if not isinstance(space.skip_unfit_batch, bool):
        raise _fail(path, f"skip_unfit_batch={space.skip_unfit_batch!r} must be true or false")

    sched = {**space.scheduler, **_mapping(path, "scheduler", doc.get("scheduler"))}
    unknown = [k for k in sched if k not in SCHEDULER_KEYS]
    if unknown:
        raise _fail(path, f"scheduler: unknown key(s) {unknown}; valid keys: {', '.join(SCHEDULER_KEYS)}")
    if sched["type"] not in SCHEDULERS:
        raise _fail(path, f"scheduler.type={sched['type']!r} is not allowed; choose one of: {', '.join(SCHEDULERS)}")
    if sched["time_attr"] not in METRIC_NAMES:
        raise _fail(path, f"scheduler.time_attr={sched['time_attr']!r} is not a tracked metric; use "
                          f"train/tokens_seen (tokens trained so far)")
    sched["grace_period"] = _number(path, "scheduler.grace_period", sched["grace_period"], integer=True, minimum=1)
    sched["reduction_factor"] = _number(path, "scheduler.reduction_factor", sched["reduction_factor"],
                                        integer=False, minimum=1, above=True)
    sched["max_t"] = _number(path, "scheduler.max_t", sched["max_t"], integer=True, minimum=0)
    space.scheduler = sched

    resources = _mapping(path, "resources_per_trial", doc.get("resources_per_trial"))
    unknown = [k for k in resources if k not in RESOURCE_KEYS]
    if unknown:
        raise _fail(path, f"resources_per_trial: unknown key(s) {unknown}; valid keys: {', '.join(RESOURCE_KEYS)}")
    space.resources = {RESOURCE_KEYS[k]: _check_value(path, "resources_per_trial", RESOURCE_KEYS[k], v, base)
                       for k, v in resources.items()}

    for key, value in _mapping(path, "fixed", doc.get("fixed")).items():
        _check_key(path, "fixed", key, searchable=False)
        if key in space.resources:
            raise _fail(path, f"fixed {key} is also set by resources_per_trial; set it in one place")
        space.fixed[key] = _check_value(path, "fixed", key, value, base)
    try:
        fixed_base = base.replace(space.overrides())
    except ConfigError as exc:
        raise _fail(path, f"fixed: {exc}") from None

    params = _mapping(path, "params", doc.get("params"))
    if not params:
        raise _fail(path, "params is empty; name at least one config field to search, e.g. "
                          "train.lr: {loguniform: [1.0e-4, 3.0e-3]}")
    for key, spec in params.items():
        _check_key(path, "params", key, searchable=True)
        if key in space.overrides() and key != "data.mixture":  # (a fixed data.mixture names the sources searched)
            raise _fail(path, f"params {key} is also fixed; a key is either searched or fixed")
        space.params[key] = _parse_dist(path, key, spec, fixed_base)
    if space.skip_unfit_batch and (space.params.get("train.batch_size") is None
                                   or space.params["train.batch_size"].values() is None):
        raise _fail(path, "skip_unfit_batch needs train.batch_size in params as a grid or choice (the finder "
                          "searches up to the largest one)")
    if sched["type"] == "asha" and sched["max_t"] and sched["max_t"] <= sched["grace_period"]:
        raise _fail(path, f"scheduler.max_t={sched['max_t']} must exceed grace_period={sched['grace_period']}")
    return space

