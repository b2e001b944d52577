"""How the training workers share one model: DDP or FSDP2 (`train.parallel = ddp | fsdp | auto`).

    mode, why = resolve_parallel(cfg, vocab_size, device)       # "none" | "ddp" | "fsdp", and the reason
    model = shard_model(loss_module, mode, device, amp_dtype)   # what the engine calls forward on

none   one process (`--no-ray`, or one worker under DDP): the module itself, no process group needed.
ddp    every worker holds the whole model, gradients and AdamW state; gradients are all-reduced (averaged) after
       backward, in buckets that hold them for the whole run (gradient_as_bucket_view: no second copy).
fsdp   FSDP2 (`torch.distributed.fsdp.fully_shard`): each block is one FSDP unit, then the root (embedding, final
       norm, untied output weight). A worker keeps 1/N of the parameters, gradients and AdamW moments; a block's
       parameters are all-gathered just before it runs (the next one prefetched) and freed after, in forward and
       again in backward, and its gradients are reduce-scattered as soon as they are complete.
       Mixed precision (MixedPrecisionPolicy): the blocks' parameters are gathered and computed in bf16 on CUDA,
       their gradients reduced in fp32, and the sharded master weights and AdamW moments stay fp32. The block
       inputs are not cast (cast_forward_inputs=False) and the root stays fp32, so the residual stream and the
       fused cross-entropy head see exactly what they see under DDP with autocast (the engine keeps autocast on):
       only the norm weights are rounded to bf16 before use. A resonance block's mixer is its own unit with
       fp32 parameters: its eigenvalues are exponentiated over thousands of steps and need the mantissa.
       The fused cross-entropy head reads `decoder.output_weight` inside the root's forward, where FSDP has it
       unsharded; tied, the embedding and the head are the same unsharded parameter and their gradients add up
       before one reduce-scatter. Regional compile (each block compiled before it is sharded; FSDP's hooks stay
       outside the compiled graphs) and activation checkpointing (torch.utils.checkpoint around the sharded block:
       its parameters are gathered again for the recompute) compose with it.
auto   fsdp when a full copy with its gradients, AdamW state and the configured micro-batch's activations would not
       fit one worker's memory (pipeline/train/memory/plan.py's model against train.memory_limit_gib, else the
       device's memory, else the host's); ddp otherwise. Every worker decides from its own device and the
       workers then agree (FSDP if any one needs it).
"""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn

PARALLEL_MODES = ("none", "ddp", "fsdp")


def distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def device_memory_gib(cfg, device: torch.device) -> float:
    """The memory one worker may use: train.memory_limit_gib when set, else the device's, else the host's."""
    if cfg.train.memory_limit_gib > 0:
        return cfg.train.memory_limit_gib
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**30
    from pipeline.train.memory.hardware import host_available_gib

    return host_available_gib()


def resolve_parallel(cfg, vocab_size: int, device: torch.device, *, shape=None) -> tuple[str, str]:
    """(mode, why) for this worker from cfg.train.parallel and the process group (none without one). `shape`: cfg's
    memory-model Shape (pipeline/train/memory/plan.py) where the engine resolved it already."""
    if not distributed():
        why = "one process, no process group"
        if cfg.train.parallel == "fsdp":
            why += ": train.parallel=fsdp has no workers to shard across, training unsharded"
        return "none", why
    world = torch.distributed.get_world_size()
    if cfg.train.parallel == "fsdp":
        return "fsdp", "train.parallel=fsdp"
    if cfg.train.parallel == "ddp":
        return ("ddp" if world > 1 else "none"), "train.parallel=ddp"
    from pipeline.train.memory.plan import choose_parallel

    mode, why = choose_parallel(cfg, vocab_size, workers=world, limit_gib=device_memory_gib(cfg, device),
                                device_type=device.type, shape=shape)
    flag = torch.tensor([1.0 if mode == "fsdp" else 0.0], device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)  # the workers agree
    if flag.item() and mode != "fsdp":
        mode, why = "fsdp", "another worker's memory needs it"
    if mode == "ddp" and world == 1:
        mode = "none"
    return mode, f"train.parallel=auto: {why}"


def shard_model(module: nn.Module, mode: str, device: torch.device, amp_dtype: torch.dtype | None,
                experts=None) -> nn.Module:
    """Apply `mode` to the engine's LossModule (decoder + fused head); returns the module to call. FSDP shards
    `module` in place (it is also what is returned); DDP wraps it. `experts`: the decoder's experts split over
    ranks (pipeline/train/distributed/expert_parallel.py ExpertParallel): DDP leaves them out (their gradients are
    summed over the ranks holding the same experts after backward); FSDP shards each layer's experts over those
    ranks first (ExpertParallel.shard_experts), then the blocks and the root over every rank as without experts."""
    if mode == "none":
        return module
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        if experts is not None:
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                module, [f"decoder.{n}" for n in experts.names])
        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=ids, gradient_as_bucket_view=True)
    if mode != "fsdp":
        raise ValueError(f"parallel mode {mode!r}: choose one of {', '.join(PARALLEL_MODES)}")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # The resonance mixer and block return views (a reshaped output, the last state); FSDP warns because an in-place
    # op on such a view would skip its pre-backward hook. The model only ever uses them out of place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPResonance(Mixer|Block)\) returned a view")
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    fp32 = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
    blocks = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    if experts is not None:  # the experts' own units, over the ranks that hold the same experts
        experts.shard_experts(blocks)
    for block in module.decoder.blocks:
        mixer = getattr(block, "mixer", None)
        if mixer is not None:  # the resonance mixer: fp32 eigenvalues (module docstring)
            fully_shard(mixer, mesh=mesh, mp_policy=fp32)
        fully_shard(block, mesh=mesh, mp_policy=blocks)
    fully_shard(module, mesh=mesh, mp_policy=fp32)
    return module
