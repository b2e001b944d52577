"""The placement groups a sweep's trials hold, given back: when Tune ends a trial (`ReleaseTrialResources`, a Tune
callback in the driver) and after a Ctrl+C'd sweep's job has ended (`release_ended_job`).

A trial ASHA stops early is ended by Tune terminating the trial's actor; the Train controller dies with it, and its
workers' placement group would not: Ray ties it to the job (the sweep's driver), and only Ray Train's
PlacementGroupCleaner, polling the state API, would remove it later. On a machine whose GPUs fit one trial that left
every later trial waiting for resources that never came back. So the callback removes the trial's placement group
(every report names it) the moment Tune ends the trial. A Ctrl+C ends the driver's job, and with it every trial at
once; on a Ray that outlives the command the driver then joins it again for a moment and removes any group that job
still holds: a Train controller restarting its worker group as the job ended can register a group after Ray has
removed the job's, and that group would stay held.
"""
from __future__ import annotations

import time

from ray.tune import Callback

from pipeline.train.ray_train import PLACEMENT_GROUP_KEY


class ReleaseTrialResources(Callback):
    """Tune callback (driver side): when Tune ends a trial, remove the placement group its Train run holds.

    A trial ended by its own return has already released it (the Train controller removes it on shutdown);
    this is for a trial Tune stops (ASHA) or whose actor dies, whose Train controller dies with the actor and
    leaves the placement group to the job. Removing it also ends the Train workers inside it."""

    def __init__(self) -> None:
        self.placement_groups: dict[str, str] = {}  # trial id -> hex id of its Train run's latest placement group
        self.released: list[str] = []

    def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
        if result.get(PLACEMENT_GROUP_KEY):
            self.placement_groups[trial.trial_id] = result[PLACEMENT_GROUP_KEY]

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        self.release(trial.trial_id)

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        self.release(trial.trial_id)

    def release(self, trial_id: str) -> None:
        import ray
        from ray.util.placement_group import PlacementGroup, remove_placement_group

        pg_hex = self.placement_groups.pop(trial_id, None)
        if not pg_hex:
            return
        pg = PlacementGroup(ray.PlacementGroupID.from_hex(pg_hex))
        if ray.util.placement_group_table(pg).get("state") in (None, "REMOVED"):
            return  # the Train run gave it back itself
        remove_placement_group(pg)
        self.released.append(pg_hex)
        print(f"tune: trial {trial_id} ended; released its Train placement group {pg_hex}", flush=True)


def job_placement_groups(job: str) -> set[str]:
    """Hex ids of the placement groups that job `job` (hex) holds on the connected Ray: for a sweep, Tune's trial
    groups and, inside the trials, their Train runs' groups (a group's id ends in the id of the job that made it)."""
    import ray

    return {pg for pg, info in ray.util.placement_group_table().items()
            if pg.endswith(job) and info["state"] != "REMOVED"}


def release_placement_groups(job: str, kept: frozenset[str] = frozenset(), quiet_s: float = 2.0,
                             timeout_s: float = 30.0) -> list[str]:
    """Every placement group of job `job` but `kept` removed from the connected Ray, again as new ones come, until
    none has come for `quiet_s` (at most `timeout_s`); the hex ids removed."""
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    removed: list[str] = []
    quiet_since, deadline = None, time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = sorted(job_placement_groups(job) - kept - set(removed))
        for pg in left:
            try:
                remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(pg)))
            except Exception:  # noqa: BLE001 -- removed meanwhile by Ray (its creator died); the next pass looks again
                continue
            removed.append(pg)
        now = time.monotonic()
        if left:
            quiet_since = None
        elif quiet_since is None:
            quiet_since = now
        elif now - quiet_since >= quiet_s:
            break
        time.sleep(0.2)
    return removed


def release_ended_job(gcs_address: str, job: str) -> list[str]:
    """After a Ctrl+C'd sweep's driver left a Ray that outlives it: joins that Ray again for a moment and removes
    any placement group its ended job still holds (`release_placement_groups`).

    Ending the job is what ends the trials all at once, so their MLflow runs stay RUNNING for the sweep to mark
    KILLED (removing their groups first, while the job lived, let a trial see its Train run fail and mark its run
    FAILED). But the end of a job is a race in Ray: a Train controller restarting its worker group as the job ended
    registered a new group 0.2 s after the GCS had removed the job's, and nothing ever removed it (2026-11-30,
    docs/tests.md). It held its bundle's CPUs; a GPU, on a one-GPU machine, and every later run there would wait
    for it. Best effort: a Ray that cannot be joined again is left as it is."""
    import logging

    import ray

    try:
        ray.init(address=gcs_address, logging_level=logging.WARNING, log_to_driver=False)
    except Exception:  # noqa: BLE001 -- the sweep is already interrupted; its own line says so
        return []
    try:
        return release_placement_groups(job)
    finally:
        ray.shutdown()
