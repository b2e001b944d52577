"""Elastic runs without Ray: the worker range in the config, the global batch kept at every worker count, time-based
checkpoints, a preemption notice turning into a checkpoint at the next step boundary, and the process group's
interface on a host whose hostname is loopback. The same training across real hosts losing nodes is
tests/pipeline/test_elastic_hosts.py; resharded resumes at another worker count are in test_fsdp.py."""
from __future__ import annotations

import pytest
import torch

from pipeline.config import ConfigError, elastic_worker_counts, load_config
from pipeline.data.synthetic import write_synthetic_dataset

SEQ, VOCAB = 32, 128


def test_a_worker_range_is_max_workers_and_min_workers():
    cfg = load_config("test", ["--ray.num_workers=2-4", "--train.grad_accum=6"])
    assert (cfg.ray.min_workers, cfg.ray.num_workers) == (2, 4)
    assert load_config("test", ["--ray.num_workers= 3 - 3 "]).ray.min_workers == 3
    # a count alone is a fixed run again, whatever came before it; both fields together stay as given
    assert cfg.replace({"ray.num_workers": 4}).ray.min_workers == 0
    assert cfg.replace({"ray.num_workers": 4, "ray.min_workers": 2}).ray.min_workers == 2
    assert cfg.flat()["ray.num_workers"] == 4  # every existing use of the field still reads an int
    from pipeline.train.distributed.elastic import worker_count

    assert worker_count(cfg) == (2, 4) and worker_count(load_config("test", ["--ray.num_workers=4"])) == 4


@pytest.mark.parametrize("args, message", [
    (["--ray.num_workers=2-3"],
     "ray.num_workers=2-3 cannot keep the global batch of 12 sequences per step (train.batch_size=4 x "
     "train.grad_accum=1 x 3 workers) at 2 worker(s); the counts that can: 1, 3; pick MIN-MAX with only those between "
     "them, or set train.grad_accum to a multiple of 2 (a global batch of 24 fits every count from 2 to 3)"),
    (["--ray.num_workers=2-8", "--train.grad_accum=2"], "at 3, 5, 6, 7 worker(s); the counts that can: 1, 2, 4, 8;"),
    (["--ray.num_workers=4-2"], "ray.num_workers=4-2: MIN (4) is more than MAX (2); write MIN-MAX with MIN <= MAX"),
    (["--ray.num_workers=2-x"], "ray.num_workers='2-x' is neither a worker count nor a range"),
    (["--ray.num_workers=2-4", "--train.grad_accum=3", "--ray.placement_strategy=STRICT_SPREAD"],
     "with ray.placement_strategy=STRICT_SPREAD: Ray sizes an elastic group by the resources of each node"),
    (["--ray.min_workers=-1"], "ray.min_workers=-1 is invalid; it must be >= 0"),
    (["--train.checkpoint_every_s=-5"], "train.checkpoint_every_s=-5.0 is invalid; it must be >= 0"),
])
def test_a_bad_worker_range_is_one_line_naming_the_fix(args, message):
    with pytest.raises(ConfigError) as err:
        load_config("test", args)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_every_count_of_the_range_keeps_tokens_per_step():
    from pipeline.train.distributed.elastic import at_world_size

    cfg = load_config("test", ["--ray.num_workers=2-4", "--train.grad_accum=3"])  # 4 x 3 x 4 = 48 sequences
    assert elastic_worker_counts(cfg) == [1, 2, 3, 4, 6][:4]
    for world, accum in ((4, 3), (3, 4), (2, 6)):
        c = at_world_size(cfg, world)
        assert (c.train.grad_accum, c.ray.num_workers) == (accum, world)
        assert c.train.batch_size * c.train.grad_accum * world == 48


def test_an_elastic_range_keeps_whole_context_groups():
    """train.context_parallel_degree = 2 over 2-6 workers: only whole groups (2, 4, 6 workers: 1, 2, 3 data ranks)
    keep the global batch of 3 data ranks x 2 x 4 = 24 sequences; Ray's elastic policy is made to count room in whole
    groups (5 workers' worth of CPUs starts 4), and an attempt's grad_accum is re-derived per data rank."""
    from ray.train import ScalingConfig

    from pipeline.train.distributed.elastic import WholeContextGroups, at_world_size

    cfg = load_config("test", ["--ray.num_workers=2-6", "--train.grad_accum=2", "--train.context_parallel_degree=2",
                               "--data.seq_len=64"])
    assert elastic_worker_counts(cfg) == [2, 4, 6]
    for world, accum in ((6, 2), (4, 3), (2, 6)):
        c = at_world_size(cfg, world)
        assert (c.train.grad_accum, c.ray.num_workers) == (accum, world)
        assert c.train.batch_size * c.train.grad_accum * world // 2 == 24
    policy = WholeContextGroups(ScalingConfig(num_workers=(2, 6), resources_per_worker={"CPU": 1}), degree=2)
    assert [policy._count_possible_workers({"node": {"CPU": n}}) for n in (1, 2, 3, 5, 6, 9)] == [0, 2, 2, 4, 6, 6]


def _dataset(tmp_path):
    d = tmp_path / "ds"
    write_synthetic_dataset(d, n_train=96, n_val=8, seq_len=SEQ, vocab_size=VOCAB, seed=1, rows_per_shard=48)
    return str(d)


def _fit(tmp_path, over: dict, stop=None):
    """The Ray-free loop on a synthetic dataset; the steps it checkpointed at and its result."""
    from pipeline.data.shards import ShardReader
    from pipeline.train.engine import Engine
    from pipeline.train.loop import Hooks, fit

    ds = _dataset(tmp_path)
    cfg = load_config("test", {"data.seq_len": SEQ, "data.vocab_size": 256, "model.compile": "off",
                               "train.max_steps": 12, "train.log_every": 4, "train.eval_every": 100,
                               "train.checkpoint_every": 100, "tracking.enabled": False, **over})
    engine = Engine(cfg, VOCAB, torch.device("cpu"))
    saved: list[int] = []
    hooks = Hooks(on_checkpoint=lambda e, m: saved.append(e.step))
    res = fit(engine, lambda epoch, start: ShardReader(ds, "train", 4, seed=0, epoch=epoch, start=start), None, hooks,
              progress=False, stop=stop)
    return saved, res


def test_time_based_checkpoints_come_from_rank_0s_clock(tmp_path, monkeypatch):
    """train.checkpoint_every_s beside the step-based checkpoints: a clock that advances 1 s at every look makes
    the 2.5 s interval fall due at every third step boundary (the clock restarts at each checkpoint)."""
    from pipeline.train import loop

    ticks = iter(range(10_000))
    monkeypatch.setattr(loop.CheckpointClock, "now", staticmethod(lambda: float(next(ticks))))
    saved, res = _fit(tmp_path, {"train.checkpoint_every_s": 2.5, "train.max_steps": 9})
    assert res.step == 9 and saved == [3, 6, 9]
    saved_off, _ = _fit(tmp_path, {"train.max_steps": 9})
    assert saved_off == [9]  # only the last step's, without the clock


def test_a_preemption_notice_checkpoints_at_the_next_step_boundary(tmp_path):
    """A notice (what a SIGTERM to a Ray Train worker becomes) arriving during step 5 is seen at its end, between
    log steps: the checkpoint is step 5's and the loop stops there, saying why."""
    from pipeline.train.stop_request import StopRequest

    calls = {"n": 0}

    def notice():
        calls["n"] += 1
        return "SIGTERM to the worker on host-b (pid 7)" if calls["n"] >= 5 else None

    stop = StopRequest(notices=[notice])
    saved, res = _fit(tmp_path, {}, stop=stop)
    assert res.stopped_early and res.step == 5 and saved == [5]
    assert stop.preempted == "SIGTERM to the worker on host-b (pid 7)"


def test_the_controller_says_the_preemption_line_once_and_the_next_attempt_why(capfd):
    """The attempt a notice ended: its `preemption:` line comes from Ray Train's controller as it restarts the
    group (the workers are torn down as soon as one rank raises, so rank 0's own line could be lost), once, from
    the lowest rank's PreemptionStop; the next attempt's `restart:` line gets the same notice."""
    from ray.train.v2.api.exceptions import WorkerGroupError

    from pipeline.train.distributed import elastic

    stop = elastic.PreemptionStop(f"rank 1: SIGTERM to the worker on lt-h2 (pid 501); checkpointed step 11"
                                  f"{elastic.PREEMPTION_STOP_END}")
    error = WorkerGroupError("workers failed", {2: elastic.PreemptionStop("rank 2: other; checkpointed step 11"),
                                                1: stop})
    RestartingState = type("RestartingState", (), {"training_failed_error": error})
    events = elastic.ElasticEvents(None)
    elastic._PENDING.clear()
    try:
        events.after_controller_state_update(None, RestartingState())
        events.after_controller_state_update(None, RestartingState())  # a failed start after it: no second line
        assert elastic._PENDING["why"] == ("a preemption notice: rank 1: SIGTERM to the worker on lt-h2 (pid 501); "
                                           "checkpointed step 11, stopping this attempt")
    finally:
        elastic._PENDING.clear()
    assert capfd.readouterr().out.splitlines() == [
        "preemption: rank 1: SIGTERM to the worker on lt-h2 (pid 501); checkpointed step 11, this attempt stops "
        "and the next starts on the nodes that remain"]
    lost = WorkerGroupError("workers failed", {0: RuntimeError("The actor died because its node has died.")})
    assert elastic.preemption_notice(lost) is None and elastic.preemption_notice(None) is None


def test_the_process_group_binds_to_the_node_ip_interface_or_refuses(monkeypatch):
    """This machine's hostname may resolve to 127.0.0.1 (as here); a node IP no interface holds is refused in one
    line naming the fix; a loopback node IP (every worker on this machine) needs nothing."""
    from pipeline.train.distributed import node_network as nn

    monkeypatch.setattr(nn, "hostname_address", lambda: "127.0.0.1")
    for name in nn.IFNAME_ENVS:
        monkeypatch.delenv(name, raising=False)
    assert nn.interface_of("127.0.0.1") == "lo"
    assert nn.bind_process_group("127.0.0.1") is None
    with pytest.raises(nn.ProcessGroupNetworkError) as err:
        nn.bind_process_group("203.0.113.9")  # TEST-NET-3: on no interface here
    assert "resolves to 127.0.0.1, and no interface of this machine holds Ray's node IP 203.0.113.9" in str(err.value)
    assert "GLOO_SOCKET_IFNAME" in str(err.value) and "\n" not in str(err.value)


def test_a_node_refused_inside_ray_is_its_one_line_on_the_driver():
    """The refusal raised in a worker during Ray Train's start reaches the driver wrapped (a task error inside a
    controller error); the driver raises its one line, which the CLI prints as `error: ...`."""
    from ray.exceptions import RayTaskError
    from ray.train.v2.api.exceptions import ControllerError

    from pipeline.train.distributed.elastic import raise_setup_error
    from pipeline.train.distributed.node_network import ProcessGroupNetworkError

    line = "node 203.0.113.9: its hostname 'b' resolves to 127.0.0.1, ... set GLOO_SOCKET_IFNAME"
    wrapped = ControllerError(RayTaskError("execute", "Traceback ...\n" + line, ProcessGroupNetworkError(line)))
    with pytest.raises(ProcessGroupNetworkError) as err:
        raise_setup_error(wrapped)
    assert str(err.value) == line
    raise_setup_error(ControllerError(RuntimeError("something else")))  # not ours: left to the caller


def _stub_engine(workers: int, degree: int, step: int = 3):
    from types import SimpleNamespace

    cfg = load_config("test", {"ray.num_workers": workers, "train.context_parallel_degree": degree,
                               "data.seq_len": 64, "train.batch_size": 4})
    mesh = SimpleNamespace(degree=degree, describe=lambda: f"data {workers // degree} x context {degree} "
                                                           f"({workers} worker(s))")
    return SimpleNamespace(cfg=cfg, world_size=workers, data_world_size=workers // degree, step=step, mesh=mesh,
                           parallel="ddp", parallel_reason="the model fits one worker")


@pytest.mark.parametrize("degree, rows, note", [(1, 16, ""), (4, 4, " (context groups of 4 share their rows)")])
def test_the_resize_line_counts_the_rows_a_step_holds(tmp_path, degree, rows, note):
    """`train --resume RUN --ray.num_workers=4 --train.context_parallel_degree=4` from a one-worker run: the step
    holds train.batch_size x train.grad_accum x the data ranks (4 rows at degree 4, not 16): the line every resize
    of an elastic run prints too (pipeline/train/distributed/elastic.py ResumeReport.start)."""
    import json

    from pipeline.train.distributed.elastic import PROGRESS_FILE, ResumeReport

    (tmp_path / PROGRESS_FILE).write_text(json.dumps({"step": 3, "time": 0.0, "world_size": 1, "phase": 0}))
    lines = ResumeReport(str(tmp_path), phase=0).start(_stub_engine(4, degree), meta=None)
    assert lines == [f"elastic: the worker group grew from 1 to 4 worker(s) at step 3: a resumed run; "
                     f"train.grad_accum 1 keeps {rows} sequences per step{note}"]


def test_a_resume_on_another_mesh_is_recorded_in_the_runs_tag(capfd):
    """MLflow params are written once (ray.num_workers and train.context_parallel_degree keep the run's first values),
    so the mesh a resume changes to is a tag, with the step since when (names.py MESH_TAG)."""
    from pipeline.tracking.names import MESH_TAG
    from pipeline.train.ray_train import _announce_parallel

    class Tags:
        def __init__(self):
            self.tags = {}

        def set_tags(self, tags):
            self.tags.update(tags)

    meta = {"world_size": 1, "layout": "full", "config": {"train": {"context_parallel_degree": 1, "batch_size": 4,
                                                                    "grad_accum": 1}}}
    tracker = Tags()
    _announce_parallel(_stub_engine(4, 4), meta, tracker)
    assert tracker.tags[MESH_TAG] == ("4 worker(s), data 1 x context 4 since step 3 (before: 1 worker(s), data 1 x "
                                      "context 1)")
    assert "context parallel degree 1 -> 4" in capfd.readouterr().out
    tracker = Tags()
    _announce_parallel(_stub_engine(4, 2), {**meta, "world_size": 4, "config": {"train": {
        "context_parallel_degree": 2}}}, tracker)
    assert tracker.tags[MESH_TAG] == "4 worker(s), data 2 x context 2"  # nothing changed: no step named
