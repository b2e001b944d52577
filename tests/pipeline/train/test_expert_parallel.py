"""Expert parallelism (train.expert_parallel_degree): the experts of every MoE layer split over the ranks of an
expert group, tokens moved to them and back by all-to-all, on CPU with gloo (pipeline/train/distributed/
expert_parallel.py).

    .venv/bin/python -m pytest -q tests/pipeline/train/test_expert_parallel.py                  # all (system)
    .venv/bin/python -m pytest -q -m "not system" tests/pipeline/train/test_expert_parallel.py  # the quick ones

Quick: each impossible combination is one line before any worker starts (load_config, --no-ray, an elastic range).
System (one spawn of a gloo group of 4 processes, one engine run in this process before and after it):
  - the model (nano-moe, both families) at expert degree 2 and 4 against one process holding every expert and
    every rank's rows (tests/pipeline/train/expert_cases.py), fp64: loss within 1e-13, every gradient within 1e-12
    absolute (gradients of ~90 at most; summation order is all that differs);
  - the engine and the loop as launchers run them, 6 steps of nano-moe with the same global batch of 8 rows: expert
    degree 1 (DDP), 2 and 4 (DDP and FSDP), 2 with every block checkpointed (the exchange runs again in the
    recompute), 2 with compiled blocks (the exchange runs eagerly between their graphs), expert 2 x context 2 (FSDP),
    and, against degree 1 on the same 4 ranks, a capacity factor (degree 2) and the selection bias (2, FSDP), for attention, and degrees 1, 2 (FSDP) and
    4 (DDP) for resonance, against the one-process engine, every step clipped (train.grad_clip=0.5 under the
    gradient norm, which is taken over every expert wherever it lives). fp32: losses rel 1e-5, gradient norms rel
    1e-4, weights 1e-4 absolute (the tolerances tests/pipeline/train/test_context_parallel.py states for AdamW
    steps whose sums change order);
  - the checkpoints written at expert degree 2 (step 3, 4 workers; DDP, and FSDP whose experts are also sharded
    over their replicas, evaluating before every step's checkpoint and training on after it) resumed at degree 4
    (4 workers, DDP and FSDP) and at degree 1 (one process): steps 4-6 are those of the run that never stopped; and
    a one-process checkpoint (full layout, every expert in one tensor) resumed at degree 2 on 4 workers.
The Ray Train run (4 workers, data 2 x experts 2, FSDP, resumed at another degree) is
tests/pipeline/train/test_expert_parallel_ray.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.config import ConfigError, load_config

SEQ, VOCAB, STEPS, SAVE_AT = 32, 512, 6, 3
TOL = dict(rel=1e-5, abs=1e-6)  # losses, fp32
WEIGHT_TOL = dict(rtol=0, atol=1e-4)  # module docstring
MOE = {"model.tier": "nano-moe"}


# ------------------------------------------------------------------------------------------------- quick
@pytest.mark.parametrize("over, says", [
    ({"train.expert_parallel_degree": 3}, "train.expert_parallel_degree=3 does not divide model.num_experts=8: each "
                                          "worker of an expert group holds E / degree experts; choose a divisor of 8"),
    ({"train.expert_parallel_degree": 4, "ray.num_workers": 6},
     "ray.num_workers=6 is not a multiple of train.expert_parallel_degree=4: the workers form whole expert groups of 4 "
     "(each group holds every expert once); set ray.num_workers to a multiple of 4 (e.g. 4), or change the degree"),
    ({"train.expert_parallel_degree": 2, "train.context_parallel_degree": 2, "ray.num_workers": 6},
     "ray.num_workers=6 is not a multiple of train.expert_parallel_degree=2 x train.context_parallel_degree=2"),
    ({"model.tier": "nano", "train.expert_parallel_degree": 2, "ray.num_workers": 2},
     "train.expert_parallel_degree=2 splits experts, but model.tier=nano is dense; leave it at 1 or choose a -moe "
     "tier"),
    ({"train.expert_parallel_degree": 2, "ray.num_workers": 4, "ray.min_workers": 3},
     "ray.num_workers=3-4: an elastic range keeps whole expert groups (train.expert_parallel_degree=2), so MIN and "
     "MAX must be multiples of 2; write e.g. 2-4"),
    ({"train.expert_parallel_degree": 2, "train.context_parallel_degree": 2, "ray.num_workers": 8,
      "ray.min_workers": 2}, "ray.num_workers=2-8: an elastic range keeps whole expert groups "
                             "(train.expert_parallel_degree=2 x train.context_parallel_degree=2), so MIN and MAX must "
                             "be multiples of 4; write e.g. 4-8"),
])
def test_each_bad_combination_is_one_line_before_any_worker_starts(over, says):
    with pytest.raises(ConfigError) as err:
        load_config("test", {**MOE, **over})
    assert says in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_whole_expert_groups_are_the_elastic_counts_and_a_good_range_is_taken():
    from pipeline.config import elastic_worker_counts, worker_group

    cfg = load_config("test", {**MOE, "train.expert_parallel_degree": 2, "ray.num_workers": 8, "ray.min_workers": 4,
                               "train.grad_accum": 3})
    assert worker_group(cfg) == 2 and elastic_worker_counts(cfg) == [2, 4, 6, 8]  # whole expert groups only
    from pipeline.train.distributed.elastic import at_world_size

    assert at_world_size(cfg, 4).train.grad_accum == 6
    with pytest.raises(ValueError, match="train.expert_parallel_degree=2"):
        at_world_size(cfg, 5)


def test_no_ray_with_an_expert_degree_is_one_line_that_says_what_to_run():
    with pytest.raises(ConfigError) as err:
        load_config("test", {**MOE, "train.expert_parallel_degree": 2}, one_process=True)
    assert str(err.value) == ("train.expert_parallel_degree=2 splits the experts over 2 workers, and --no-ray trains "
                              "in one process; drop --no-ray and train on Ray with --ray.num_workers=2 (or a multiple "
                              "of it), or set train.expert_parallel_degree=1")
    assert load_config("test", {**MOE, "train.expert_parallel_degree": 2, "ray.num_workers": 2}) is not None


@pytest.mark.parametrize("flags, line", [
    (["--no-ray", "--train.expert_parallel_degree=2"],
     "error: train.expert_parallel_degree=2 splits the experts over 2 workers, and --no-ray trains in one process; "
     "drop --no-ray and train on Ray with --ray.num_workers=2 (or a multiple of it), or set "
     "train.expert_parallel_degree=1"),
    (["--train.expert_parallel_degree=2", "--ray.num_workers=3"],
     "error: ray.num_workers=3 is not a multiple of train.expert_parallel_degree=2: the workers form whole expert "
     "groups of 2"),
    (["--train.expert_parallel_degree=3", "--ray.num_workers=3"],
     "error: train.expert_parallel_degree=3 does not divide model.num_experts=8"),
])
def test_the_cli_refuses_each_bad_combination_in_one_line_before_a_run_starts(tmp_path, flags, line):
    from tests.pipeline.test_cli_checks import one_error_line, run_cli

    res = run_cli("train", "--preset", "test", "--model.tier=nano-moe", *flags, f"--run.root={tmp_path}")
    assert one_error_line(res).startswith(line), res.stderr
    assert not any(tmp_path.iterdir())  # refused: no run directory


def test_the_mesh_tag_and_the_resume_line_name_the_expert_degree(capfd):
    """MLflow params keep a run's first values: the tag longtrain.mesh names the expert degree, and after a resume at
    another one, the step since when and what it was (pipeline/train/ray_train.py _announce_parallel)."""
    from types import SimpleNamespace

    from pipeline.tracking.names import MESH_TAG
    from pipeline.train.ray_train import _announce_parallel
    from tests.pipeline.train.test_elastic import _stub_engine

    class Tags:
        def __init__(self):
            self.tags = {}

        def set_tags(self, tags):
            self.tags.update(tags)

    engine = _stub_engine(4, 1)
    engine.experts = SimpleNamespace(mesh=SimpleNamespace(degree=4))
    meta = {"world_size": 4, "layout": "sharded", "config": {"train": {"expert_parallel_degree": 2}}}
    tracker = Tags()
    _announce_parallel(engine, meta, tracker)
    assert tracker.tags[MESH_TAG] == ("4 worker(s), data 4 x context 1, experts split over expert 4 since step 3 "
                                      "(before: 4 worker(s), data 4 x context 1, expert 2)")
    assert "expert parallel degree 2 -> 4 (the checkpoint holds every expert whole)" in capfd.readouterr().out
    tracker = Tags()
    _announce_parallel(engine, {**meta, "config": {"train": {"expert_parallel_degree": 4}}}, tracker)
    assert tracker.tags[MESH_TAG] == "4 worker(s), data 4 x context 1, experts split over expert 4"


def test_the_engine_in_one_process_refuses_split_experts_and_evaluation_takes_them_whole():
    from pipeline.train.distributed.expert_parallel import ExpertParallelError
    from pipeline.train.engine import Engine

    cfg = load_config("test", {**MOE, "train.expert_parallel_degree": 2, "ray.num_workers": 2, "model.compile": "off"})
    with pytest.raises(ExpertParallelError, match=r"splits the experts over 2 workers, and this run has one process"):
        Engine(cfg, VOCAB, torch.device("cpu"))
    assert Engine(cfg, VOCAB, torch.device("cpu"), experts=1).experts is None  # evaluation: every expert here


# ------------------------------------------------------------------------------------------------- system
def cfg_for(**over):
    base = {**MOE, "data.seq_len": SEQ, "data.vocab_size": VOCAB, "train.batch_size": 2, "train.max_steps": STEPS,
            "train.warmup_steps": 2, "train.log_every": 1, "train.checkpoint_every": SAVE_AT, "train.grad_clip": 0.5,
            "model.compile": "off", "train.sample_tokens": 0,
            "tracking.enabled": False}
    return load_config("test", {**base, **over})


def train(rank: int, world: int, dataset: str, name: str, over: dict, *, parallel: str = "ddp",
          load: str | None = None, save_to: str | None = None, evaluate: bool = False) -> dict:
    """STEPS steps with the loop every launcher uses, each data rank reading its rows as Ray Train's workers do; the
    losses and the final whole weights (gathered: Engine.full_model, written to <dataset>/../<name>.safetensors)."""
    from safetensors.torch import save_file

    from pipeline.data.shards import ShardReader, eval_reader
    from pipeline.train.engine import Engine
    from pipeline.train.loop import Hooks, fit

    if evaluate:  # an evaluation before every step's checkpoint hook (FSDP keeps the experts gathered after it)
        over = {**over, "train.eval_every": 1, "train.eval_batches": 1}
    cfg = cfg_for(**over, **({"ray.num_workers": world} if world > 1 else {}))
    engine = Engine(cfg, VOCAB, torch.device("cpu"), rank=rank, world_size=world,
                    parallel=parallel if world > 1 else "none")
    if load:
        engine.load(load)
    losses: list[float] = []
    norms: list[float] = []

    def on_checkpoint(e, metrics) -> None:
        if save_to and e.step == SAVE_AT:
            e.save(save_to, extra={"dataset_dir": dataset})

    t, dr, dw = cfg.train, engine.mesh.data_rank, engine.data_world_size
    fit(engine, lambda epoch, start: ShardReader(dataset, "train", t.batch_size, seed=t.seed, epoch=epoch, start=start,
                                                 rank=dr, world_size=dw),
        (lambda: eval_reader(dataset, t.batch_size, dr, dw)) if evaluate else None,
        Hooks(on_log=lambda e, m: (losses.append(m["train/loss"]), norms.append(m["train/grad_norm"])),
              on_checkpoint=on_checkpoint), progress=False)
    with engine.full_model() as decoder:
        sd = {k: v.detach().clone().contiguous() for k, v in sorted(decoder.named_parameters())}
    if rank == 0:
        save_file(sd, str(Path(dataset).parent / f"{name}.safetensors"))
    held = [int(p.shape[0]) for p in (engine.experts.params.values() if engine.experts else [])]  # the block
    stored = [int((p.to_local() if hasattr(p, "to_local") else p).shape[0])  # what this rank stores of it
              for p in (engine.experts.params.values() if engine.experts else [])]
    return {"losses": losses, "grad_norms": norms, "parallel": engine.parallel, "held": held[:1], "stored": stored[:1],
            "cursor": engine.cursor,
            "expert_rank": engine.experts.mesh.expert_rank if engine.experts else 0}


RESONANCE = {"model.mixer": "resonance", "model.tie_embeddings": False}


def four_workers(rank: int, world: int, dataset: str, tmp: str) -> dict:
    from tests.pipeline.train.expert_cases import run

    ep = "train.expert_parallel_degree"
    out = {"model": run(rank, world)}
    out["ep1"] = train(rank, world, dataset, "ep1", {})
    out["ep2"] = train(rank, world, dataset, "ep2", {ep: 2}, save_to=f"{tmp}/ep2")
    out["ep4"] = train(rank, world, dataset, "ep4", {ep: 4})
    out["ep2_fsdp"] = train(rank, world, dataset, "ep2_fsdp", {ep: 2}, parallel="fsdp", save_to=f"{tmp}/ep2_fsdp",
                            evaluate=True)
    out["ep2_checkpointed"] = train(rank, world, dataset, "ep2_checkpointed",
                                    {ep: 2, "model.activation_checkpointing": "all"})
    out["ep2_compiled"] = train(rank, world, dataset, "ep2_compiled", {ep: 2, "model.compile": "on"})
    # a capacity (each rank drops by its own tokens, so the reference is degree 1 on the same 4 ranks) and the
    # selection bias (moved by the global load), 3 steps each
    cap, bias = {"model.moe_capacity_factor": 1.0, "train.max_steps": 3}, {"model.moe_balance": "bias",
                                                                          "train.max_steps": 3}
    out["capacity_ep1"] = train(rank, world, dataset, "capacity_ep1", cap)
    out["capacity_ep2"] = train(rank, world, dataset, "capacity_ep2", {**cap, ep: 2})
    out["bias_ep1"] = train(rank, world, dataset, "bias_ep1", bias)
    out["bias_ep2_fsdp"] = train(rank, world, dataset, "bias_ep2_fsdp", {**bias, ep: 2}, parallel="fsdp")
    out["ep4_fsdp"] = train(rank, world, dataset, "ep4_fsdp", {ep: 4}, parallel="fsdp")
    out["ep2_cp2"] = train(rank, world, dataset, "ep2_cp2", {ep: 2, "train.context_parallel_degree": 2,
                                                              "train.batch_size": 4}, parallel="fsdp")
    out["resonance_ep1"] = train(rank, world, dataset, "resonance_ep1", RESONANCE)
    out["resonance_ep2_fsdp"] = train(rank, world, dataset, "resonance_ep2_fsdp", {**RESONANCE, ep: 2},
                                      parallel="fsdp")
    out["resonance_ep4"] = train(rank, world, dataset, "resonance_ep4", {**RESONANCE, ep: 4})
    out["ep2_to_ep4"] = train(rank, world, dataset, "ep2_to_ep4", {ep: 4}, load=f"{tmp}/ep2")
    out["ep2_to_ep4_fsdp"] = train(rank, world, dataset, "ep2_to_ep4_fsdp", {ep: 4}, parallel="fsdp",
                                   load=f"{tmp}/ep2")
    out["ep2_fsdp_to_ep4"] = train(rank, world, dataset, "ep2_fsdp_to_ep4", {ep: 4}, load=f"{tmp}/ep2_fsdp")
    out["one_to_ep2"] = train(rank, world, dataset, "one_to_ep2", {ep: 2}, load=f"{tmp}/one")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from pipeline.data.synthetic import write_synthetic_dataset
    from pipeline.train.distributed.process_group import run_workers

    tmp = tmp_path_factory.mktemp("experts")
    ds = str(tmp / "ds")
    write_synthetic_dataset(ds, n_train=160, n_val=16, seq_len=SEQ, vocab_size=VOCAB, seed=3, rows_per_shard=48)
    out = {"tmp": tmp, "one": train(0, 1, ds, "one", {"train.batch_size": 8}, save_to=f"{tmp}/one"),
           "resonance_one": train(0, 1, ds, "resonance_one", {**RESONANCE, "train.batch_size": 8})}
    out["four"] = run_workers(four_workers, 4, ds, str(tmp), timeout_s=300)
    out["ep2_to_one"] = train(0, 1, ds, "ep2_to_one", {"train.batch_size": 8}, load=f"{tmp}/ep2")
    return out


def same_weights(runs, got: str, want: str) -> None:
    from safetensors.torch import load_file

    want_sd = load_file(str(runs["tmp"] / f"{want}.safetensors"))
    got_sd = load_file(str(runs["tmp"] / f"{got}.safetensors"))
    assert got_sd.keys() == want_sd.keys()
    for name, tensor in got_sd.items():
        torch.testing.assert_close(tensor, want_sd[name], **WEIGHT_TOL, msg=lambda m: f"{got} vs {want}, {name}: {m}")


@pytest.mark.system
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("case", [f"{m} ep{d}" for m in ("attention", "resonance") for d in (2, 4)])
def test_the_split_model_equals_the_model_with_every_expert(runs, case):
    """fp64: each rank's experts' gradients and every other gradient (averaged over the ranks) equal one process's
    over every rank's rows (module docstring)."""
    for r in runs["four"]:
        got = r["model"][case]
        assert got["loss_err"] <= 1e-13 and got["grad_err"] <= 1e-12 and got["expert_grad_err"] <= 1e-12, got
        assert got["grad_scale"] > 1 and got["experts_held"] == 8 // int(case[-1])


@pytest.mark.system
@pytest.mark.timeout(1800)
def test_the_engine_at_expert_degrees_1_2_4_trains_as_one_process(runs):
    """DDP and FSDP, expert 2 x context 2, both families: the same losses and whole weights as the one-process engine
    over the same global batch; each rank holds E / degree experts."""
    four = runs["four"][0]
    cases = {"ep1": ("one", "ddp", 8), "ep2": ("one", "ddp", 4), "ep4": ("one", "ddp", 2),
             "ep2_fsdp": ("one", "fsdp", 4), "ep2_checkpointed": ("one", "ddp", 4),
             "ep2_compiled": ("one", "ddp", 4), "ep4_fsdp": ("one", "fsdp", 2),
             "ep2_cp2": ("one", "fsdp", 4),
             "resonance_ep1": ("resonance_one", "ddp", 8), "resonance_ep2_fsdp": ("resonance_one", "fsdp", 4),
             "resonance_ep4": ("resonance_one", "ddp", 2)}
    for name, (want, parallel, held) in cases.items():
        got = four[name]
        assert got["parallel"] == parallel and len(got["losses"]) == STEPS, name
        assert got["losses"] == pytest.approx(runs[want]["losses"], **TOL), name
        # one norm over every expert wherever it lives, above train.grad_clip=0.5 at every step: clipped alike
        assert got["grad_norms"] == pytest.approx(runs[want]["grad_norms"], rel=1e-4), name
        assert min(got["grad_norms"]) > 0.5, name
        assert got["cursor"] == runs[want]["cursor"], name
        assert got["held"] == ([held] if held < 8 else []), name
        same_weights(runs, name, want)
    for name, want in (("capacity_ep2", "capacity_ep1"), ("bias_ep2_fsdp", "bias_ep1")):
        assert four[name]["losses"] == pytest.approx(four[want]["losses"], **TOL), name
        same_weights(runs, name, want)  # the selection bias is a buffer: not among the weights compared
    # FSDP shards each block of experts over the ranks holding it (ep2: 2 of them, 2 experts each; ep4: 1, whole)
    assert [four[n]["stored"] for n in ("ep2", "ep2_fsdp", "ep4_fsdp", "ep2_cp2")] == [[4], [2], [2], [2]]
    assert [r["ep2_cp2"]["expert_rank"] for r in runs["four"]] == [0, 0, 1, 1]  # a context group: one expert rank
    assert [r["ep4"]["expert_rank"] for r in runs["four"]] == [0, 1, 2, 3]


@pytest.mark.system
@pytest.mark.timeout(1800)
def test_a_checkpoint_is_not_split_by_experts(runs):
    """Written at expert degree 2 on 4 workers, resumed at degree 4 (DDP, FSDP) and at degree 1 in one process: the
    steps after it are those of the run that never stopped; a one-process checkpoint resumes at degree 2."""
    four = runs["four"][0]
    for name, got, was in (("ep2_to_ep4", four["ep2_to_ep4"], "ep2"),
                           ("ep2_to_ep4_fsdp", four["ep2_to_ep4_fsdp"], "ep2"),
                           ("ep2_fsdp_to_ep4", four["ep2_fsdp_to_ep4"], "ep2_fsdp"),
                           ("ep2_to_one", runs["ep2_to_one"], "ep2")):
        assert got["losses"] == pytest.approx(four[was]["losses"][SAVE_AT:], **TOL), name
        same_weights(runs, name, was)
    got = runs["four"][0]["one_to_ep2"]
    assert got["losses"] == pytest.approx(runs["one"]["losses"][SAVE_AT:], **TOL)
    same_weights(runs, "one_to_ep2", "one")



def leaves_after_step_1(rank: int, world: int, dataset: str, rank0_done: str) -> dict:
    """Rank 1 leaves the loop after step 1 and stays alive until rank 0 has ended (tests/pipeline/train/
    test_collectives.py leaves_early, with split experts): rank 0's next step meets collectives nobody joins."""
    import os
    import time

    from pipeline.train.distributed.collectives import CollectiveTimeoutError
    from tests.pipeline.train.test_collectives import _fit, _Left

    def leave(engine, outcome, micro) -> None:
        if rank == 1 and engine.step == 1:
            raise _Left

    over = {**MOE, "train.expert_parallel_degree": 2, "ray.num_workers": 2, "train.max_steps": 4,
            "train.collective_timeout_s": HANG_TIMEOUT_S}
    error = None
    try:
        _fit(rank, world, dataset, over, "ddp", on_step=leave)
    except CollectiveTimeoutError as exc:
        error = str(exc)
    except _Left:
        pass
    finally:
        if rank == 0:
            Path(rank0_done).touch()
    if rank == 1:
        while not os.path.exists(rank0_done):
            time.sleep(0.05)
    return {"error": error}


def exchange_nobody_joins(rank: int, world: int) -> dict:
    """The expert group alone under a short timeout (the world's is 600 s): rank 1 does not join rank 0's exchange."""
    import time

    from pipeline.train.distributed.expert_parallel import ExpertMesh, ExpertSplit

    split = ExpertSplit(ExpertMesh.build(2, 1, "cpu", HANG_TIMEOUT_S), 4)
    start, error = time.monotonic(), None
    if rank == 0:
        try:
            split.exchange(torch.randn(3, 8), torch.tensor([1, 1, 1, 0]))
        except RuntimeError as exc:
            error = str(exc)
    else:
        time.sleep(2 * HANG_TIMEOUT_S)
    return {"error": error, "seconds": time.monotonic() - start}


HANG_TIMEOUT_S = 3.0


@pytest.mark.system
def test_an_exchange_nobody_joins_ends_in_seconds_and_in_one_line_naming_the_rank_and_the_step(tmp_path):
    """The expert groups are made with train.collective_timeout_s (the process group's own is 600 s here): an
    exchange nobody joins fails at that timeout; and in the training loop, a rank that stops joining ends the other
    in collectives.py's one line."""
    from pipeline.data.synthetic import write_synthetic_dataset
    from pipeline.train.distributed.process_group import run_workers

    r0, r1 = run_workers(exchange_nobody_joins, 2, timeout_s=600)
    assert r1["error"] is None and "Timed out" in r0["error"] and r0["seconds"] < 30, r0
    ds = str(tmp_path / "ds")
    write_synthetic_dataset(ds, n_train=64, n_val=16, seq_len=64, vocab_size=512, seed=5, rows_per_shard=48)
    r0, r1 = run_workers(leaves_after_step_1, 2, ds, str(tmp_path / "rank0_done"), timeout_s=HANG_TIMEOUT_S)
    line = r0["error"]
    assert r1["error"] is None and line is not None and "\n" not in line
    assert line.startswith("rank 0 of 2: step 2: ") and f"did not complete within {HANG_TIMEOUT_S:g} s" in line, line
