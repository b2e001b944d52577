"""`python pipeline/run.py train --resume RUN`: what the user asked of a run that exists.

    python pipeline/run.py train --resume runs/<run>                        # a stopped run: on from its checkpoint
    python pipeline/run.py train --resume runs/<run> --train.max_steps=800  # a finished run: on to step 800
    python pipeline/run.py train --resume runs/<run> --phases more.yaml     # its phases, then the ones the file adds
    python pipeline/run.py train --resume runs/<run> --no-ray               # a run trained with --no-ray

A larger train.max_steps lengthens the last phase; a phases file must repeat the run's phases (the same overrides;
a finished phase keeps its steps, except the last, which may grow) and may add phases after them. Either way the
run continues from its last checkpoint and the learning-rate schedule (one warmup, one cosine over every phase) is
stretched to the new total: the train header and the MLflow tag `longtrain.extended` say so. A finished run with
nothing more asked of it gets one line with the command that would extend it. A run is resumed the way it trained
(Ray Train or --no-ray), since each keeps its checkpoints in its own place (pipeline/train/session/run_dir.py LAYOUT).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import Config
from pipeline.tracking.names import EXTENDED_TAG, MAX_STEPS_TAG  # noqa: F401  (part of this API)
from pipeline.train.session.train_session import FIXED_ACROSS_PHASES, Phase, load_phases


class ResumeError(ValueError):
    """A resume that cannot do what was asked; the message names why and the command that would work."""


@dataclass
class ResumePlan:
    phases: list[Phase]
    phases_done: int  # phases that need no more steps (the session skips them)
    start_step: int | None  # the step training continues from (the recorded checkpoint's), None: a phase's start
    extended: str = ""  # "train.max_steps 8 -> 80 ...": the header and MLflow say it
    finished: str = ""  # a finished run with nothing more asked: the one line to print instead of training


def resume_command(run_dir: str | Path, no_ray: bool, extra: str = "") -> str:
    """The command that continues `run_dir`, exactly as it must be typed."""
    return f"python pipeline/run.py train --resume {run_dir}{' --no-ray' if no_ray else ''}{extra}"


def trained_without_ray(run_dir: Path, record: dict[str, Any]) -> bool:
    """Whether the run trained with --no-ray (run.json says; older records: its checkpoints/ directory)."""
    if "no_ray" in record:
        return bool(record["no_ray"])
    return (Path(run_dir) / "checkpoints").is_dir()


def checkpoint_meta(location: str | None) -> dict[str, Any]:
    """meta.json of a recorded checkpoint ({} when there is none or it cannot be read: the training itself then
    reports what is wrong with it)."""
    if not location:
        return {}
    from pipeline.storage import join, read_text

    try:
        meta = json.loads(read_text(join(location, "meta.json")))
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def checkpoint_counters(location: str | None) -> dict[str, Any]:
    """meta.json's counters of a recorded checkpoint ({} when there is none or it cannot be read)."""
    return dict(checkpoint_meta(location).get("counters") or {})


def check_kept_settings(run_dir: Path, record: dict[str, Any], cfg: Config, typed: dict[str, Any],
                        meta: dict[str, Any], where: str | None) -> None:
    """ResumeError, before anything of the run is touched, for a command line that asks a resumed run to be
    something it is not: another model or tokenizer (FIXED_ACROSS_PHASES) than the run's record or its checkpoint
    (`meta`, the meta.json of the checkpoint at `where`) has, or another run.name (the run's name is its directory)."""
    if "run.name" in typed and str(typed["run.name"]) != run_dir.name:
        raise ResumeError(f"--run.name={typed['run.name']}: --resume continues run {run_dir} under its own name "
                          f"({run_dir.name}); drop --run.name (a new run of that name: leave out --resume)")
    saved, asked = record.get("config") or {}, cfg.flat()
    for key in FIXED_ACROSS_PHASES:
        if key in saved and saved[key] != asked[key]:
            how = f"--{key}={typed[key]}" if key in typed else "the --preset that sets it"
            raise ResumeError(f"run {run_dir} was trained with {key}={saved[key]!r} and a resumed run keeps its model "
                              f"and tokenizer; drop {how} (or start a new run without --resume)")
    model = (meta.get("config") or {}).get("model") or {}
    found = {"model.tier": meta.get("tier"), "model.mixer": model.get("mixer")}
    for key, value in found.items():  # `--checkpoint` of another run, or a record edited by hand
        if value is not None and value != asked[key]:
            raise ResumeError(f"checkpoint {where} has {key}={value!r} but run {run_dir} trains "
                              f"{key}={asked[key]!r}; pass --checkpoint one of this run's own checkpoints")


def plan_resume(run_dir: Path, record: dict[str, Any], cfg: Config, typed: dict[str, Any], *,
                phases_file: str | None = None, no_ray: bool = False, checkpoint: str | None = None) -> ResumePlan:
    """What `train --resume run_dir` runs, from its run.json `record`, the merged config (the run's own with the
    command line's fields on top), the fields the user typed, --phases, --no-ray and --checkpoint (a checkpoint of
    the run to go back to: its step and phase, not the run's latest, are where it continues). ResumeError when it
    cannot."""
    from pipeline.config import unused_by_mixer

    unused_by_mixer(cfg.model.mixer, typed, where=f"run {run_dir}: ")
    was_local = trained_without_ray(run_dir, record)
    if was_local != no_ray:
        how = "with --no-ray (its checkpoints are under checkpoints/)" if was_local else \
            "on Ray Train (its checkpoints are under its Ray storage, ray/)"
        raise ResumeError(f"run {run_dir} trained {how}; resume it the same way: {resume_command(run_dir, was_local)}")
    from pipeline.train.session.run_dir import latest_of_run

    latest = checkpoint or latest_of_run(run_dir)[0]  # the newest complete one, also of a run that crashed
    meta = checkpoint_meta(latest)
    check_kept_settings(run_dir, record, cfg, typed, meta, latest)
    recorded = [Phase(**p) for p in record["phases"]] if record.get("phases") else load_phases(None, cfg)
    done = int(record.get("phases_done", 0))
    counters = dict(meta.get("counters") or {})
    if checkpoint and counters:  # going back: the checkpoint's phase is open again, even in a finished run
        done = min(done, int(counters.get("phase", 0)))
    reached = int(counters.get("step", 0))
    total = sum(p.steps for p in recorded)
    if phases_file:
        phases = _phases_from_file(phases_file, cfg, recorded, done, reached, one_process=no_ray)
    elif "train.max_steps" in typed and cfg.train.max_steps != total:
        start_last = total - recorded[-1].steps
        floor = max(reached, start_last)
        if cfg.train.max_steps <= floor:
            raise ResumeError(f"train.max_steps={cfg.train.max_steps} is not past step {floor}, which this run "
                              f"{'has reached' if reached >= start_last else 'starts its last phase at'}; give a "
                              f"larger value to train further")
        phases = recorded[:-1] + [Phase(cfg.train.max_steps - start_last, recorded[-1].overrides)]
    else:
        phases = recorded
    new_total = sum(p.steps for p in phases)
    if done >= len(phases) and phases == recorded:
        more = resume_command(run_dir, no_ray, f" --train.max_steps={2 * total}")
        return ResumePlan(phases, done, None, finished=(
            f"run {run_dir} is finished (step {reached or total} of {total}); nothing to continue. To train further, "
            f"raise train.max_steps (the learning-rate schedule is stretched to it) or add phases (--phases): {more}"))
    # a finished phase that grew is open again: it continues from its own last checkpoint
    reopened = next((i for i in range(min(done, len(recorded))) if phases[i].steps != recorded[i].steps), done)
    extended = ""
    if new_total != total:
        if cfg.train.max_epochs > 0:
            raise ResumeError(f"this run's steps are capped by train.max_epochs={cfg.train.max_epochs:g} (passes over "
                              f"its data), which would cap {new_total} steps again; add --train.max_epochs=0 (or a "
                              f"larger value) to train past it")
        t = cfg.train
        extended = (f"train.max_steps {total} -> {new_total}: the learning-rate schedule ({t.warmup_steps} warmup "
                    f"steps, cosine to {t.min_lr_ratio:g} x lr) now spans {new_total} steps")
    phase_of_checkpoint = int(counters.get("phase", -1))
    start = reached if counters and phase_of_checkpoint == reopened else None
    return ResumePlan(phases, reopened, start, extended=extended)


def _phases_from_file(path: str, cfg: Config, recorded: list[Phase], done: int, reached: int, *,
                      one_process: bool = False) -> list[Phase]:
    """The phases of `path` for a resumed run: the run's own first (same overrides; a finished phase keeps its
    steps, except the run's last, which may grow), then any new ones. `one_process`: resumed with --no-ray."""
    phases = load_phases(path, cfg, one_process=one_process)
    if len(phases) < len(recorded):
        raise ResumeError(f"--phases {path}: {len(phases)} phase(s), but the run has {len(recorded)}; a resumed run "
                          f"keeps its phases and may add phases after them")
    end = 0
    for i, (new, old) in enumerate(zip(phases, recorded)):
        end += new.steps
        if new.overrides != old.overrides:
            raise ResumeError(f"--phases {path}: phase {i} has overrides {new.overrides}, the run's phase {i} had "
                              f"{old.overrides}; a resumed run keeps its phases' data and settings")
        last_of_run = i == len(recorded) - 1
        if i < done and new.steps != old.steps and not (last_of_run and new.steps > old.steps):
            raise ResumeError(f"--phases {path}: phase {i} has steps: {new.steps}, but the run finished it at "
                              f"{old.steps} steps; keep {old.steps}")
        if i >= done and end <= reached:
            raise ResumeError(f"--phases {path}: phase {i} would end at step {end}, and the run is at step {reached}; "
                              f"give it more steps")
    return phases
