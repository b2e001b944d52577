"""A checkpoint that fails to load, said in one line: the file, what is wrong with it, and the previous complete
checkpoint of the same run, offered as the command to run instead. Used by eval, generate, export, `train --resume`
(both engines) and `validate`.

    with diagnosed(location):        # location: the checkpoint as the user named it (a directory or a URI)
        engine.load(local_copy)      # any failure to read it becomes BrokenCheckpoint, or stays what it was

The dataset's tokenizer, which every checkpoint of a run reads, is checked apart: pipeline/data/shards.py
dataset_tokenizer(meta["dataset_dir"], checkpoint), one line naming its file.

Cheap when nothing is wrong: the load is tried first. Only when it fails (an error from safetensors, torch.load with
weights_only=True, json, torch.distributed.checkpoint, or the project's own CheckpointError) is every file read back
and compared with meta.json's record (size and sha256, pipeline/train/checkpoints/index.py incomplete) to name the
file, and the run's folder listed for the newest complete checkpoint older than the broken one. A StorageError stays
a StorageError (an outage is never reported as a corrupt file), and an error that no broken file explains (another
tier, a bug, a text or JSON error while every file is whole: another file read by the command) goes on as it was.

No silent fallback past a file that lies about itself: a checkpoint whose listing is whole but whose bytes are
wrong ends the command with the previous checkpoint offered, `--checkpoint PREV` in the same command line (the CLI,
pipeline/run.py, fills in the exact command). A checkpoint the listing already shows incomplete is a different case:
`train --resume` skips it for the newest complete one in one line (pipeline/train/checkpoints/index.py latest_complete).
"""
from __future__ import annotations

import contextlib
import json
import pickle
import shlex
from typing import Any, Iterator

from pipeline.storage import StorageError, basename, first_line, join
from pipeline.train.checkpoints.checkpoint_error import CheckpointError
from pipeline.train.checkpoints.index import checkpoint_names, incomplete, run_folder, step_of


class BrokenCheckpoint(CheckpointError):
    """A checkpoint file that is missing, truncated or corrupt. `problem`: what is wrong (names the file);
    `previous`: the newest complete checkpoint older than it in the run's folder (None: there is none)."""

    def __init__(self, location: str, problem: str, previous: str | None, previous_step: int | None = None):
        self.location, self.problem, self.previous, self.previous_step = location, problem, previous, previous_step
        super().__init__(self.line())

    def __reduce__(self):  # through Ray's wrappers and worker processes with its fields
        return BrokenCheckpoint, (self.location, self.problem, self.previous, self.previous_step)

    def line(self, command: str | None = None) -> str:
        """The one line: the problem and what to do. `command`: the command line that uses the previous checkpoint
        (pipeline/run.py builds it from the one typed); without it, `--checkpoint PREV` is named."""
        if self.previous is None:
            return (f"{self.problem}; {run_folder(self.location)} holds no complete checkpoint older than it: restore "
                    f"the file from a copy, or train again (another --run.name)")
        step = f" (step {self.previous_step})" if self.previous_step is not None else ""
        use = command or f"pass --checkpoint {self.previous}"
        return f"{self.problem}; the previous complete checkpoint is {self.previous}{step}: {use}"


def previous_complete(location: str) -> tuple[str | None, int | None]:
    """(the newest complete checkpoint older than `location` in the same folder, its step), or (None, None). Older
    means a smaller name: Ray Train's names carry the time, a Ray-free run's the step."""
    folder, name = run_folder(location), basename(location)
    try:
        names = checkpoint_names(folder)
    except FileNotFoundError:
        return None, None
    for older in (n for n in names if n < name):
        candidate = join(folder, older)
        if incomplete(candidate) is None:
            return candidate, step_of(candidate)
    return None, None


def is_checkpoint(location: str) -> bool:
    """Whether `location` is a checkpoint directory (it holds meta.json, or one of a checkpoint's files)."""
    from pipeline.storage import is_file

    return any(is_file(join(location, n)) for n in ("meta.json", "model.safetensors", "sharded/.metadata"))


def _library_error(exc: BaseException) -> bool:
    """An error a file format raised on bytes it could not read (not a bug in the code that called it)."""
    from safetensors import SafetensorError
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, (SafetensorError, CheckpointException, pickle.UnpicklingError, EOFError,
                        json.JSONDecodeError, UnicodeDecodeError)):
        return True
    return isinstance(exc, RuntimeError) and "PytorchStreamReader" in str(exc)  # torch.load of a broken zip


def _reason(exc: BaseException) -> str:
    """The library's own words, short (their first sentence): 'safetensors: Error while deserializing header: ...'."""
    failures = getattr(exc, "failures", None)  # torch.distributed.checkpoint's CheckpointException: rank -> (exc, tb)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))[0]
        said = f"torch.distributed.checkpoint: {type(inner).__name__}: {first_line(inner)}"
    else:
        lib = type(exc).__module__.split(".")[0]
        said = f"{type(exc).__name__ if lib == 'builtins' else lib}: {first_line(exc)}"
    return said.split(". ")[0][:160]


def diagnose(location: str, exc: BaseException) -> BrokenCheckpoint | None:
    """What `exc` (raised loading the checkpoint at `location`) says about its files: a BrokenCheckpoint naming the
    file (its size and sha256 against meta.json's record), or None when no broken file explains it."""
    problem = incomplete(location, content=True)  # StorageError goes up as what it is
    if problem is not None and problem.endswith("has no meta.json") and not is_checkpoint(location):
        return None  # not a checkpoint at all (a wrong path): the error that says so stands
    if problem is None:
        # Whole files (sizes and sha256 as meta.json records, meta.json itself parsed): a text decoding or JSON error
        # cannot be theirs (meta.json is the checkpoint's only text file), so it came from something else read
        # during the command (a prompts file, a dataset's file) and must not be blamed on the checkpoint.
        if not _library_error(exc) or isinstance(exc, (UnicodeDecodeError, json.JSONDecodeError)):
            return None
        problem = f"checkpoint {location} could not be read ({_reason(exc)})"
    elif not isinstance(exc, CheckpointError):
        problem = f"{problem} ({_reason(exc)})"
    return BrokenCheckpoint(location, problem, *previous_complete(location))


@contextlib.contextmanager
def diagnosed(location: Any) -> Iterator[None]:
    """Run a load of the checkpoint at `location`; a failure a broken file explains becomes BrokenCheckpoint."""
    try:
        yield
    except (StorageError, BrokenCheckpoint):
        raise
    except (ValueError, RuntimeError, OSError, EOFError, pickle.UnpicklingError) as exc:
        broken = diagnose(str(location), exc)
        if broken is None:
            raise
        raise broken from None
    except BaseException as exc:  # torch.distributed.checkpoint's CheckpointException is a BaseException's child
        broken = diagnose(str(location), exc) if _library_error(exc) else None  # never a Ctrl+C
        if broken is None:
            raise
        raise broken from None


def offered_command(argv: list[str], previous: str, stage: str, target: str | None = None) -> str:
    """The command line typed (`argv`, after `python pipeline/run.py`), with --checkpoint PREV in place of any
    --checkpoint (validate: PREV in place of its `target`): what BrokenCheckpoint offers."""
    out: list[str] = []
    it = iter(argv)
    for a in it:
        if a == "--checkpoint":
            next(it, None)
        elif not a.startswith("--checkpoint="):
            out.append(a)
    if stage == "validate":
        out = [previous if a == target else a for a in out]
    else:  # after --resume RUN when there is one (train --resume RUN --checkpoint PREV), else after the stage
        at = next((i + 1 + (a == "--resume") for i, a in enumerate(out) if a == "--resume" or
                   a.startswith("--resume=")), out.index(stage) + 1 if stage in out else 0)
        out = out[:at] + ["--checkpoint", previous] + out[at:]
    return "python pipeline/run.py " + shlex.join(out)
