"""The checkpoint room's error, in a module of its own so that a command that only reports one (`eval`, `export`,
`generate` and `validate` before they load anything; pipeline/run.py) need not import torch with
pipeline/train/checkpoints/state.py, which raises it and re-exports it."""
from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not fit the configured model."""
