"""Training in one plain process: the same engine and loop as the Ray Train workers, shards read with
pyarrow, checkpoints under <run_dir>/checkpoints/phase<i>/. For single-GPU users without Ray.

    python pipeline/run.py train --no-ray
"""
from __future__ import annotations

from pathlib import Path

from pipeline.config import Config
from pipeline.train.engine import Engine, PhaseSchedule, announce_kernels
from pipeline.train.generate import eval_samples_hook
from pipeline.train.loop import AuditLog, LocalCheckpoints, StopRequest, fit, standard_hooks
from pipeline.data.mixture import mixture_of
from pipeline.data.mixture import train_batches as mixed_train_batches
from pipeline.data.shards import ShardReader, check_trainable, eval_reader, load_manifest
from pipeline.eval.sources import SourceValidation
from pipeline.storage import absolute, local_copy
from pipeline.train.run_dir import AUDIT_DIR


def train_local(cfg: Config, dataset_dir: str | Path, run_dir: str | Path, tracker=None, *,
                init_from: str | Path | None = None, max_steps: int | None = None, phase: int = 0,
                audit_data: bool = False, schedule: PhaseSchedule | None = None):
    """Train to max_steps (default cfg.train.max_steps); resumes from this phase's latest checkpoint if
    there is one, else starts from `init_from` (the previous phase) or from scratch. `schedule`: the phase's
    place in the one LR schedule, its re-warmup and optimizer reset (engine.py PhaseSchedule). Returns the
    latest checkpoint directory and whether a Ctrl+C stopped the run early: (checkpoint, stopped)."""
    run_dir, dataset_dir = Path(run_dir), str(dataset_dir)
    manifest = load_manifest(dataset_dir)
    check_trainable(manifest, dataset_dir, cfg.train.batch_size)
    engine = Engine(cfg, manifest.vocab_size)
    if cfg.train.parallel == "fsdp":
        print(f"parallel: none ({engine.parallel_reason})", flush=True)
    announce_kernels(engine, tracker)
    ckpts = LocalCheckpoints(run_dir / "checkpoints" / f"phase{phase}", cfg.train.keep_checkpoints)
    resumed = ckpts.latest() is not None
    if resumed:
        engine.load(ckpts.latest())
    elif init_from is not None:
        with local_copy(init_from) as d:  # the previous phase's checkpoint may be on object storage
            engine.load(d)
        engine.epoch, engine.cursor, engine.phase = 0, 0, phase  # a new phase starts its dataset afresh
    engine.start_phase(schedule or PhaseSchedule(), fresh=not resumed)
    t = cfg.train

    def train_batches(epoch: int, start: int):
        return ShardReader(dataset_dir, "train", t.batch_size, seed=t.seed, epoch=epoch, start=start)

    def val_batches():
        return eval_reader(dataset_dir, t.batch_size)

    evaluate = None
    if (mix := mixture_of(dataset_dir, cfg)) is not None:  # several sources: one mixed stream, a loss per source
        train_batches, evaluate = mixed_train_batches(dataset_dir, cfg), SourceValidation(mix, t.batch_size)

    audit = AuditLog(run_dir / AUDIT_DIR / "rank_0.jsonl") if audit_data else None
    extra = {"dataset_dir": absolute(dataset_dir), "phase": phase}
    hooks = standard_hooks(tracker, audit, lambda e, m: ckpts.save(e, {**extra, "metrics": m}),
                           on_eval_extra=eval_samples_hook(dataset_dir, tracker, t.sample_tokens))
    try:
        with StopRequest() as stop:
            res = fit(engine, train_batches, val_batches, hooks, max_steps=max_steps, stop=stop, evaluate=evaluate)
    finally:
        if audit is not None:
            audit.close()
    return ckpts.latest(), res.stopped_early
