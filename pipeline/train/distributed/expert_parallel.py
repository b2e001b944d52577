"""Expert parallelism over a process group: the (replica x expert [x context]) mesh, the all-to-all expert dispatch
a MoE layer takes (model/expert_dispatch.py's protocol), and the gradient reduction, clipping, checkpoint layout
and whole-weight gathering of the experts it splits.

    mesh = ExpertMesh.build(degree=2, context_degree=1, device_type="cpu", timeout_s=600)   # every rank calls it
    experts = ExpertParallel.split(mesh, decoder)  # this rank keeps its E/2 experts; every MoE layer dispatches by it
    shard_model(module, "ddp" | "fsdp", ..., experts=experts)   # parallel.py: DDP leaves them out, FSDP shards them
    ...backward...
    experts.reduce_gradients()                 # each expert's gradient summed over the ranks that hold it, / world
    norm = experts.clip_grad_norm(module.parameters(), max_norm)   # one norm over every rank's experts

`train.expert_parallel_degree` = e splits the E experts of every MoE layer over e workers: rank q of an expert group
holds the contiguous block [q E/e, (q+1) E/e) (model/expert_dispatch.py). The workers are numbered as a
(replica x expert x context) mesh; with context parallelism (degree c) a context group stays c neighbouring ranks,
so data rank = rank // c as before. 8 workers, e = 2, c = 2, E = 8 experts:

                   expert 0 (experts 0-3)      expert 1 (experts 4-7)
                   context 0    context 1      context 0    context 1
    replica 0      rank 0       rank 1         rank 2       rank 3        data ranks 0 (ranks 0, 1), 1 (ranks 2, 3)
    replica 1      rank 4       rank 5         rank 6       rank 7        data ranks 2 (ranks 4, 5), 3 (ranks 6, 7)

  all-to-all (expert group, e ranks): same replica, same context rank, each expert rank: {0, 2} {1, 3} {4, 6} {5, 7}.
    A MoE layer's routed rows go to the rank that holds their expert and come back (forward; the gradients take
    the reverse way in backward). The counts go first (one all-to-all of E numbers), then the rows, uneven.
  expert gradients (replica group, world / e ranks): the ranks holding the same experts: {0, 1, 4, 5} {2, 3, 6, 7}.
    Each expert's gradient is summed over them and divided by the world size: the mean over every rank's loss, as
    DDP's average (or FSDP's reduce-scatter) gives every other parameter.
  everything else (router, attention or resonance mixer, norms, embeddings, shared experts): DDP or FSDP over every
    rank, as without experts.
Under DDP the expert weights are left out of DDP: every rank holds its E/e experts whole, with their AdamW moments,
and reduce_gradients all-reduces them over the replica group after backward. Under FSDP (torchtitan's way) each
layer's experts are an FSDP unit of their own over the replica group (shard_experts): a rank stores 1/(world/e) of
its block, gathered when the layer reads them and kept until their backward (a module call returns them, so they
must outlive it), reduce-scattered over the replica group (an average over it; reduce_gradients divides by e too).

The exchange (`ExpertSplit`) moves the rows with torch.distributed.nn.functional.all_to_all_single (autograd-aware,
uneven splits; gloo and NCCL both run it). Received rows arrive grouped by source rank, then local expert; one
stable argsort of a (local expert, source) key puts them in local-expert order, and its inverse puts the outputs back.
The groups are created with the run's collective timeout (train.collective_timeout_s), so a rank that does not join
an exchange ends in pipeline/train/distributed/collectives.py's one line naming the rank and the step.

Checkpoints are not split by experts: the experts' weights and AdamW moments are saved as DTensors sharded on the
expert dimension over the expert group (and over the replica group under FSDP; their global shape the whole
(E, ...)), in the sharded layout (pipeline/train/checkpoints/state.py), so any degree and worker count reads them
back, and one process reads the whole tensors.
"""
from __future__ import annotations

import datetime
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
import torch.nn as nn

from model.expert_dispatch import ExpertDispatch


# The autograd-aware all-to-all the protocol asks for (its backward is the reverse exchange); torch 2.13 marks it
# deprecated in favour of _functional_collectives' all_to_all_single_autograd, which is private
warnings.filterwarnings("ignore", message=r"torch\.distributed\.nn\.functional\.all_to_all_single is deprecated")

# Backends whose all_to_all_single takes uneven splits, forward and (through torch.distributed.nn) backward: gloo
# (checked on torch 2.13 CPU) and NCCL. The project's process groups are one of the two (Ray Train's TorchConfig and
# process_group.py pick nccl with GPUs, gloo without); MPI builds and others are refused in one line.
ALL_TO_ALL_BACKENDS = ("gloo", "nccl")


class ExpertParallelError(ValueError):
    """An expert-parallel degree the worker group cannot run; the message names the setting and the fix."""


def check_workers(degree: int, context_degree: int, workers: int) -> None:
    """One line when `workers` cannot form whole expert (x context) groups."""
    group = degree * context_degree
    if degree < 1 or workers % group:
        more = f" x train.context_parallel_degree={context_degree}" if context_degree > 1 else ""
        raise ExpertParallelError(
            f"train.expert_parallel_degree={degree}{more} needs a worker count that is a multiple of {group}, got "
            f"{workers} worker(s); set ray.num_workers to a multiple of {group}, or change the degree")


@dataclass
class ExpertMesh:
    """This rank's place in the (replica x expert x context) mesh (module docstring)."""
    degree: int
    context_degree: int
    rank: int
    world_size: int
    group: Any = None  # this rank's expert group (the all-to-all)
    replica_group: Any = None  # the ranks holding the same experts (the gradient sum)
    device_mesh: Any = None  # (expert, replica) DeviceMesh over the two groups: FSDP and the checkpoint's DTensors
    device_type: str = "cpu"

    @property
    def expert_rank(self) -> int:
        return (self.rank // self.context_degree) % self.degree

    @property
    def replicas(self) -> int:
        return self.world_size // self.degree

    @classmethod
    def build(cls, degree: int, context_degree: int, device_type: str, timeout_s: float | None = None) -> "ExpertMesh":
        """Every rank must call it (it creates every expert and replica group, in the same order everywhere)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        if not (dist.is_available() and dist.is_initialized()):
            raise ExpertParallelError(
                f"train.expert_parallel_degree={degree} splits the experts over {degree} workers, and this run has "
                f"one process; train under Ray Train with ray.num_workers a multiple of {degree} (not --no-ray), or "
                f"set train.expert_parallel_degree=1")
        rank, world = dist.get_rank(), dist.get_world_size()
        check_workers(degree, context_degree, world)
        backend = dist.get_backend()
        if backend not in ALL_TO_ALL_BACKENDS:
            raise ExpertParallelError(
                f"train.expert_parallel_degree={degree} moves tokens by all-to-all with uneven splits, which the "
                f"{backend} backend does not run here; train on {' or '.join(ALL_TO_ALL_BACKENDS)} (gloo on CPU, "
                f"nccl on GPUs: what Ray Train and the Ray-free groups choose), or set the degree to 1")
        e, c = degree, context_degree
        kw = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
        group = replica = None
        for r in range(world // (e * c)):
            for ci in range(c):
                ranks = [(r * e + q) * c + ci for q in range(e)]
                g = dist.new_group(ranks, **kw)
                if rank in ranks:
                    group = g
        for q in range(e):
            ranks = [(r * e + q) * c + ci for r in range(world // (e * c)) for ci in range(c)]
            g = dist.new_group(ranks, **kw)
            if rank in ranks:
                replica = g
        # (expert, replica): row q holds experts block q, in the replica group's order; its dimensions are the two
        # groups above (with their timeout), for FSDP over the replicas and the checkpoint's DTensors
        layout = torch.tensor([[(r * e + q) * c + ci for r in range(world // (e * c)) for ci in range(c)]
                               for q in range(e)])
        mesh = DeviceMesh.from_group([group, replica], device_type, mesh=layout, mesh_dim_names=("expert", "replica"))
        return cls(degree, context_degree, rank, world, group, replica, mesh, device_type)

    def describe(self, num_experts: int) -> str:
        """`experts 8 over 2 ranks (4 each), 2 replicas` for the console line and the MLflow mesh tag."""
        return (f"expert {self.degree}: {num_experts} experts over {self.degree} ranks ({num_experts // self.degree} "
                f"each, all-to-all per MoE layer), {self.replicas} replica(s) of each block of experts")


class ExpertSplit(ExpertDispatch):
    """model/expert_dispatch.py's protocol over an expert group (module docstring)."""

    def __init__(self, mesh: ExpertMesh, num_experts: int):
        self.degree, self.rank, self.group = mesh.degree, mesh.expert_rank, mesh.group
        self.num_experts, self.per = num_experts, num_experts // mesh.degree

    def local_weight(self, weight: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        if isinstance(weight, DTensor):
            return weight.to_local()
        if weight.shape[0] == self.per:  # this rank's block, held as the parameter itself (ExpertParallel)
            return weight
        return weight[self.rank * self.per:(self.rank + 1) * self.per]

    def exchange(self, rows: torch.Tensor, counts: torch.Tensor):
        import torch.distributed as dist
        from torch.distributed.nn.functional import all_to_all_single

        d, per = self.degree, self.per
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts.contiguous(), group=self.group)  # recv[s per + e]: rank s -> my expert e
        by_source = recv.view(d, per)
        send_splits, recv_splits = torch.stack([counts.view(d, per).sum(1), by_source.sum(1)]).tolist()  # one sync
        received = all_to_all_single(rows.new_empty(sum(recv_splits), rows.shape[1]), rows.contiguous(),
                                     recv_splits, send_splits, group=self.group)
        # received: grouped by source rank, then local expert -> by local expert, then source rank (one argsort)
        key = (torch.arange(per, device=rows.device)[None, :] * d + torch.arange(d, device=rows.device)[:, None])
        row_key = torch.repeat_interleave(key.flatten(), by_source.flatten(), output_size=received.shape[0])
        order = torch.argsort(row_key, stable=True)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return received.index_select(0, order), by_source.sum(0), (inverse, send_splits, recv_splits)

    def combine(self, out: torch.Tensor, handle) -> torch.Tensor:
        from torch.distributed.nn.functional import all_to_all_single

        inverse, send_splits, recv_splits = handle
        back = out.index_select(0, inverse)  # source-rank order again
        return all_to_all_single(out.new_empty(sum(send_splits), out.shape[1]), back, send_splits, recv_splits,
                                 group=self.group)


@dataclass
class ExpertParallel:
    """The experts of a decoder split over an ExpertMesh: each MoE layer keeps its block of experts as its
    parameters ((E/e, ...), sliced from the whole model every rank builds from the same seed) and dispatches
    through ExpertSplit. `names`: the split parameters' names in the decoder; `params` reads them from it (FSDP
    replaces them with its sharded ones, and with whole ones while gathered)."""
    mesh: ExpertMesh
    num_experts: int
    dispatch: ExpertSplit
    decoder: nn.Module
    names: list[str] = field(default_factory=list)
    fsdp: bool = False  # the experts are sharded over their replica group by FSDP (shard_experts)

    @property
    def params(self) -> dict[str, torch.Tensor]:
        return {n: self.decoder.get_parameter(n) for n in self.names}

    def shard_experts(self, mp_policy) -> None:
        """FSDP over the replica group for each layer's experts (torchtitan's way): each rank of it keeps 1/replicas
        of its block of experts, gathered when the layer reads them (ExpertWeights' call) and kept until backward.
        Its reduce-scatter averages over the replica group; reduce_gradients divides by the degree too, for the
        mean over every rank's loss (set_gradient_divide_factor would do it in the collective, with a PREMUL_SUM
        that gloo does not run)."""
        from torch.distributed.fsdp import fully_shard

        from model.moe import moe_layers

        for layer in moe_layers(self.decoder):
            fully_shard(layer.experts, mesh=self.mesh.device_mesh["replica"], mp_policy=mp_policy,
                        reshard_after_forward=False)
        self.fsdp = True

    @classmethod
    def split(cls, mesh: ExpertMesh, decoder: nn.Module) -> "ExpertParallel":
        from model.moe import moe_layers, set_expert_dispatch

        layers = moe_layers(decoder)
        if not layers:
            raise ExpertParallelError(f"train.expert_parallel_degree={mesh.degree} splits experts, and this model is "
                                      f"dense; leave it at 1 or choose a -moe tier")
        E = layers[0].spec.num_experts
        if E % mesh.degree:
            raise ExpertParallelError(f"train.expert_parallel_degree={mesh.degree} does not divide model.num_experts="
                                      f"{E}; choose a divisor of {E}")
        dispatch = ExpertSplit(mesh, E)
        per, q = E // mesh.degree, mesh.expert_rank
        owner = {id(m): n for n, m in decoder.named_modules()}
        names = []
        for layer in layers:
            for leaf in ("w_gate_up", "w_down"):
                whole = getattr(layer.experts, leaf)
                setattr(layer.experts, leaf, nn.Parameter(whole.detach()[q * per:(q + 1) * per].clone()))
                names.append(f"{owner[id(layer.experts)]}.{leaf}")
        set_expert_dispatch(decoder, dispatch)
        return cls(mesh, E, dispatch, decoder, names)

    def is_expert(self, p: torch.Tensor) -> bool:
        return any(p is q for q in self.params.values())

    def describe(self) -> str:
        return self.mesh.describe(self.num_experts)

    # -- gradients -----------------------------------------------------------------------------------------------
    def reduce_gradients(self) -> None:
        """Each expert's gradient: summed over the replica group, / world size (module docstring). One all-reduce."""
        import torch.distributed as dist

        if self.fsdp:  # FSDP's reduce-scatter over the replica group averaged them: / degree makes it / world
            grads = [p.grad for p in self.params.values() if p.grad is not None]
            if grads:
                torch._foreach_div_([g.to_local() if hasattr(g, "to_local") else g for g in grads],
                                    float(self.mesh.degree))
            return
        params = list(self.params.values())
        for p in params:
            if p.grad is None:  # no row reached these experts on any rank of the group: a zero gradient
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        if self.mesh.replicas > 1:
            dist.all_reduce(flat, group=self.mesh.replica_group)
        flat /= self.mesh.world_size
        start = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(flat[start:start + n].view_as(p.grad))
            start += n

    def clip_grad_norm(self, parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the whole model: the norm of the other parameters' gradients (a
        DTensor under FSDP: reduced over its shards) and of every expert's, whichever rank holds it (this rank's
        experts' squared norm summed over the expert group); then every gradient scaled by the same factor."""
        import torch.distributed as dist
        from torch.nn.utils import clip_grads_with_norm_, get_total_norm

        params = [p for p in parameters if p.grad is not None]
        dense = [p for p in params if not self.is_expert(p)]
        experts = [p for p in params if self.is_expert(p)]
        norm = get_total_norm([p.grad for p in dense], foreach=True) if dense else torch.zeros(())
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        e_norm = get_total_norm([p.grad for p in experts], foreach=True)
        if hasattr(e_norm, "full_tensor"):  # FSDP over the replica group: reduced over its shards
            e_norm = e_norm.full_tensor()
        e_sq = e_norm.float() ** 2
        dist.all_reduce(e_sq, group=self.mesh.group)
        total = torch.sqrt(norm.float() ** 2 + e_sq)
        if max_norm != float("inf"):
            if dense:
                clip_grads_with_norm_(dense, max_norm, total, foreach=True)
            clip_grads_with_norm_(experts, max_norm, total, foreach=True)
        return total

    # -- whole experts -------------------------------------------------------------------------------------------
    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """(E/e, ...) this rank's block -> (E, ...) every block of the expert group (a collective)."""
        import torch.distributed as dist

        parts = [torch.empty_like(local) for _ in range(self.mesh.degree)]
        dist.all_gather(parts, local.detach().contiguous(), group=self.mesh.group)
        return torch.cat(parts)

    def whole_weights(self) -> dict[str, torch.Tensor]:
        """Decoder-relative name -> the whole (E, ...) expert weight: every rank must call it."""
        return {n: self.gather(p) for n, p in self.params.items()}

    def block(self, whole: torch.Tensor) -> torch.Tensor:
        """(E, ...) -> this rank's (E/e, ...) block."""
        per, q = self.num_experts // self.mesh.degree, self.mesh.expert_rank
        return whole[q * per:(q + 1) * per]

    def as_global(self, local: torch.Tensor):
        """This rank's (E/e, ...) block (a DTensor over the replica group under FSDP: its shard of the block) as a
        DTensor of the whole (E, ...) shape, sharded on dim 0 over the expert group (and then over the replica
        group); the storage shared: DCP reads into it in place."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        block = local.shape  # the DTensor's global shape is the block's
        if isinstance(local, DTensor):
            local, placements = local.to_local(), [Shard(0), Shard(0)]
        else:
            placements = [Shard(0), Replicate()]
        shape = (block[0] * self.mesh.degree, *block[1:])
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, self.mesh.device_mesh, placements, run_check=False, shape=shape,
                                  stride=stride)

    def state_keys(self, prefix: str = "") -> set[str]:
        """The keys of a model state dict ({prefix}name) that are this rank's expert blocks."""
        return {prefix + n for n in self.params}

    def to_global(self, state: dict[str, Any], model_prefix: str) -> dict[str, Any]:
        """A state dict (model keys `{model_prefix}name`, flattened optimizer keys `state.{model_prefix}name.*`)
        with every expert block and its AdamW moments as whole-shape DTensors (as_global); the rest as they are."""
        out = {}
        for k, v in state.items():
            name = k[len("state."):] if k.startswith("state.") else k
            base = name.rsplit(".", 1)[0] if k.startswith("state.") else name
            if base.startswith(model_prefix) and base[len(model_prefix):] in self.params and torch.is_tensor(v) \
                    and v.ndim >= 1:
                out[k] = self.as_global(v)
            else:
                out[k] = v
        return out
