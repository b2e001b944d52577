"""Context parallelism (train.context_parallel_degree): one row split over the ranks of a context group, for both model
families, on CPU with gloo (pipeline/train/distributed/context_parallel.py, model/context.py).

    .venv/bin/python -m pytest -q tests/pipeline/train/test_context_parallel.py                  # all (system: ~3 min)
    .venv/bin/python -m pytest -q -m "not system" tests/pipeline/train/test_context_parallel.py  # the quick ones

Quick: the layouts partition a row, the balanced layout's (query, key) pairs per rank, each bad combination's one line.
System (they start gloo groups of 2 and 4 processes, one spawn each):
  - the model at cp = 1, 2, 4 against the one-process model, for attention (documents crossing the slice borders,
    GQA, no doc masking, checkpointed blocks) and resonance (the same, the mixer recomputed): tests/pipeline/train/
    context_cases.py. fp64: loss within 1e-13 and parameter gradients within 1e-12 absolute (gradients of ~400 at
    most: 3e-15 relative; summation order is all that differs). fp32: loss within 3e-5, gradients within 2e-4
    absolute (relative ~5e-7), no further from the fp64 reference than the unsplit fp32 model is (cp = 1 fp32 sets
    the scale: its own rounding);
  - the engine and the loop as launchers run them, FSDP over data x context: 8 steps at data 1 x context 2 (saved at
    step 4), data 2 x context 2 and data 1 x context 4 against the one-process engine with the same global batch;
    the checkpoint written at cp = 2 resumed at cp = 1 (one process) and at cp = 4 (four); fp32, losses rel 1e-5 as
    tests/pipeline/train/test_fsdp.py states for a change of worker count, weights 1e-4 absolute: AdamW moves a weight
    by up to lr = 3e-3 a step, and where a gradient is nearly zero its normalised step turns a change in the order of
    a sum into the largest difference (2.6e-5 on one of 12,288 weights after 8 steps at cp 2; the rest within 1e-5).
The Ray Train run (4 workers, data 2 x context 2, FSDP) is tests/pipeline/train/test_context_parallel_ray.py.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from model.context import layout_positions, pairs_per_rank
from pipeline.config import ConfigError, load_config

SEQ, VOCAB, STEPS, SAVE_AT = 64, 512, 8, 4
TOL = dict(rel=1e-5, abs=1e-6)  # losses, fp32
WEIGHT_TOL = dict(rtol=0, atol=1e-4)  # module docstring


# ------------------------------------------------------------------------------------------------- quick
@pytest.mark.parametrize("layout", ["contiguous", "balanced", "head_tail"])
@pytest.mark.parametrize("degree", [1, 2, 4, 8])
def test_every_layout_partitions_the_row_into_equal_slices(layout, degree):
    T = 64
    parts = [layout_positions(T, degree, r, layout) for r in range(degree)]
    assert all(len(p) == T // degree for p in parts)
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(T))
    if layout == "contiguous":
        assert all(torch.equal(p, torch.arange(r * T // degree, (r + 1) * T // degree)) for r, p in enumerate(parts))


def web_like_row(T: int, seed: int) -> torch.Tensor:
    """(T,) document ids of a packed row of web-like documents: lengths log-normal around ~600 tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(T, generator=g) * 1.0 + 6.0).long().clamp(min=1)
    ids = torch.repeat_interleave(torch.arange(T), lengths)[:T]
    return ids - ids[0]


def test_the_balanced_layout_gives_every_rank_the_same_attention_work():
    """The (query, key) pairs each rank's attention computes under a causal document mask, for a 32,768-token row of
    51 web-like documents: the busiest rank over the idlest, minus 1, is 0.003 %, 0.14 % and 0.26 % in the balanced
    layout (a snake order over blocks of d tokens) at d = 2, 4 and 8; 31 %, 182 % and 386 % with head-tail (two chunks
    per rank, the layout that balances one causal document) and 65 %, 192 % and 534 % in contiguous slices. Asserted:
    within 0.5 %, and the other two at least 10x further apart. Also a row that is one document."""
    T = 32768
    docs = web_like_row(T, seed=0)
    for d in (2, 4, 8):
        spread = {}
        for layout in ("balanced", "head_tail", "contiguous"):
            pairs = pairs_per_rank(docs, T, d, layout)
            spread[layout] = max(pairs) / min(pairs) - 1
            assert sum(pairs) == sum(pairs_per_rank(docs, T, 1, "contiguous"))  # every pair counted once
        assert spread["balanced"] <= 5e-3, spread
        assert min(spread["head_tail"], spread["contiguous"]) > 10 * spread["balanced"], spread
        one_doc = pairs_per_rank(None, T, d, "balanced")
        assert max(one_doc) / min(one_doc) - 1 <= 5e-3


@pytest.mark.parametrize("over, says", [
    ({"train.context_parallel_degree": 2, "ray.num_workers": 3}, "ray.num_workers=3 is not a multiple of "
                                                                   "train.context_parallel_degree=2"),
    ({"train.context_parallel_degree": 4, "ray.num_workers": 4, "data.seq_len": 66}, "data.seq_len=66 does not split "
                                                                                       "into 4 equal slices"),
    ({"train.context_parallel_degree": 2, "ray.num_workers": "3-6"}, "an elastic range keeps whole context groups"),
    ({"train.context_parallel_degree": 2, "ray.num_workers": 2, "model.attention": "varlen"},
     "model.attention=varlen cannot attend across a row split over workers"),
    ({"train.context_parallel_degree": 0}, "train.context_parallel_degree=0 is invalid"),
    ({"data.seq_len": 8192}, "a longer row splits over workers with train.context_parallel_degree"),
])
def test_each_bad_combination_is_one_line_before_any_worker_starts(over, says):
    """Refused where the config is built (the CLI, a preset, a sweep's trial, Ray Train's driver): before any worker
    starts, one line naming the settings and the fix."""
    with pytest.raises(ConfigError) as err:
        load_config("cpu", over)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_split_row_in_one_process_is_one_line():
    """`train --no-ray` (one process) with a degree > 1: the engine says so before training."""
    from pipeline.train.distributed.context_parallel import ContextParallelError
    from pipeline.train.engine import Engine

    cfg = load_config("test", {"train.context_parallel_degree": 2, "ray.num_workers": 2, "model.compile": "off"})
    with pytest.raises(ContextParallelError, match=r"splits each row over 2 workers, and this run has one process; "
                                                   r"train under Ray Train") as err:
        Engine(cfg, VOCAB, torch.device("cpu"))
    assert "\n" not in str(err.value)
    assert Engine(cfg, VOCAB, torch.device("cpu"), context=1).mesh.degree == 1  # evaluation: whole rows here


# ------------------------------------------------------------------------------------------------- system
def cfg_for(**over):
    base = {"model.tier": "nano", "data.seq_len": SEQ, "data.vocab_size": VOCAB, "train.batch_size": 4,
            "train.max_steps": STEPS, "train.warmup_steps": 2, "train.log_every": 1, "model.compile": "off",
            "train.sample_tokens": 0, "tracking.enabled": False}
    return load_config("test", {**base, **over})


def train(rank: int, world: int, dataset: str, name: str, over: dict, *, load: str | None = None,
          save_to: str | None = None) -> dict:
    """STEPS steps with the loop every launcher uses, reading as Ray Train's workers read (each context group its
    data rank's rows); the losses, the final weights' digest (written to <dataset>/../<name>.safetensors) and the
    validation loss and loss by position under the same degree."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from pipeline.data.shards import ShardReader, eval_reader
    from pipeline.eval.positions import evaluate_by_position
    from pipeline.train.engine import Engine
    from pipeline.train.loop import Hooks, fit

    cfg = cfg_for(**over, **({"ray.num_workers": world} if world > 1 else {}))
    parallel = "fsdp" if world > 1 else "none"
    engine = Engine(cfg, VOCAB, torch.device("cpu"), rank=rank, world_size=world, parallel=parallel)
    if load:
        engine.load(load)
    losses: list[float] = []

    def on_checkpoint(e, metrics) -> None:
        if save_to and e.step == SAVE_AT:
            e.save(save_to, extra={"dataset_dir": dataset})

    t, dr, dw = cfg.train, engine.mesh.data_rank, engine.data_world_size
    fit(engine, lambda epoch, start: ShardReader(dataset, "train", t.batch_size, seed=t.seed, epoch=epoch, start=start,
                                                 rank=dr, world_size=dw),
        None, Hooks(on_log=lambda e, m: losses.append(m["train/loss"]), on_checkpoint=on_checkpoint), progress=False)
    sd = {k: v.detach().contiguous() for k, v in sorted(
        get_model_state_dict(engine.module, options=StateDictOptions(full_state_dict=True)).items())}
    if rank == 0:
        save_file(sd, str(Path(dataset).parent / f"{name}.safetensors"))
    val = engine.evaluate(eval_reader(dataset, 4, dr, dw))
    by_position = evaluate_by_position(engine, eval_reader(dataset, 4, dr, dw), SEQ).metrics("val")
    return {"losses": losses, "digest": hashlib.sha256(b"".join(v.numpy().tobytes() for v in sd.values())).hexdigest(),
            "val_loss": val["val/loss"], "by_position": by_position, "parallel": engine.parallel,
            "mesh": [engine.mesh.degree, engine.mesh.data_rank, engine.data_world_size], "cursor": engine.cursor}


RESONANCE = {"model.mixer": "resonance", "model.tie_embeddings": False}


def two_workers(rank: int, world: int, dataset: str, tmp: str) -> dict:
    """Data 1 x context 2, saved at SAVE_AT (sharded: FSDP over the two)."""
    return {"cp2": train(rank, world, dataset, "cp2", {"train.context_parallel_degree": 2}, save_to=f"{tmp}/cp2")}


def four_workers(rank: int, world: int, dataset: str, tmp: str) -> dict:
    """The model-level equality cases, then the engine at data 2 x context 2 and data 1 x context 4 (attention and
    resonance), and the cp = 2 checkpoint resumed at cp = 4."""
    from tests.pipeline.train.context_cases import run

    out = {"model": run(rank, world)}
    out["dp2_cp2"] = train(rank, world, dataset, "dp2_cp2", {"train.context_parallel_degree": 2,
                                                              "train.batch_size": 2})
    out["cp4"] = train(rank, world, dataset, "cp4", {"train.context_parallel_degree": 4})
    out["cp2_to_cp4"] = train(rank, world, dataset, "cp2_to_cp4", {"train.context_parallel_degree": 4},
                              load=f"{tmp}/cp2")
    out["resonance_cp4"] = train(rank, world, dataset, "resonance_cp4", {**RESONANCE, "train.context_parallel_degree": 4})
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from pipeline.data.synthetic import write_synthetic_dataset
    from pipeline.train.distributed.process_group import run_workers

    tmp = tmp_path_factory.mktemp("context")
    ds = str(tmp / "ds")
    write_synthetic_dataset(ds, n_train=160, n_val=16, seq_len=SEQ, vocab_size=VOCAB, seed=3, rows_per_shard=48)
    out = {"tmp": tmp, "one": train(0, 1, ds, "one", {}),
           "resonance_one": train(0, 1, ds, "resonance_one", RESONANCE),
           "two": run_workers(two_workers, 2, ds, str(tmp))}
    out["cp2_to_cp1"] = train(0, 1, ds, "cp2_to_cp1", {}, load=f"{tmp}/cp2")
    out["four"] = run_workers(four_workers, 4, ds, str(tmp))
    return out


def same_weights(runs, got: str, want: str) -> None:
    from safetensors.torch import load_file

    want_sd = load_file(str(runs["tmp"] / f"{want}.safetensors"))
    for name, tensor in load_file(str(runs["tmp"] / f"{got}.safetensors")).items():
        torch.testing.assert_close(tensor, want_sd[name], **WEIGHT_TOL, msg=lambda m: f"{got} vs {want}, {name}: {m}")


def model_cases() -> list[str]:
    from tests.pipeline.train.context_cases import CASES

    return [f"{mixer} cp{d} {kind}" for mixer in ("attention", "resonance") for d, kinds in CASES.items()
            for kind in kinds]


@pytest.mark.system
@pytest.mark.timeout(1800)  # the module's set-up: two spawns of 2 and 4 processes (~3 min on 2 idle cores)
@pytest.mark.parametrize("case", model_cases())
def test_the_split_model_equals_the_whole_row_model(runs, case):
    """Every rank of every group got the same sums: fp64 exact up to summation order, fp32 within its own rounding
    (module docstring)."""
    per_rank = [r["model"][case] for r in runs["four"]]
    got = per_rank[0]
    assert all(r == got for r in per_rank)
    if case.endswith("fp32"):
        unsplit = runs["four"][0]["model"][case.replace(case.split()[1], "cp1")]
        assert got["loss_err"] <= 3e-5 and got["grad_err"] <= 2e-4, got
        assert got["grad_err"] <= 2 * unsplit["grad_err"] + 1e-6, (got, unsplit)
    else:
        assert got["loss_err"] <= 1e-13 and got["grad_err"] <= 1e-12, got
    assert got["grad_scale"] > 1  # the gradients compared are not all zero


@pytest.mark.system
@pytest.mark.timeout(1800)
def test_the_engine_at_data_x_context_trains_as_one_process(runs):
    """FSDP over data x context: data 1 x context 2, data 2 x context 2 and data 1 x context 4 take the same 8 steps
    over the same rows as the one-process engine (4 rows per step), for attention and resonance; validation loss and
    loss by position under the same degree equal the one-process ones; the cursor counts rows, not workers."""
    one = runs["one"]
    cp2 = runs["two"][0]["cp2"]
    four = runs["four"][0]
    for name, got in (("cp2", cp2), ("dp2_cp2", four["dp2_cp2"]), ("cp4", four["cp4"])):
        assert got["parallel"] == "fsdp" and len(got["losses"]) == STEPS, name
        assert got["losses"] == pytest.approx(one["losses"], **TOL), name
        assert got["val_loss"] == pytest.approx(one["val_loss"], **TOL), name
        assert got["by_position"] == pytest.approx(one["by_position"], **TOL), name
        assert got["cursor"] == one["cursor"], name
        same_weights(runs, name, "one")
    assert [r["dp2_cp2"]["mesh"] for r in runs["four"]] == [[2, 0, 2], [2, 0, 2], [2, 1, 2], [2, 1, 2]]
    res = four["resonance_cp4"]
    assert res["losses"] == pytest.approx(runs["resonance_one"]["losses"], **TOL)
    assert res["val_loss"] == pytest.approx(runs["resonance_one"]["val_loss"], **TOL)
    same_weights(runs, "resonance_cp4", "resonance_one")


@pytest.mark.system
@pytest.mark.timeout(1800)
def test_a_checkpoint_written_at_cp2_resumes_at_cp1_and_cp4(runs):
    """The model state is not split by context: the shards two workers wrote at data 1 x context 2 load in one
    process (cp = 1) and on four workers (cp = 4), and steps 5-8 are those of the run that never stopped."""
    cp2 = runs["two"][0]["cp2"]
    for name, got in (("cp2_to_cp1", runs["cp2_to_cp1"]), ("cp2_to_cp4", runs["four"][0]["cp2_to_cp4"])):
        assert got["losses"] == pytest.approx(cp2["losses"][SAVE_AT:], **TOL), name
        same_weights(runs, name, "cp2")
