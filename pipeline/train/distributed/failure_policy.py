"""Which worker errors Ray Train retries: only those another attempt may not meet again.

Ray Train's default policy restarts the worker group after any worker error, up to ray.max_failures times. An error
the next attempt raises again (a truncated checkpoint to resume from, a config or dataset refusal, a sweep metric no
report carries, a full disk) then costs every retry, each with its own worker start-up and traceback, before its one
line. Those are the project's own ValueError subclasses (bad input: its files, config, data), MissingMetricError and
the errors that say so (`repeats_on_retry = True`: pipeline/disk_space.py DiskFullError); they end the run at once. The rest keep Ray Train's retries: a storage outage, a collective timeout or a lost node, a
preemption, a non-finite loss, an MLflow server that did not answer, and any error that is not the project's (a bug,
an out-of-memory, a dead worker).

    trainer = trainer_class(TorchTrainer)(..., run_config=RunConfig(failure_config=FailureConfig(max_failures=3)))
    quiet_repeating_tracebacks()    # in each worker: no Ray traceback for an error that is not retried

The policy object is shipped to Ray Train's controller actor, which imports this module to unpickle it.
"""
from __future__ import annotations

import logging
import sys

from ray.train.v2._internal.execution.callback import ControllerCallback
from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy, FailureDecision
from ray.train.v2.api.exceptions import WorkerGroupError

OWN_PACKAGES = ("pipeline", "model", "cuda_ops")


def repeats_on_retry(exc: BaseException | type) -> bool:
    """Whether another attempt would raise `exc` (an error or its class) again: a user-input error of the
    project's (its ValueError subclasses, TrackingError aside: a server that did not answer may answer the next
    time) or a sweep report that lacks the sweep's metric."""
    cls = exc if isinstance(exc, type) else type(exc)
    if cls.__module__.split(".")[0] not in OWN_PACKAGES:
        return False
    if cls.__name__ == "MissingMetricError" or getattr(cls, "repeats_on_retry", False):  # a full disk, say
        return True
    from pipeline.tracking.tracker import TrackingError

    return issubclass(cls, ValueError) and not issubclass(cls, TrackingError)


class NoRetryOfRepeatingErrors(DefaultFailurePolicy):
    """Ray Train's default policy, except that a worker group error that repeats on retry (repeats_on_retry, any
    rank) ends the run at once, whatever ray.max_failures allows."""

    def make_decision(self, training_failed_error) -> FailureDecision:
        if isinstance(training_failed_error, WorkerGroupError) and any(
                repeats_on_retry(e) for e in (training_failed_error.worker_failures or {}).values()):
            return FailureDecision.RAISE
        return super().make_decision(training_failed_error)


def trainer_class(base: type) -> type:
    """`base` (TorchTrainer) whose controller decides with NoRetryOfRepeatingErrors: Ray Train builds its policy
    from the FailureConfig alone (create_failure_policy), so the one handed to its controller is replaced."""
    if base not in _trainer_classes:
        def _initialize_and_run_controller(self, **controller_init_kwargs):
            controller_init_kwargs["failure_policy"] = NoRetryOfRepeatingErrors(self.run_config.failure_config)
            return base._initialize_and_run_controller(self, **controller_init_kwargs)

        _trainer_classes[base] = type(base.__name__, (base,), {
            "_initialize_and_run_controller": _initialize_and_run_controller, "__module__": __name__})
    return _trainer_classes[base]


_trainer_classes: dict[type, type] = {}


class _DropRepeatingErrorTraceback(logging.Filter):
    """In a worker: Ray Train's `Error in training function:` traceback of an error that ends the run without a
    retry (repeats_on_retry): the driver prints its one line. Ray's log files keep it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        lines = record.getMessage().rstrip().splitlines()
        if not lines or not lines[0].startswith("Error in training function"):
            return True
        name = lines[-1].split(":", 1)[0]  # the traceback's last line: package.module.ErrorClass: message
        module, _, cls = name.rpartition(".")
        error = getattr(sys.modules.get(module), cls, None)
        return not (isinstance(error, type) and issubclass(error, BaseException) and repeats_on_retry(error))


def quiet_repeating_tracebacks() -> None:
    """In a Ray Train worker: the console handlers drop the traceback of an error that is not retried."""
    for name in ("ray.train", "ray", ""):
        for handler in logging.getLogger(name).handlers:
            if "File" in type(handler).__name__:
                continue
            if not any(isinstance(f, _DropRepeatingErrorTraceback) for f in handler.filters):
                handler.addFilter(_DropRepeatingErrorTraceback())


class QuietController(ControllerCallback):
    """In Ray Train's controller: its console drops the warnings Ray says are safe to ignore (a resource request
    to the autoscaling coordinator that timed out on a busy machine, with its traceback): pipeline/console.py."""

    def __init__(self) -> None:
        # Also when the controller unpickles it: before Ray Train's scaling policy sends its first resource
        # request, in an after_controller_start hook that runs ahead of ours.
        from pipeline.console import quiet_safe_to_ignore

        quiet_safe_to_ignore()

    def __reduce__(self):
        return QuietController, ()

    def after_controller_start(self, train_run_context) -> None:
        from pipeline.console import quiet_safe_to_ignore

        quiet_safe_to_ignore()  # Ray Train's handlers, configured since
