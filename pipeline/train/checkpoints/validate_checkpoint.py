"""`validate` on a checkpoint: every file against meta.json's record, that it loads, and its dataset's tokenizer.

    python pipeline/run.py validate runs/<run>/checkpoints/phase0/step_000200   # a checkpoint directory or URI
    python pipeline/run.py validate runs/<run>                                  # a run: its latest checkpoint

Every file meta.json's `files` records is read back and compared (size and sha256: pipeline/train/checkpoints/index.py
file_problems); when all match, the weights are loaded (a sharded checkpoint consolidated, as eval reads it) and a
full checkpoint's train_state.pt is read with torch.load(weights_only=True); the tokenizer of the dataset the
checkpoint names is loaded and compared with the sha256 its manifest records. The report names each broken file; a
broken checkpoint exits 1 and offers the previous complete checkpoint of the run.
"""
from __future__ import annotations

import json
from typing import Any

from pipeline.data.shards import DatasetError, TokenizerMissing, dataset_tokenizer
from pipeline.storage import first_line, local_copy
from pipeline.train.checkpoints.broken import previous_complete
from pipeline.train.checkpoints.state import FULL, TRAIN_STATE, CheckpointError, load_model_state, read_checkpoint_meta
from pipeline.train.checkpoints.index import file_problems, incomplete, read_meta


def _loads(location: str) -> str | None:
    """None when the checkpoint loads as eval and train --resume read it, else what failed."""
    import torch

    try:
        with local_copy(location) as local:
            meta = read_checkpoint_meta(local)
            load_model_state(local, meta)
            if meta["layout"] == FULL:
                torch.load(local / TRAIN_STATE, map_location="cpu", weights_only=True)
    except CheckpointError as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 -- any library's failure on these bytes is the finding
        from pipeline.storage import StorageError

        if isinstance(exc, StorageError):
            raise
        return f"{type(exc).__module__.split('.')[0]}: {first_line(exc)}"[:200]
    return None


def check_checkpoint(location: str) -> tuple[list[str], list[str]]:
    """(problems, lines of the report) for the checkpoint at `location`."""
    lines, problems = [], []
    try:
        meta: dict[str, Any] | None = read_meta(location)
    except (json.JSONDecodeError, UnicodeDecodeError):
        meta = None
    if meta is None:  # no meta.json, or one that does not parse: incomplete() says which
        problems.append(incomplete(location))
        return problems, [f"  BROKEN  {problems[-1]}"]
    record = meta.get("files") or {}
    counters = meta.get("counters", {})
    lines.append(f"  step {counters.get('step', '?')}, layout {meta.get('layout', FULL)}, tier {meta.get('tier')}, "
                 f"{len(record)} files recorded in meta.json")
    found = list(file_problems(location, meta, content=True))
    for p in found:
        problems.append(p)
        lines.append(f"  BROKEN  {p}")
    bad = {name for name in record if any(f" {name}" in p for p in found)}
    for name in sorted(set(record) - bad):
        lines.append(f"  ok      {name}: {record[name]['bytes']:,} bytes, sha256 as recorded")
    if not found:
        failed = _loads(location)
        if failed:
            problems.append(f"checkpoint {location} does not load: {failed}")
            lines.append(f"  BROKEN  {problems[-1]}")
        else:
            lines.append("  ok      loads: the weights" + (f" and {TRAIN_STATE}" if meta.get("layout", FULL) == FULL
                                                           else " (consolidated from the shards)"))
    if meta.get("dataset_dir"):
        try:
            tok = dataset_tokenizer(meta["dataset_dir"], location)
            lines.append(f"  ok      tokenizer {tok.path}: loads, vocab {tok.vocab_size}")
        except TokenizerMissing as exc:  # a dataset moved away: the checkpoint itself is whole
            lines.append(f"  note    {exc}")
        except DatasetError as exc:  # the tokenizer model itself is broken
            problems.append(str(exc))
            lines.append(f"  BROKEN  {exc}")
    return problems, lines


def validate_checkpoint(location: str, command_for=None) -> int:
    """Print the report for the checkpoint at `location`; 0 when it is whole, 1 otherwise. `command_for(prev)`: the
    command line that validates the previous checkpoint instead (the CLI's own), default `validate PREV`."""
    problems, lines = check_checkpoint(location)
    print(f"validate: checkpoint {location}")
    print("\n".join(lines))
    if not problems:
        print(f"checkpoint {location} is whole: every recorded file matches meta.json, and it loads")
        return 0
    previous, step = previous_complete(location)
    if previous is None:
        offer = "no complete checkpoint older than it is in the run's folder"
    else:
        command = command_for(previous) if command_for else f"python pipeline/run.py validate {previous}"
        offer = (f"the previous complete checkpoint is {previous} (step {step}): check it with `{command}` and use "
                 f"it with --checkpoint {previous}")
    print(f"checkpoint {location} is broken ({len(problems)} problem{'s' * (len(problems) > 1)}); {offer}")
    return 1
