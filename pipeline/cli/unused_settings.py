"""Nothing a user sets is silently ignored: every flag and config field on a command line must be used by the
stage it runs, or the command is refused in one line naming the setting and the fix.

    python pipeline/run.py prepare --data.path=corpus/          # data.source=files is inferred, and said so
    python pipeline/run.py train --no-ray --ray.num_workers=4   # error: ray.num_workers is not used with --no-ray ...
    python pipeline/run.py eval --resume RUN --train.eval_batches=4   # error: eval reads it from the checkpoint

run.py's build_config calls `check_flags` (flags against the stage), then `typed_fields` + `settle_fields` (fields
against the stage, the mode and the data source) before any work starts. Settings a preset or a saved run brings
are not checked here, only what the user typed (the command line and the keys of a preset file).
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pipeline.config import PRESETS, Config
# the rules a phase file and a resumed run are checked against too (pipeline/train/session/): beside the config
from pipeline.config import IgnoredSettingError, unused_by_mixer, unused_by_source  # noqa: F401


# argparse dest -> (how the user wrote it, the stages that use it)
_GENERATE = {"all", "generate"}
FLAG_STAGES: dict[str, tuple[str, set[str]]] = {
    "preset": ("--preset", {"all", "prepare", "train", "eval", "generate", "tune", "export", "runs"}),
    "resume": ("--resume", {"all", "train", "eval", "generate", "export"}),
    "address": ("--address", {"all", "prepare", "train", "tune"}),
    "no_ray": ("--no-ray", {"all", "train"}),
    "phases": ("--phases", {"all", "train"}),
    "checkpoint": ("--checkpoint", {"eval", "generate", "export", "train"}),  # train: with --resume (below)
    "prompt": ("--prompt", _GENERATE),
    "prompts_file": ("--prompts-file", _GENERATE),
    "max_new_tokens": ("--max-new-tokens", _GENERATE),
    "temperature": ("--temperature", _GENERATE),
    "top_k": ("--top-k", _GENERATE),
    "top_p": ("--top-p", _GENERATE),
    "min_p": ("--min-p", _GENERATE),
    "space": ("--space", {"tune"}),
    "audit_data": ("--audit-data", {"all", "train"}),
    "out": ("--out", {"export"}),
    "overwrite": ("--overwrite", {"export"}),
    "register": ("--register", {"export"}),
    "by_position": ("--by-position", {"eval"}),
    "seq_len": ("--seq-len", {"eval"}),
    "passkey": ("--passkey", {"eval"}),
    "passkey_lengths": ("--passkey-lengths", {"eval"}),
    "passkey_trials": ("--passkey-trials", {"eval"}),
    "tasks": ("--tasks", {"eval"}),
    "num_fewshot": ("--num-fewshot", {"eval"}),
    "limit": ("--limit", {"eval"}),
}


def check_flags(args: argparse.Namespace, defaults: argparse.Namespace) -> None:
    """IgnoredSettingError when a flag was given that args.stage does not use."""
    if args.target and args.stage == "eval" and args.checkpoint:
        raise IgnoredSettingError(f"eval was given two checkpoints ({args.target!r} and --checkpoint "
                                  f"{args.checkpoint}); name one")
    if args.target and args.stage not in ("validate", "eval"):
        hint = {"runs": f"to list the runs under it, pass --run.root={args.target}",
                "prepare": "name the corpus with --data.path"}.get(args.stage, "drop it")
        if args.stage in ("all", "train", "eval", "generate", "export"):
            hint = (f"to continue a run or use its checkpoint, pass --resume {args.target} (or --checkpoint "
                    f"{args.target})")
        raise IgnoredSettingError(f"`{args.stage}` takes no positional argument ({args.target!r}; only validate "
                                  f"reads one: a dataset, a checkpoint or a run); {hint}")
    for dest, (flag, stages) in FLAG_STAGES.items():
        if getattr(args, dest) == getattr(defaults, dest) or args.stage in stages:
            continue
        users = sorted(stages - {"all"})
        users = ", ".join(users[:-1]) + f" and {users[-1]}" if len(users) > 1 else users[0]
        raise IgnoredSettingError(f"{flag} is not used by `{args.stage}` (it is for {users}); drop it, or run the "
                                  f"stage it is for")
    if args.stage == "train" and args.checkpoint and not args.resume:
        raise IgnoredSettingError(f"--checkpoint {args.checkpoint} is not used by `train` without --resume RUN: a new "
                                  f"run starts from scratch (phases carry a model from one dataset to the next)")


def typed_fields(preset: str | None, overrides: dict[str, Any]) -> dict[str, Any]:
    """The fields the user set: the command line's overrides and those a preset *file* sets (not a built-in preset,
    whose values are the project's defaults)."""
    typed: dict[str, Any] = {}
    if preset and preset not in PRESETS and Path(preset).is_file():
        import yaml

        try:
            doc = yaml.safe_load(Path(preset).read_text()) or {}
        except yaml.YAMLError:
            doc = {}  # load_config names the file and the problem
        if isinstance(doc, dict) and ("base" in doc or "overrides" in doc):
            typed.update(doc.get("overrides") or {})
        elif isinstance(doc, dict):
            typed.update({f"{sec}.{k}": v for sec, body in doc.items() if isinstance(body, dict)
                          for k, v in body.items()})
    typed.update(overrides)
    return typed


# Fields that each stage reads; anything else typed for it is refused. Stages not listed read every field.
_STAGE_FIELDS = {
    "validate": ((), "validate reads only the dataset directory, checkpoint or run it is given"),
    "runs": (("run.",), "runs lists the runs under run.root"),
    "generate": (("run.",), "generate takes the model and its settings from the checkpoint"),
    "eval": (("run.", "tracking.", "eval."), "eval takes the model, its data and its settings from the checkpoint"),
    "export": (("run.", "tracking."), "export takes the model and its tokenizer from the checkpoint"),
    # prepare: the data, where things go, the Ray it runs on, the tier (the longest seq_len it allows) and, for
    # data.min_rows, the micro-batch it folds (pipeline/train/session/sizing.py)
    "prepare": (("data.", "run.", "ray.address", "ray.dashboard_host", "ray.num_workers", "ray.cpus_per_worker",
                 "ray.use_gpu", "model.tier", "model.mixer", "train.batch_size", "train.grad_accum"),
                "prepare reads data.*, run.*, ray.address and model.tier; the rest is for training"),
}
# With --no-ray nothing starts Ray Train: only the Ray that prepare's Ray Data joins or starts is configured.
_NO_RAY_FIELDS = ("ray.address", "ray.dashboard_host")
_DATA_STAGES = {"all", "prepare", "train", "tune"}
# Fields another field's value turns off: (field, is it off?, why).
_OFF_BY = [
    ("tracking.", lambda c: not c.tracking.enabled, "tracking.enabled=false, so nothing is logged to MLflow"),
    ("tracking.system_metrics_interval_s", lambda c: not c.tracking.system_metrics,
     "tracking.system_metrics=false, so no system metrics are sampled"),
    ("data.max_bad_fraction", lambda c: c.data.on_bad_record == "error",
     "with data.on_bad_record=error the first unreadable record fails the prepare, whatever the fraction"),
    ("data.tokenizer_sample_bytes", lambda c: bool(c.data.tokenizer),
     "data.tokenizer is given, so no tokenizer is trained and nothing is sampled for one"),
    ("data.dedup_threshold", lambda c: c.data.dedup != "near", "data.dedup is not near, so no near copy is looked for"),
    ("data.dedup_ngram", lambda c: c.data.dedup != "near", "data.dedup is not near, so no near copy is looked for"),
    ("data.dedup_keep", lambda c: c.data.dedup == "none" or not c.data.mixture,
     "no mixture is deduplicated (data.dedup=none or data.mixture empty), so no source keeps another's documents"),
]


def settle_fields(stage: str, typed: dict[str, Any], cfg: Config, *, no_ray: bool = False,
                  space: str | None = None) -> tuple[Config, list[str]]:
    """The config with what the user meant made explicit, and the notes to print: data.path given without
    data.source on the built-in corpus reads data.path as data.source=files. IgnoredSettingError for a field the
    stage, the mode or the data source would not use."""
    notes: list[str] = []
    rule = _STAGE_FIELDS.get(stage)
    if rule is not None:
        allowed, why = rule
        for key in typed:
            if not key.startswith(allowed) and key not in allowed:
                raise IgnoredSettingError(f"{key} is not used by `{stage}`: {why}; drop it")
    if no_ray:
        for key in typed:
            if key.startswith("ray.") and key not in _NO_RAY_FIELDS:
                raise IgnoredSettingError(f"{key} is not used with --no-ray (one plain process, no Ray Train "
                                          f"workers); drop it, or drop --no-ray to train on Ray")
    for prefix, off, why in _OFF_BY:
        for key in typed:
            if key.startswith(prefix) and key != "tracking.enabled" and off(cfg):
                raise IgnoredSettingError(f"{key} is not used: {why}; drop it")
    if stage not in _DATA_STAGES:
        return cfg, notes
    if "data.path" in typed and "data.source" not in typed and cfg.data.source == "builtin":
        cfg = cfg.replace({"data.source": "files"})
        notes.append(f"data.source=files: data.path={cfg.data.path} is set and the built-in corpus (the default "
                     f"source) reads no path, so the files there are the corpus")
    unused_by_source(cfg.data.source, typed)
    unused_by_mixer(cfg.model.mixer, typed)
    if stage == "tune" and space:
        _check_tune(typed, cfg, space)
    if typed.get("train.precision") == "bf16" and stage in ("all", "train") and (no_ray or not cfg.ray.address):
        import torch

        if not torch.cuda.is_available():  # the engine trains fp32 on a CPU whatever the field says (hardware.py)
            raise IgnoredSettingError("train.precision=bf16 is not used on a CPU: training here is fp32 (bf16 "
                                      "autocast on a CPU is slow and differs numerically); drop it, or train on a GPU")
    return cfg, notes


def _check_tune(typed: dict[str, Any], cfg: Config, space_path: str) -> None:
    """A field the space searches, or train.max_steps under a token budget, set on the command line: the sweep
    would overwrite it in every trial."""
    from pipeline.sweep.space import SpaceError, load_space

    try:
        space = load_space(space_path, cfg)
    except SpaceError:
        return  # tune_main reports the space's own problem
    for key in typed:
        if key == "data.mixture" and key in space.params:
            continue  # the search draws weights over this mixture's sources: the typed value supplies them
        if key in space.params:
            raise IgnoredSettingError(f"{key} is searched by {space_path} (params), which sets it in every trial; "
                                      f"drop it from the command line, or from the space's params")
        if key == "train.max_steps" and space.token_budget:
            raise IgnoredSettingError(f"train.max_steps is set from {space_path}'s token_budget={space.token_budget:,} "
                                      f"in every trial; drop it, or set token_budget: 0 in the space")
