"""Loss-spike detection on the device: the step's loss and gradient norm against a trailing window of the steps that
applied, in the transfer to the host the step makes anyway. Ray-free; the engine owns one (through
pipeline/train/spike_guard.py, which decides what an outlier does).

    detector = SpikeDetector(SpikeSettings.of(cfg.train), device)
    row = detector.measure(loss, grad_norm)            # (7,) float64 on the device; queued ops, no sync
    verdict = detector.verdict(row.tolist())           # the step's one transfer (the non-finite guard's) decides
    if not verdict.outlier and verdict.finite:
        detector.record(loss, grad_norm)               # into the window: a device copy, no sync

The test (OLMo-core's skip step, the defaults): a step is an outlier when its loss or its gradient norm is more than
`train.spike_sigmas` standard deviations above the mean of the last `train.spike_window` steps that applied, once
`train.spike_warmup_steps` of them are in the window. The loss is the step's mean over every rank (all-reduced by
the engine) and the gradient norm the global one (after DDP's all-reduce, FSDP's reduction), so every rank of a run
sees the same numbers and decides the same way. An outlier does not enter the window: a burst of them must not raise
its own threshold. The deviation is at least REL_FLOOR of the mean, so a window of near-equal values does not flag
noise.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

REL_FLOOR = 1e-3  # the deviation used is at least this share of the window's mean
ACTIONS = ("skip", "apply", "off")  # train.spike_action


@dataclass(frozen=True)
class SpikeSettings:
    """train.spike_* (pipeline/config.py validates them; docs/training.md#loss-spikes says how to tune them)."""
    action: str = "skip"  # skip: an outlier applies no update; apply: it is applied and watched; off: no detection
    sigmas: float = 6.0  # standard deviations above the window's mean that make an outlier
    window: int = 128  # steps (that applied) the mean and deviation are taken over
    warmup_steps: int = 128  # steps in the window before detection arms
    rewind_outliers: int = 3  # this many outliers within rewind_window steps rewind the run (0: never for repeats)
    rewind_window: int = 100  # steps (taken or skipped) in which repeated outliers count together
    recover_steps: int = 20  # apply: steps the loss may stay above its pre-spike mean before a rewind (0: no watch)
    skip_steps: int = 200  # a rewind skips at least this many steps' worth of rows, from the checkpoint on
    max_rewinds: int = 3  # rewinds in a run; the next one due stops it

    @classmethod
    def of(cls, train: Any) -> "SpikeSettings":
        return cls(action=train.spike_action, sigmas=train.spike_sigmas, window=train.spike_window,
                   warmup_steps=train.spike_warmup_steps, rewind_outliers=train.spike_rewind_outliers,
                   rewind_window=train.spike_rewind_window, recover_steps=train.spike_recover_steps,
                   skip_steps=train.spike_skip_steps, max_rewinds=train.spike_max_rewinds)

    @property
    def enabled(self) -> bool:
        return self.action != "off"


@dataclass(frozen=True)
class Verdict:
    """One step as the detector saw it (host floats). Limits are NaN while the detector is not armed."""
    finite: bool
    outlier: bool
    loss: float
    loss_limit: float
    grad_norm: float
    grad_norm_limit: float
    loss_mean: float  # the window's mean loss (NaN before it arms): a spike's "pre-spike level"
    window: int  # values the mean and deviation were taken over

    def describe(self) -> str:
        """`loss 7.214 > limit 5.431 (the mean of the last 128 steps + 6 sd); grad norm 0.84 (limit 2.14)`."""
        over = [name for name, v, lim in (("loss", self.loss, self.loss_limit),
                                          ("grad norm", self.grad_norm, self.grad_norm_limit)) if v > lim]
        parts = [f"loss {self.loss:.4g} {'>' if 'loss' in over else '<='} limit {self.loss_limit:.4g} "
                 f"(mean {self.loss_mean:.4g} of the last {self.window} steps)",
                 f"grad norm {self.grad_norm:.4g} {'>' if 'grad norm' in over else '<='} limit "
                 f"{self.grad_norm_limit:.4g}"]
        return "; ".join(parts)

    def to_dict(self) -> dict[str, float]:
        return {"loss": self.loss, "loss_limit": self.loss_limit, "grad_norm": self.grad_norm,
                "grad_norm_limit": self.grad_norm_limit, "loss_mean": self.loss_mean}


class SpikeDetector:
    """The trailing window of losses and gradient norms (fp64, on the device) and the test against it.

    values: (2, window) ring buffer, row 0 the losses and row 1 the gradient norms (`losses`, `norms`: views of
    them); `count` (a host int) steps were recorded, the newest at (count - 1) % window. Nothing here reads a device
    value on its own: `measure` queues about fifteen small ops, `verdict` reads the row the caller transferred with
    the step's own sync, `record` is one device copy at a host-known index."""

    def __init__(self, settings: SpikeSettings, device: torch.device):
        self.settings, self.device = settings, torch.device(device)
        self.values = torch.zeros(2, settings.window, dtype=torch.float64, device=self.device)
        self.losses, self.norms = self.values[0], self.values[1]
        self._unarmed = torch.full((3,), math.nan, dtype=torch.float64, device=self.device)  # no limits, no mean
        self._no = torch.zeros((), dtype=torch.bool, device=self.device)
        self.count = 0

    @property
    def armed(self) -> bool:
        return self.count >= max(2, self.settings.warmup_steps)

    def measure(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """(7,) float64: finite, outlier, loss, grad norm, loss limit, grad norm limit, the window's mean loss (NaN
        limits and mean before the detector arms). loss, grad_norm: 0-d tensors of this step (the loss averaged over
        every rank, the global gradient norm)."""
        v = torch.stack([loss.detach(), grad_norm.detach()]).double()  # (2,)
        finite = torch.isfinite(v).all()
        if not self.armed:
            return torch.cat([torch.stack([finite, self._no]).double(), v, self._unarmed])
        sd, mean = torch.std_mean(self.values[:, :min(self.count, self.settings.window)], dim=1)  # (2,) each
        limit = mean + torch.maximum(sd, mean.abs() * REL_FLOOR) * self.settings.sigmas
        outlier = (v > limit).any() & finite
        return torch.cat([torch.stack([finite, outlier]).double(), v, limit, mean[:1]])

    def verdict(self, row: list[float]) -> Verdict:
        finite, outlier, loss, norm, loss_limit, norm_limit, mean = row
        return Verdict(finite=bool(finite), outlier=bool(outlier), loss=loss, loss_limit=loss_limit, grad_norm=norm,
                       grad_norm_limit=norm_limit, loss_mean=mean, window=min(self.count, self.settings.window))

    def record(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """A step that applied joins the window (replacing the oldest once it is full)."""
        self.values[:, self.count % self.settings.window] = torch.stack([loss.detach(), grad_norm.detach()])
        self.count += 1

    def reset(self) -> None:
        """An empty window (a new phase: its data's loss level is its own); warm-up again."""
        self.values.zero_()
        self.count = 0

    # A checkpoint holds the window, so a resumed run decides exactly as the run it continues (a device read: at
    # checkpoints only).
    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "losses": self.losses.tolist(), "norms": self.norms.tolist()}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not state or len(state.get("losses", ())) != self.settings.window:  # none, or another train.spike_window
            self.reset()  # detection warms up again
            return
        self.count = int(state["count"])
        self.values.copy_(torch.tensor([state["losses"], state["norms"]], dtype=torch.float64))
