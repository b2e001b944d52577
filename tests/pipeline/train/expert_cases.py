"""The expert-parallel equality cases at the model level, run in the worker processes of
tests/pipeline/train/test_expert_parallel.py (a gloo group of 4 on CPU).

Each rank builds the same nano-moe decoder (same seed), keeps its block of experts (ExpertParallel.split, what the
engine does) and runs its own two rows; the loss is sum(hidden * target) over its rows. The gradients are reduced as
the engine reduces them: every other parameter's summed over the world and divided by it (DDP's mean), the experts'
by ExpertParallel.reduce_gradients. The reference is one process, every expert here, every rank's rows: the mean of
the ranks' losses. fp64: equal to summation order. Returns the largest differences, as JSON.
"""
from __future__ import annotations

import torch

T, VOCAB = 16, 64


def _rows(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(0, VOCAB, (2, T), generator=g), torch.randn(2, T, 64, generator=g, dtype=torch.float64)


def _build(mixer: str):
    from model.decoder import build_model
    from model.tiers import get_mixer_tier

    torch.manual_seed(0)
    return build_model(get_mixer_tier("nano-moe", mixer), VOCAB, mixer=mixer,
                       **({"attention": "dense"} if mixer == "attention" else {})).double()


def one_case(mixer: str, degree: int) -> dict:
    import torch.distributed as dist

    from pipeline.train.distributed.expert_parallel import ExpertMesh, ExpertParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    ref = _build(mixer)
    ref_loss = sum((ref(_rows(r)[0]) * _rows(r)[1]).sum() for r in range(world)) / world
    ref_loss.backward()
    model = _build(mixer)
    split = ExpertParallel.split(ExpertMesh.build(degree, 1, "cpu", 120), model)
    tokens, target = _rows(rank)
    loss = (model(tokens) * target).sum()
    loss.backward()
    split.reduce_gradients()
    total = loss.detach().reshape(1).clone()
    dist.all_reduce(total)
    ref_params = dict(ref.named_parameters())
    grad_err = expert_err = 0.0
    for name, p in model.named_parameters():
        want = ref_params[name].grad
        if name in split.params:
            expert_err = max(expert_err, float((p.grad - split.block(want)).abs().max()))
        else:
            g = p.grad.clone()
            dist.all_reduce(g)
            grad_err = max(grad_err, float((g / world - want).abs().max()))
    return {"loss_err": abs(float(total) / world - float(ref_loss.detach())), "grad_err": grad_err,
            "expert_grad_err": expert_err,
            "grad_scale": max(float(p.grad.abs().max()) for p in ref.parameters()),
            "experts_held": [int(p.shape[0]) for n, p in model.named_parameters() if n in split.params][0]}


def run(rank: int, world: int) -> dict:
    return {f"{mixer} ep{degree}": one_case(mixer, degree) for mixer in ("attention", "resonance") for degree in (2, 4)}
