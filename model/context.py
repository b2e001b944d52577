"""One training row split across the ranks of a context group (context parallelism), as the model sees it.

    from model.context import NOT_SPLIT
    hidden = model(tokens, doc_ids, context=split)   # tokens, doc_ids: the WHOLE row (B, T); hidden: this rank's
                                                     # tokens only, (B, T / d, D), in split.positions(T) order

The model stays single-device code (docs/design.md, "Parallelism stays apart from the model"). Its forward takes the whole
row's token and document ids, so RoPE positions, document ids and masks are computed on the whole row before it is
split, and one RowSplit that says which of the row's tokens this rank computes and does the two cross-rank steps a
model cannot do alone:

    positions(T)                 (T/d,) int64: the row positions this rank computes, in its order
    gathered_positions(T)        (T,): the row position of each token `gather` returns
    gather(x, dim)               every rank's x concatenated along dim in rank order; differentiable (its backward
                                 sums the gradients of each rank's piece back to that rank): attention's K and V
    scan_carry(decay, state, reverse)
                                 for a linear recurrence whose slices the ranks hold (the resonance scan): the state
                                 entering this rank's slice, from every rank's (decay over its slice, state its slice
                                 ends in from zero); reverse: the adjoint entering from the right, in backward

`NOT_SPLIT` (degree 1) is the default: every position, no communication. pipeline/train/distributed/context_parallel.py
implements the two cross-rank steps over a process group; the layouts and the attention pieces below are the
model's own (they need no process group, and the tests run them in one process).

Layouts: which tokens a rank holds; each model class names its own (CONTEXT_LAYOUT):
  contiguous   rank r holds [r T/d, (r+1) T/d): a recurrence carries its state from slice to slice (resonance).
  balanced     the row dealt token by token in a snake order over blocks of d tokens (block 2i to ranks 0..d-1,
               block 2i+1 to ranks d-1..0): every rank holds T/d tokens, and under a causal document mask nearly the
               same (query, key) pairs, since within a document each rank's tokens of two neighbouring blocks have
               the same summed position (attention; `pairs_per_rank` counts them). Head-tail (two chunks per rank,
               r and 2d-1-r) balances a whole causal row but not a row of documents: see docs/long-context.md.

Attention keeps for backward only this rank's K and V (`attend_gathered`): the gathered K and V are dropped after
the forward and gathered again when the attention's backward needs them, so no layer keeps a whole row's K and V.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from model.layers import eager_only

LAYOUTS = ("contiguous", "balanced", "head_tail")


def layout_positions(T: int, degree: int, rank: int, layout: str, device=None) -> torch.Tensor:
    """(T // degree,) int64 row positions of rank `rank`'s tokens under `layout` (module docstring). head_tail: the
    common alternative (chunks r and 2d-1-r of 2d), for comparison only. T must be a multiple of degree (2 degree for
    head_tail)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: choose one of {', '.join(LAYOUTS)}")
    if T % degree or (layout == "head_tail" and T % (2 * degree)):
        raise ValueError(f"a row of {T} tokens does not split into {degree} equal {layout} slices")
    n = T // degree
    if layout == "contiguous":
        return torch.arange(rank * n, (rank + 1) * n, device=device)
    if layout == "head_tail":
        c = T // (2 * degree)
        return torch.cat([torch.arange(rank * c, (rank + 1) * c, device=device),
                          torch.arange((2 * degree - 1 - rank) * c, (2 * degree - rank) * c, device=device)])
    block = torch.arange(n, device=device)  # block i holds row positions [i d, (i + 1) d)
    within = torch.where(block % 2 == 0, rank, degree - 1 - rank)
    return block * degree + within


def pairs_per_rank(doc_ids: torch.Tensor | None, T: int, degree: int, layout: str) -> list[int]:
    """The (query, key) pairs each rank's attention computes under a causal mask (within documents when doc_ids
    (T,) is given) for a row of T tokens split `degree` ways under `layout`: how even the work is."""
    if doc_ids is None:
        per_query = torch.arange(1, T + 1)
    else:
        idx = torch.arange(T)
        start = torch.ones(T, dtype=torch.bool)
        start[1:] = doc_ids[1:] != doc_ids[:-1]
        per_query = idx - torch.where(start, idx, torch.zeros_like(idx)).cummax(0).values + 1
    return [int(per_query[layout_positions(T, degree, r, layout)].sum()) for r in range(degree)]


class RowSplit:
    """How a row is split: the protocol, and itself the unsplit default (degree 1, no communication). Subclasses
    with degree > 1 (pipeline/train/distributed/context_parallel.py) override `gather` and `scan_carry`."""

    degree: int = 1
    rank: int = 0
    layout: str = "contiguous"

    def positions(self, T: int, device=None) -> torch.Tensor:
        """(T / degree,) int64 row positions of this rank's tokens."""
        return layout_positions(T, self.degree, self.rank, self.layout, device)

    def gathered_positions(self, T: int, device=None) -> torch.Tensor:
        """(T,) int64: the row position of each token along `gather`'s output (rank by rank)."""
        return torch.cat([layout_positions(T, self.degree, r, self.layout, device) for r in range(self.degree)])

    def take(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a whole-row tensor (a view for the contiguous layout)."""
        if self.degree == 1:
            return x
        T = x.shape[dim]
        if self.layout == "contiguous":
            return x.narrow(dim, self.rank * (T // self.degree), T // self.degree)
        return x.index_select(dim, self.positions(T, x.device))

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim` in rank order (differentiable)."""
        return x

    def whole(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The inverse of `take`: every rank's tokens of x back in row order, on every rank (evaluation's
        per-token losses)."""
        if self.degree == 1:
            return x
        g = self.gather(x, dim)
        return torch.empty_like(g).index_copy_(dim, self.gathered_positions(g.shape[dim], g.device), g)

    def scan_carry(self, decay: torch.Tensor, state: torch.Tensor, reverse: bool = False) -> torch.Tensor:
        """(B, G, K, 2) (re, im) pairs of this rank's slice summary -> the (B, G, K, 2) carry entering it: the sum
        over the ranks q before it (after it when `reverse`) of state_q times the decays of the ranks between."""
        return torch.zeros_like(state)


NOT_SPLIT = RowSplit()


# ---------------------------------------------------------------------------------------------------------------
# Attention over a split row: local queries against every rank's keys and values


class ContextMask(NamedTuple):
    """What Attention gets in place of a mask when the row is split: the mask of this rank's queries (rows) against
    the gathered keys (columns, in gather order), a dense (B|1, 1, T/d, T) bool tensor or a flex BlockMask, the split,
    and whether the gathered K and V may be kept for backward (inside an activation-checkpointed block: they are
    recomputed with the block anyway)."""
    mask: object
    split: RowSplit
    keep_gathered: bool = False


def split_mask(doc_ids: torch.Tensor | None, T: int, split: RowSplit, device: torch.device,
               flex: bool) -> ContextMask:
    """The mask of this rank's queries against every key of the row, from the whole row's document ids (B, T) (or
    None: causal only) and the global positions: key k is seen by query q when pos(k) <= pos(q), in q's document."""
    q_pos, k_pos = split.positions(T, device), split.gathered_positions(T, device)
    q_doc = None if doc_ids is None else doc_ids.index_select(1, q_pos)  # (B, T/d)
    k_doc = None if doc_ids is None else doc_ids.index_select(1, k_pos)  # (B, T)
    if flex:
        from torch.nn.attention.flex_attention import create_block_mask

        def causal(b, h, qi, ki):
            return q_pos[qi] >= k_pos[ki]

        def causal_same_doc(b, h, qi, ki):
            return (q_pos[qi] >= k_pos[ki]) & (q_doc[b, qi] == k_doc[b, ki])

        on_cuda = torch.device(device).type == "cuda"
        mod, B = (causal, None) if doc_ids is None else (causal_same_doc, doc_ids.shape[0])
        return ContextMask(create_block_mask(mod, B, None, len(q_pos), T, device=device, _compile=on_cuda), split)
    mask = k_pos[None, :] <= q_pos[:, None]  # (T/d, T)
    if doc_ids is None:
        return ContextMask(mask[None, None], split)
    return ContextMask((mask[None] & (q_doc[:, :, None] == k_doc[:, None, :]))[:, None], split)  # (B, 1, T/d, T)


class _Regather(NamedTuple):
    local: torch.Tensor  # this rank's piece, (B, T/d, heads, hd) contiguous
    size: tuple
    stride: tuple
    offset: int


@eager_only  # collectives and saved-tensor hooks stay out of compiled blocks (a compiled flex kernel inside still runs)
def attend_gathered(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cm: ContextMask,
                    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """q (B, H, T/d, hd), k, v (B, Hkv, T/d, hd) of this rank's tokens -> attend(q, K, V) (B, H, T/d, hd) with K, V
    (B, Hkv, T, hd) every rank's, gathered.

    What backward keeps: the attention op's saved K and V are views of the gathered tensors; a saved-tensors hook
    swaps each for this rank's piece and gathers it again when backward unpacks it (one all-gather per tensor, on
    every rank in the same order, since every rank runs the same backward graph). The gather's own backward sums the
    gradient of K and V back to their ranks. So a layer keeps T/d of K and V, not T, at the price of a second
    all-gather per layer in backward. Inside a checkpointed block (cm.keep_gathered) the block is recomputed in
    backward and nothing of it is kept, so the hook stays out of the checkpoint's own."""
    k_loc, v_loc = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()  # (B, T/d, Hkv, hd)
    k_all = cm.split.gather(k_loc, dim=1)  # (B, T, Hkv, hd)
    v_all = cm.split.gather(v_loc, dim=1)
    if cm.keep_gathered or not torch.is_grad_enabled() or cm.split.degree == 1:
        return attend(q, k_all.transpose(1, 2), v_all.transpose(1, 2))
    owners = {k_all.untyped_storage().data_ptr(): k_loc, v_all.untyped_storage().data_ptr(): v_loc}

    def pack(t: torch.Tensor):
        local = owners.get(t.untyped_storage().data_ptr()) if t.device.type != "meta" else None
        if local is None:
            return t
        return _Regather(local.detach(), tuple(t.size()), tuple(t.stride()), t.storage_offset())

    def unpack(saved):
        if not isinstance(saved, _Regather):
            return saved
        with torch.no_grad():
            whole = cm.split.gather(saved.local, dim=1)
        return whole.as_strided(saved.size, saved.stride, saved.offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return attend(q, k_all.transpose(1, 2), v_all.transpose(1, 2))
