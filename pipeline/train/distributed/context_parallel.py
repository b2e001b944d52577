"""Context parallelism over a process group: the (data x context) mesh, and the row split the model takes.

    mesh = ContextMesh.build(degree=2, device_type="cuda")   # every rank calls it (it makes the context groups)
    split = mesh.split(decoder.CONTEXT_LAYOUT)                # model/context.py RowSplit over this rank's group
    hidden = decoder(tokens, doc_ids, context=split)          # this rank's T/2 tokens of each whole row

`train.context_parallel_degree` = d splits every row over d workers. The workers form a mesh, numbered by the
process group's ranks; a context group is d neighbouring ranks (one node's GPUs share NVLink):

                  context 0   context 1          ranks 0, 1 read the same rows (data rank 0) and split them;
    data rank 0   rank 0      rank 1             ranks 2, 3 the next ones (data rank 1). FSDP shards and DDP
    data rank 1   rank 2      rank 3             averages over all four (data x context flattened, torchtitan's
                                                 dp_shard_cp); the loss is scaled so that this is the mean over
                                                 every data rank's tokens (pipeline/train/engine.py)

Every rank of a context group reads the same rows and takes its slice (data rank = rank // d, d data ranks fewer),
so the global batch, the data order, exact resume and mixtures do not change with d. The model state is not split
by context: a checkpoint resumes at any degree.

GroupSplit implements the protocol's two cross-rank steps with torch.distributed._functional_collectives on the
context group (`torch.distributed.nn.functional.all_gather` returned wrong gradients on gloo for the non-contiguous
gradient the CPU SDPA backward hands its K; the functional collective does not):
  gather      all_gather_single, autograd-aware: its backward reduce-scatters (sums) each rank's piece home.
  scan_carry  one all_gather of every rank's (decay, state) summary, then the exclusive prefix over the ranks before
              (after, in reverse): called by the scan's own autograd Function in its forward and its backward
              (cuda_ops/resonance_scan.py), so every rank, rank 0 included, runs both exchanges whatever its carry
              is (a carry built as zeros on rank 0 would leave rank 0 out of the backward's collective: gloo fails).
Both count what they send (`sent_bytes`, by the collectives' ring algorithms: bench/context_parallel.py compares it
with the bytes the process wrote to its sockets).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from model.context import NOT_SPLIT, RowSplit


class ContextParallelError(ValueError):
    """A context-parallel degree the worker group cannot run; the message names the setting and the fix."""


@dataclass(frozen=True)
class ContextMesh:
    """This rank's place in the (data x context) mesh; `group` is its context group (None at degree 1)."""
    degree: int
    rank: int
    world_size: int
    group: object = None

    @property
    def data_rank(self) -> int:
        return self.rank // self.degree

    @property
    def data_size(self) -> int:
        """Data-parallel ranks: distinct rows per micro-batch step (workers / degree)."""
        return self.world_size // self.degree

    @property
    def context_rank(self) -> int:
        return self.rank % self.degree

    @classmethod
    def build(cls, degree: int, device_type: str) -> "ContextMesh":
        """The mesh of the running process group (every rank must call it: it creates the context groups); degree 1,
        or no process group: one rank per row."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            if degree > 1:
                raise ContextParallelError(
                    f"train.context_parallel_degree={degree} splits each row over {degree} workers, and this run has "
                    f"one process; train under Ray Train with ray.num_workers a multiple of {degree} (not --no-ray), "
                    f"or set train.context_parallel_degree=1")
            return cls(1, 0, 1)
        rank, world = dist.get_rank(), dist.get_world_size()
        check_degree(degree, world)
        if degree == 1:
            return cls(1, rank, world)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, (world // degree, degree), mesh_dim_names=("data", "context"))
        return cls(degree, rank, world, mesh.get_group("context"))

    def split(self, layout: str) -> RowSplit:
        """The model's row split for this rank (NOT_SPLIT at degree 1)."""
        return NOT_SPLIT if self.degree == 1 else GroupSplit(self, layout)

    def describe(self) -> str:
        """`data 2 x context 2 (4 workers)` for the console line."""
        return f"data {self.data_size} x context {self.degree} ({self.world_size} worker(s))"


def check_degree(degree: int, workers: int) -> None:
    """One line when `workers` cannot form whole context groups of `degree`."""
    if degree < 1 or workers % degree:
        raise ContextParallelError(
            f"train.context_parallel_degree={degree} needs a worker count that is a multiple of it, got {workers} "
            f"worker(s); set ray.num_workers to a multiple of {degree}, or change the degree")


def _wait(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed._functional_collectives as funcol

    return funcol.wait_tensor(t) if isinstance(t, funcol.AsyncCollectiveTensor) else t


class GroupSplit(RowSplit):
    """RowSplit over a context group (module docstring)."""

    def __init__(self, mesh: ContextMesh, layout: str):
        self.degree, self.rank, self.layout, self.group = mesh.degree, mesh.context_rank, layout, mesh.group
        self.sent_bytes = 0  # by the ring algorithms: an all-gather sends (d - 1) pieces, its backward (a
        # reduce-scatter) (d - 1) pieces under NCCL and, as gloo runs it (an all-reduce), 2 (d - 1)

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        x = x.contiguous()
        self.sent_bytes += (self.degree - 1) * x.numel() * x.element_size()
        if x.requires_grad and torch.is_grad_enabled():  # its backward reduce-scatters the whole gradient
            factor = 2 if torch.distributed.get_backend(self.group) == "gloo" else 1
            x.register_hook(self._count_backward(factor * (self.degree - 1) * x.numel() * x.element_size()))
        return _wait(funcol.all_gather_single(x, dim, self.group))

    def _count_backward(self, nbytes: int):
        def hook(grad):
            self.sent_bytes += nbytes
            return grad
        return hook

    def scan_carry(self, decay: torch.Tensor, state: torch.Tensor, reverse: bool = False) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        both = torch.stack([decay, state]).contiguous()  # (2, B, G, K, 2) real pairs
        self.sent_bytes += (self.degree - 1) * both.numel() * both.element_size()
        every = _wait(funcol.all_gather_single(both, 0, self.group)).view(self.degree, *both.shape)
        summaries = torch.view_as_complex(every)  # (d, 2, B, G, K): [q, 0] decay, [q, 1] state of rank q's slice
        carry = torch.zeros_like(summaries[0, 1])
        for q in (range(self.degree - 1, self.rank, -1) if reverse else range(self.rank)):
            carry = summaries[q, 0] * carry + summaries[q, 1]
        return torch.view_as_real(carry).to(state.dtype)


def describe_context(engine) -> str:
    """The `context:` console line (rank 0, beside `kernels:`): the mesh and what each rank exchanges, as it runs."""
    cfg, m = engine.cfg, engine.mesh
    if cfg.model.mixer == "attention":
        from model.decoder import resolve_attention

        backend = resolve_attention(cfg.model.attention, engine.device, doc_masking=cfg.model.doc_masking)
        how = "flex_attention, a BlockMask" if backend == "flex" else "SDPA, a dense boolean mask"
        what = (f"attention all-gathers every rank's K and V per layer ({how} from the row's global positions and "
                f"documents) and gathers them again in backward instead of keeping them; tokens dealt in the "
                f"balanced order")
    else:
        from cuda_ops.dispatch import resolve_backend

        scan = "the Numba scan kernel" if resolve_backend(engine.device) == "numba" else "the torch reference scan"
        what = (f"the resonance scan's state carried across the ranks ({scan}; one exchange of slice summaries per "
                f"layer each way); contiguous slices")
    return f"degree {m.degree}, {m.describe()}: {what}"


def bytes_per_step(tier, mixer: str, batch_size: int, seq_len: int, degree: int, *, act_bytes: int,
                   backend: str = "nccl") -> dict[str, int]:
    """The byte model: what one rank of a context group sends per micro-batch step for the row split alone (the data
    parallel gradient traffic of DDP or FSDP is apart), by the ring algorithms of the collectives it runs.

    attention, per layer: the forward all-gathers K and V ((d - 1) pieces of B T/d kv each, `act_bytes` per number);
      backward gathers them again and reduce-scatters their gradients: (d - 1) pieces each under NCCL, 2 (d - 1)
      under gloo, which runs a reduce-scatter as an all-reduce (a checkpointed block gathers in its recompute
      instead of again: the same bytes). resonance, per layer: one all-gather of the slice's (decay, state)
      summary each way, (d - 1) x 2 B G K complex numbers (fp32 pairs, 8 bytes each)."""
    if degree == 1:
        return {"forward": 0, "backward": 0, "total": 0}
    d = degree
    if mixer == "attention":
        piece = batch_size * seq_len // d * tier.n_kv_heads * tier.head_dim * act_bytes  # this rank's K (or V)
        forward = 2 * (d - 1) * piece
        reduce_scatter = (2 if backend == "gloo" else 1) * (d - 1) * piece
        backward = 2 * (d - 1) * piece + 2 * reduce_scatter
    else:
        summary = 2 * batch_size * tier.n_groups * tier.n_eigen * 8
        forward = backward = (d - 1) * summary
    L = tier.n_layers
    return {"forward": forward * L, "backward": backward * L, "total": (forward + backward) * L}
