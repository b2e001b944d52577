"""Training in one plain process: the same engine and loop as the Ray Train workers, shards read with
pyarrow, checkpoints under <run_dir>/checkpoints/phase<i>/. For single-GPU users without Ray. The downstream tasks
(eval.tasks) are scored in this process at the due checkpoints, between steps (pipeline/train/task_scoring.py).

    python pipeline/run.py train --no-ray
"""
from __future__ import annotations

from pathlib import Path

from pipeline.config import Config
from pipeline.train.engine import Engine, PhaseSchedule, announce_kernels
from pipeline.train.handoff.text_generation import eval_samples_hook
from pipeline.train.audit_log import AuditLog
from pipeline.train.checkpoints.local_dir import LocalCheckpoints
from pipeline.train.loop import fit, standard_hooks
from pipeline.train.stop_request import StopRequest
from pipeline.train.task_scoring import ScoringSchedule, check_scoring, score_loaded
from pipeline.data.mixture import mixture_of
from pipeline.data.mixture import train_batches as mixed_train_batches
from pipeline.data.shards import EvalSplit, Manifest, ShardReader, check_trainable, load_manifest
from pipeline.eval.sources import SourceValidation
from pipeline.storage import absolute, local_copy
from pipeline.train.checkpoints.broken import diagnosed
from pipeline.train.checkpoints.state import CheckpointError, warn_if_no_room_for_checkpoints
from pipeline.train.checkpoints.index import latest_complete, skipped_line
from pipeline.train.session.run_dir import AUDIT_DIR
from pipeline.train.spike_record import RECORD_FILE, SpikeRecord, read_events, rewinds_of
from pipeline.train.spike_rewind import Rewinder, reconcile


def train_local(cfg: Config, dataset_dir: str | Path, run_dir: str | Path, tracker=None, *,
                init_from: str | Path | None = None, max_steps: int | None = None, phase: int = 0,
                audit_data: bool = False, schedule: PhaseSchedule | None = None,
                resume_from: str | Path | None = None, manifest: Manifest | None = None):
    """Train to max_steps (default cfg.train.max_steps); resumes from `resume_from` when given (`--checkpoint`),
    else from this phase's newest complete checkpoint if there is one (an incomplete newer one is skipped, said in
    one line), else starts from `init_from` (the previous phase) or from scratch. `schedule`: the phase's place in
    the one LR schedule, its re-warmup and optimizer reset (engine.py PhaseSchedule). `manifest`: the dataset's, as
    the session read it (read here otherwise); every reader below is handed it. Returns the latest checkpoint
    directory and whether a Ctrl+C stopped the run early: (checkpoint, stopped)."""
    run_dir, dataset_dir = Path(run_dir), str(dataset_dir)
    manifest = manifest if manifest is not None else load_manifest(dataset_dir)
    check_trainable(manifest, dataset_dir, cfg.train.batch_size)
    engine = Engine(cfg, manifest.vocab_size)
    if cfg.train.parallel == "fsdp":
        print(f"parallel: none ({engine.parallel_reason})", flush=True)
    announce_kernels(engine, tracker)
    ckpts = LocalCheckpoints(run_dir / "checkpoints" / f"phase{phase}", cfg.train.keep_checkpoints)
    warn_if_no_room_for_checkpoints(cfg, manifest.vocab_size, str(ckpts.directory))
    resume, skipped = latest_complete(str(ckpts.directory)) if ckpts.directory.is_dir() else (None, None)
    if resume_from is not None:
        with diagnosed(resume_from), local_copy(resume_from) as d:  # a chosen one, here or on object storage
            engine.load(d)
        print(f"resume: from {resume_from} (step {engine.step}), as --checkpoint asks", flush=True)
    elif resume is not None:
        if skipped:
            print(skipped_line(skipped, resume), flush=True)
        with diagnosed(resume):  # complete by its listing, yet it may not load: one line offering the previous
            engine.load(resume)
    elif skipped:
        raise CheckpointError(f"resume: {skipped}, and {ckpts.directory} holds no complete checkpoint; start the run anew "
                              f"(another --run.name) or pass a complete one with --checkpoint")
    elif init_from is not None:
        with local_copy(init_from) as d:  # the previous phase's checkpoint may be on object storage
            engine.load(d)
        engine.epoch, engine.cursor, engine.phase = 0, 0, phase  # a new phase starts its dataset afresh
    # loss spikes: the rewinds go back to this phase's checkpoints; the run's record (spikes.json) says which rows
    # its rewinds skipped, also those a checkpoint written before them does not know of
    mixed = (manifest.source or {}).get("kind") == "mixture"
    rewinder = Rewinder(str(ckpts.directory), epoch_rows=None if mixed else manifest.rows("train"))
    reconcile(engine, rewinds_of(read_events(str(run_dir))), rewinder, chosen=resume_from is not None)
    engine.start_phase(schedule or PhaseSchedule(), fresh=resume_from is None and resume is None)
    t = cfg.train

    def train_batches(epoch: int, start: int):
        return ShardReader(dataset_dir, "train", t.batch_size, seed=t.seed, epoch=epoch, start=start,
                           manifest=manifest)

    val_batches = EvalSplit(dataset_dir, t.batch_size, manifest=manifest)  # read once, reused by every evaluation

    evaluate = None
    if (mix := mixture_of(dataset_dir, cfg, manifest)) is not None:  # several sources: one mixed stream, a loss each
        train_batches = mixed_train_batches(dataset_dir, cfg, manifest=manifest)
        evaluate = SourceValidation(mix, t.batch_size)

    audit = AuditLog(run_dir / AUDIT_DIR / "rank_0.jsonl") if audit_data else None
    extra = {"dataset_dir": absolute(dataset_dir), "phase": phase}
    scoring = ScoringSchedule(cfg) if check_scoring(cfg) else None  # eval.tasks, in this process (task_scoring.py)

    def on_checkpoint(e: Engine, metrics: dict) -> None:
        ckpts.save(e, {**extra, "metrics": metrics})
        if scoring is not None and scoring.next(e.step >= (max_steps or t.max_steps)):
            score_loaded(e.module.decoder, cfg, dataset_dir, manifest, e.step, getattr(tracker, "run_id", None))

    hooks = standard_hooks(tracker, audit, on_checkpoint,
                           on_eval_extra=eval_samples_hook(dataset_dir, tracker, t.sample_tokens, defer=True,
                                                           manifest=manifest),
                           spikes=SpikeRecord(str(run_dir / RECORD_FILE)))
    try:
        with StopRequest() as stop:
            res = fit(engine, train_batches, val_batches, hooks, max_steps=max_steps, stop=stop, evaluate=evaluate,
                      rewinder=rewinder)
    finally:
        if audit is not None:
            audit.close()
    return ckpts.last_saved or latest_complete(str(ckpts.directory))[0], res.stopped_early
