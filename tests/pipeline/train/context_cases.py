"""The context-parallel equality cases, run in the worker processes of tests/pipeline/train/test_context_parallel.py
(pipeline/train/distributed/process_group.py run_workers: a gloo group of 4 on CPU).

Each rank builds the same model (same seed) and the same row, computes the whole row's loss and parameter gradients
itself (the reference: one process, no split), then the same through its context group: the whole row goes in, the
model returns this rank's tokens, the loss of those tokens is summed over the group and so are the gradients (what
DDP or FSDP do over the data x context ranks). Degree 4: all four ranks split one row; degree 2: ranks 0-1 and 2-3
are two groups, each splitting the row. Returns the largest differences, as JSON.
"""
from __future__ import annotations

import torch

from model.tiers import ResonanceTier, Tier

T = 48  # tokens per row: 12 per rank at degree 4
# GQA (4 query heads over 2 key/value heads) and a head_dim of 8; two layers so a gathered K/V feeds a second layer
ATTENTION = Tier("cp_tiny", d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=256)
RESONANCE = ResonanceTier("cp_tiny", d_model=32, n_layers=2, n_groups=2, n_eigen=4, d_ff=64, chunk_size=8,
                          max_seq_len=256)
# Documents cross every slice border of both layouts: starts at 0, 5, 11 (one before the degree-4 contiguous border
# 12), 12 (a border), 30, 31 (a one-token document), 40; row 1 has one document over the whole row.
DOC_STARTS = (0, 5, 11, 12, 30, 31, 40)


def row(vocab: int):
    g = torch.Generator().manual_seed(7)
    idx = torch.randint(0, vocab, (2, T), generator=g)
    starts = torch.zeros(2, T, dtype=torch.int32)
    starts[0, list(DOC_STARTS)] = 1
    doc_ids = torch.cumsum(starts, dim=1, dtype=torch.int32) - 1
    doc_ids[1] = 0
    return idx, doc_ids


def build(mixer: str, dtype: torch.dtype, **kw):
    from model.decoder import Decoder
    from model.resonance import ResonanceLM

    torch.manual_seed(0)
    model = (Decoder(ATTENTION, 64, attention="dense", **kw) if mixer == "attention"
             else ResonanceLM(RESONANCE, 64, **kw))
    return model.to(dtype)


def loss_of(hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A loss that weighs every token's every hidden unit differently: sum of hidden * target."""
    return (hidden * target).sum()


def one_case(mixer: str, dtype: torch.dtype, split, doc_masked: bool = True, ac: str = "none") -> dict:
    import torch.distributed as dist

    model = build(mixer, dtype, activation_checkpointing=ac)
    idx, doc_ids = row(64)
    doc = doc_ids if doc_masked else None
    target = torch.randn(2, T, model.tier.d_model, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ref_model = build(mixer, torch.float64, activation_checkpointing=ac)  # the reference: one process, fp64
    ref = loss_of(ref_model(idx, doc), target)
    ref.backward()
    out = loss_of(model(idx, doc, context=split), split.take(target).to(dtype))
    out.backward()
    loss = out.detach().double().reshape(1)
    grads = [p.grad.double() for p in model.parameters()]
    if split.degree > 1:  # the group's sum: what the data x context all-reduce (DDP) or reduce-scatter (FSDP) does
        dist.all_reduce(loss, group=split.group)
        for g in grads:
            dist.all_reduce(g, group=split.group)
    grad_err = max(float((g - r.grad).abs().max()) for g, r in zip(grads, ref_model.parameters()))
    grad_scale = max(float(r.grad.abs().max()) for r in ref_model.parameters())
    ref = float(ref.detach())
    return {"loss": float(loss), "ref_loss": ref, "loss_err": abs(float(loss) - ref),
            "grad_err": grad_err, "grad_scale": grad_scale}


# What runs at each degree (fp32 at cp 1 is the scale of fp32's own rounding)
CASES = {1: ("fp64", "fp32"), 2: ("fp64", "fp64 checkpointed"), 4: ("fp64", "fp32", "fp64 no doc masking")}


def run(rank: int, world: int) -> dict:
    from pipeline.train.distributed.context_parallel import ContextMesh

    meshes = {1: ContextMesh(1, rank, world), 2: ContextMesh.build(2, "cpu"), 4: ContextMesh.build(4, "cpu")}
    out = {}
    for mixer in ("attention", "resonance"):
        from model.decoder import Decoder
        from model.resonance import ResonanceLM

        layout = (Decoder if mixer == "attention" else ResonanceLM).CONTEXT_LAYOUT
        for degree, mesh in meshes.items():
            split = mesh.split(layout)
            for kind in CASES[degree]:
                out[f"{mixer} cp{degree} {kind}"] = one_case(
                    mixer, torch.float64 if kind.startswith("fp64") else torch.float32, split,
                    doc_masked=kind != "fp64 no doc masking",
                    ac=("mixer" if mixer == "resonance" else "all") if kind == "fp64 checkpointed" else "none")
    return out
