"""Mixture-of-experts models in the training engine (pipeline/train/moe_balance.py hooked into engine.py): both
families train on CPU, the moe/* metrics are logged, the balancing loss reaches the loss, the selection bias moves
against each step's load and is saved and resumed with the checkpoint, and the MoE config fields are checked with
one line each.

    .venv/bin/python -m pytest tests/pipeline/train/test_moe_training.py -q
"""
from __future__ import annotations

import math

import pytest
import torch

from model.moe import moe_layers
from model.moe_routing import update_selection_bias
from pipeline.config import ConfigError, load_config, model_tier
from pipeline.tracking.names import (MOE_AUX_LOSS, MOE_BIAS_ABS_MAX, MOE_DROPPED, MOE_LOAD_MAX, MOE_LOAD_MIN,
                                     MOE_Z_LOSS, moe_layer_metric)

VOCAB = 256


def _batches(n: int, seed: int = 0) -> list[list[dict]]:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, VOCAB, (4, 33), generator=g)
    doc = torch.zeros(4, 33, dtype=torch.int32)
    doc[:, 17:] = 1
    return [[{"tokens": rows, "doc_ids": doc}] for _ in range(n)]  # one batch again and again: the loss must fall


def _engine(**over):
    from pipeline.train.engine import Engine

    cfg = load_config("test", {"model.tier": "nano-moe", "data.seq_len": 32, "model.compile": "off",
                               "train.lr": 1e-2, "train.warmup_steps": 1, **over})
    return Engine(cfg, vocab_size=VOCAB)


@pytest.mark.system  # docs/tests.md: over ~5 s (two engines train)
@pytest.mark.parametrize("mixer", ["attention", "resonance"])
def test_both_families_train_with_experts_and_log_their_load(mixer):
    engine = _engine(**{"model.mixer": mixer, "model.moe_z_weight": 1e-3})
    first = None
    for i, micro in enumerate(_batches(12)):
        engine.train_step(micro)
        if i == 0:
            first = engine.pull_train_metrics()
    last = engine.pull_train_metrics()
    assert last["train/loss"] < first["train/loss"] - 0.5, (first["train/loss"], last["train/loss"])
    for m in (first, last):
        assert 1.0 <= m[MOE_LOAD_MAX] < 8.0 and 0.0 <= m[MOE_LOAD_MIN] <= 1.0 and m[MOE_DROPPED] == 0.0
        assert m[MOE_AUX_LOSS] >= 1.0 - 1e-6 and m[MOE_Z_LOSS] > 0  # 1 is a perfect balance, and its minimum
        for block in (0, 1):
            assert 0 < m[moe_layer_metric(block, "entropy")] <= math.log(8) + 1e-6
    assert len(engine.moe.history) == 2 and all(abs(sum(f) - 1) < 1e-9 for f in engine.moe.history[-1][1])


@pytest.mark.system  # docs/tests.md: over ~5 s
def test_the_balancing_loss_is_part_of_the_step_loss():
    """With moe_aux_weight the router gets the balancing loss' gradient too: a different router after one step."""
    routers = []
    for weight in (0.0, 1.0):
        engine = _engine(**{"model.moe_aux_weight": weight})
        engine.train_step(_batches(1)[0])
        routers.append(torch.cat([layer.router.weight.detach().flatten() for layer in moe_layers(engine.module)]))
    assert not torch.allclose(routers[0], routers[1])


@pytest.mark.system  # docs/tests.md: over ~5 s
def test_selection_bias_follows_the_step_load_and_resumes(tmp_path):
    """After one step of two micro-batches each layer's bias (from 0) is rate x sign(mean load - load), with the load
    counted over both micro-batches (the engine's interval counts, one step's worth here)."""
    engine = _engine(**{"model.moe_balance": "bias", "model.moe_bias_rate": 0.01, "train.grad_accum": 2})
    layers = moe_layers(engine.module)
    assert all(float(layer.expert_bias.abs().max()) == 0 for layer in layers)
    engine.train_step(_batches(1)[0] + _batches(1, seed=1)[0])
    loads = engine.moe._load.float()  # (layers, E) assignments of the step, before the pull resets them
    assert float(loads.sum()) == 2 * 2 * 4 * 32 * 2  # layers x micro-batches x rows x tokens x k
    for load, layer in zip(loads, layers):
        want = torch.zeros(8)
        update_selection_bias(want, load, 0.01)
        assert torch.equal(layer.expert_bias, want)
        assert float(layer.expert_bias[load.argmax()]) < 0 < float(layer.expert_bias[load.argmin()])
    m = engine.pull_train_metrics()
    assert m[MOE_BIAS_ABS_MAX] == pytest.approx(0.01) and m[MOE_AUX_LOSS] > 0  # measured, not trained on
    engine.save(tmp_path / "ckpt")
    again = _engine(**{"model.moe_balance": "bias", "model.moe_bias_rate": 0.01, "train.grad_accum": 2})
    again.load(tmp_path / "ckpt")
    for a, b in zip(moe_layers(again.module), layers):
        assert torch.equal(a.expert_bias, b.expert_bias)


@pytest.mark.system  # docs/tests.md: over ~5 s
def test_capacity_drops_are_counted_and_taken_out_of_the_executed_flops():
    dropless = _engine()
    capped = _engine(**{"model.moe_capacity_factor": 1.0})
    with torch.no_grad():  # skew both routers the same way: expert 0 overflows
        for engine in (dropless, capped):
            for layer in moe_layers(engine.module):
                layer.router.weight[0] += 0.5
    out = []
    for engine in (dropless, capped):
        engine.train_step(_batches(1)[0])
        out.append(engine.pull_train_metrics())
    assert out[0][MOE_DROPPED] == 0.0 < out[1][MOE_DROPPED]
    assert out[1]["train/executed_flops_per_token"] < out[0]["train/executed_flops_per_token"]


@pytest.mark.parametrize("over,line", [
    ({"model.tier": "nano", "model.experts_per_token": 2}, "model.experts_per_token is set, but model.tier=nano has "
                                                            "no experts"),
    ({"model.tier": "nano-moe", "model.experts_per_token": 9}, "model.experts_per_token=9 is invalid; it must be in "
                                                                "1..8"),
    ({"model.tier": "nano-moe", "model.expert_ffn": 100}, "model.expert_ffn=100 is invalid; it must be a positive "
                                                           "multiple of 8"),
    ({"model.tier": "nano-moe", "model.num_experts": 1}, "model.num_experts=1 is invalid"),
    ({"model.tier": "nano-moe", "model.dense_first_layers": 2}, "model.dense_first_layers=2 leaves no MoE layer"),
    ({"model.tier": "nano-moe", "model.moe_balance": "loss"}, "model.moe_balance='loss' is not allowed; choose one "
                                                               "of: aux, bias"),
    ({"model.tier": "nano-moe", "model.moe_capacity_factor": 0.5}, "model.moe_capacity_factor=0.5 is invalid"),
    ({"model.tier": "nano-moe", "model.moe_aux_weight": -1}, "model.moe_aux_weight=-1.0 is invalid; it must be >= 0"),
    ({"model.tier": "nano-moe", "model.shared_experts": -2}, "model.shared_experts=-2 is invalid"),
    ({"model.tier": "nano-moe", "train.expert_parallel_degree": 3}, "train.expert_parallel_degree=3 does not divide "
                                                                     "model.num_experts=8"),
    ({"model.tier": "nano-moe", "train.expert_parallel_degree": 2, "ray.num_workers": 3},
     "ray.num_workers=3 is not a multiple of train.expert_parallel_degree=2: the workers form whole expert groups"),
    ({"model.tier": "nano", "train.expert_parallel_degree": 2}, "train.expert_parallel_degree=2 splits experts, but "
                                                                 "model.tier=nano is dense"),
])
def test_moe_settings_are_checked_with_one_line(over, line):
    with pytest.raises(ConfigError) as exc:
        load_config("test", over)
    assert line in str(exc.value) and "\n" not in str(exc.value)


def test_settings_resolve_to_the_tier_the_model_is_built_from():
    cfg = load_config("test", {"model.tier": "nano", "model.num_experts": 4, "model.shared_experts": 1,
                               "model.moe_balance": "bias"})
    spec = model_tier(cfg).moe
    assert (spec.num_experts, spec.experts_per_token, spec.expert_ffn, spec.shared_experts) == (4, 2, 96, 1)
    assert spec.selection_bias and model_tier(load_config("test", {"model.tier": "nano-moe",
                                                                   "model.num_experts": 0})).moe is None


@pytest.mark.system  # docs/tests.md: over ~5 s
def test_a_checkpoint_of_another_expert_shape_is_refused_in_one_line(tmp_path):
    from pipeline.train.checkpoints.state import CheckpointError

    _engine().save(tmp_path / "ckpt")
    for over, line in (({"model.experts_per_token": 3}, "has model.experts_per_token=2 but this run has 3"),
                       ({"model.moe_balance": "bias"}, "balanced its experts with model.moe_balance=aux"),
                       ({"model.num_experts": 0}, "is a mixture of 8 experts")):
        with pytest.raises(CheckpointError) as exc:
            _engine(**over).load(tmp_path / "ckpt")
        assert line in str(exc.value) and "\n" not in str(exc.value)


def _two_rank_worker(rank: int, world: int, parallel: str) -> dict:
    from pipeline.train.engine import Engine

    cfg = load_config("test", {"model.tier": "nano-moe", "data.seq_len": 32, "model.compile": "off",
                               "model.moe_balance": "bias", "model.moe_bias_rate": 0.01, "train.parallel": parallel})
    engine = Engine(cfg, vocab_size=VOCAB, device=torch.device("cpu"), rank=rank, world_size=world)
    engine.train_step(_batches(1, seed=rank)[0])  # each rank its own rows
    load = engine.moe._load.tolist()
    m = engine.pull_train_metrics()
    return {"load": load, "bias": [layer.expert_bias.tolist() for layer in moe_layers(engine.module)],
            "aux": m[MOE_AUX_LOSS]}


@pytest.mark.system  # starts 2 processes
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_workers_balance_over_the_global_batch(parallel):
    """Under DDP and FSDP on 2 gloo ranks with different rows: the load counts are every rank's (all-reduced), so
    both ranks move the selection bias the same way and log the same balance."""
    from pipeline.train.distributed.process_group import run_workers

    r0, r1 = run_workers(_two_rank_worker, 2, parallel, timeout_s=120)
    assert r0["load"] == r1["load"] and r0["bias"] == r1["bias"] and r0["aux"] == pytest.approx(r1["aux"])
    for layer_load in r0["load"]:
        assert sum(layer_load) == 2 * 4 * 32 * 2  # ranks x rows x tokens x k: both ranks' tokens
    for load, bias in zip(r0["load"], r0["bias"]):
        want = torch.zeros(8)
        update_selection_bias(want, torch.tensor(load), 0.01)
        assert torch.equal(torch.tensor(bias), want)
