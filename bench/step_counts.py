"""Count what one call of a torch function does: the ops it dispatches, the bytes they write, the device-to-host
syncs among them. Two views of one step, used by bench/decode_step_counts.py and its test:

    counts = count_eager(fn, *args)          # every aten op the call dispatches (a TorchDispatchMode)
    counts = count_compiled(fn, *args)       # the forward graph torch.compile hands inductor (AOTAutograd, inductor's
                                             # decompositions, input mutations kept in the graph)
    counts.ops, counts.bytes_written, counts.syncs, counts.by_op     # {op name: [calls, bytes]}

Bytes written, by construction (what a kernel must store, not what a cache hierarchy adds):
    an op that returns new tensors        their bytes (a view, e.g. a slice or a transpose, writes nothing)
    an in-place op or an out= op          the bytes of the region it writes: index_copy_ its source, index_fill_ and
                                          index_put_ the indexed elements, scatter_ the index, others the whole tensor
In the compiled graph, input mutations appear as a functional op followed by copy_ into the graph input. Where the
functional op is an index_put / index_copy / index_fill / scatter of that same input, inductor writes it in place
(its reinplacing pass; inductor's output code for the decode step on CPU fuses the cache write into a kernel that
stores the new entries into the cache argument, no whole-cache buffer), so it is counted as its in-place form and the
copy_ as nothing. Any other functional update of an input (a select_scatter into a view of a stacked buffer, say) is
counted at its full output size, as inductor runs it. Every other op of the graph counts its whole output: the graph
is the one before fusion, so the compiled figure is an upper bound of what inductor stores (fusion removes
intermediates), exact for what it cannot remove (the cache writes, the logits, matmul outputs).

Syncs: ops whose result the host must read before it can go on (item / _local_scalar_dense, is_nonzero, nonzero,
masked_select, unique, equal, bincount, repeat_interleave without output_size) and copies from a GPU to the host.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = {"aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.nonzero", "aten.masked_select",
            "aten.unique", "aten._unique", "aten._unique2", "aten.unique_dim", "aten.unique_consecutive",
            "aten.equal", "aten.bincount", "aten.nonzero_numpy"}
SCATTER_LIKE = {"aten.index_put", "aten._unsafe_index_put", "aten.index_copy", "aten.index_fill", "aten.scatter",
                "aten.scatter_add"}


@dataclass
class Counts:
    ops: int = 0  # ops that run a kernel (views and getitem excluded)
    views: int = 0
    bytes_written: int = 0
    syncs: int = 0
    by_op: dict = field(default_factory=dict)  # op name -> [calls, bytes written]

    def add(self, name: str, nbytes: int, sync: bool = False) -> None:
        self.ops += 1
        self.bytes_written += nbytes
        self.syncs += int(sync)
        entry = self.by_op.setdefault(name, [0, 0])
        entry[0] += 1
        entry[1] += nbytes

    def as_dict(self) -> dict:
        return {"ops": self.ops, "views": self.views, "bytes_written": self.bytes_written, "syncs": self.syncs,
                "by_op": {k: {"calls": v[0], "bytes": v[1]} for k, v in sorted(self.by_op.items())}}


def _name(func) -> str:
    """aten.index_copy_.default -> aten.index_copy_ (overload dropped)."""
    return str(func).rsplit(".", 1)[0] if str(func).count(".") >= 2 else str(func)


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _indexed_numel(shape, indices) -> int:
    """Elements of a tensor of `shape` that tensor[indices] selects (advanced indexing, None = the whole dim)."""
    probe = torch.empty(shape, device="meta")
    return probe[tuple(slice(None) if i is None else _meta(i) for i in indices)].numel()


def inplace_bytes(base: str, args: list, kwargs: dict, target: torch.Tensor) -> int:
    """Bytes an in-place (or reinplaced) update of `target` writes; `base` is the op name without its trailing _."""
    elem = target.element_size()
    if base == "aten.index_copy":
        return _nbytes(args[3] if len(args) > 3 else kwargs["source"])
    if base == "aten.index_fill":
        dim, index = args[1], args[2]
        return target.numel() // max(target.shape[dim], 1) * index.numel() * elem
    if base in ("aten.index_put", "aten._unsafe_index_put"):
        return _indexed_numel(target.shape, args[1]) * elem
    if base in ("aten.scatter", "aten.scatter_add"):
        return args[2].numel() * elem
    return _nbytes(target)


def _is_sync(name: str, func, args, out) -> bool:
    if name in SYNC_OPS:
        return True
    if name == "aten.repeat_interleave" and len(args) == 1:
        return True  # repeats tensor without output_size: the output length is read on the host
    if name in ("aten._to_copy", "aten.copy_"):
        src = args[1] if name == "aten.copy_" else args[0]
        dst = args[0] if name == "aten.copy_" else out
        return (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) and src.device.type != "cpu"
                and dst.device.type == "cpu")
    return False


VIEW_LIKE = {"aten._unsafe_view", "aten._reshape_alias", "aten.lift_fresh"}  # alias their input, no alias_info


def _returns_view(func) -> bool:
    if _name(func) in VIEW_LIKE:
        return True
    rets = func._schema.returns
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)


def _written_args(func, args, kwargs) -> list:
    """The tensors an op writes in place (self of an x_ op, out= of an out variant)."""
    written = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(a.name)
            if isinstance(value, torch.Tensor):
                written.append(value)
    return written


class _Counter(TorchDispatchMode):
    def __init__(self, counts: Counts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = _name(func)
        if _returns_view(func):
            self.counts.views += 1
            return out
        written = _written_args(func, args, kwargs)
        if written:
            base = name[:-1] if name.endswith("_") else name
            nbytes = sum(inplace_bytes(base, list(args), kwargs, t) for t in written)
        else:
            outs = out if isinstance(out, (tuple, list)) else [out]
            nbytes = sum(_nbytes(o) for o in outs)
        self.counts.add(name, nbytes, _is_sync(name, func, list(args), out))
        return out


def count_eager(fn, *args, **kwargs) -> Counts:
    """Run fn(*args, **kwargs) once under a dispatch mode and count what it dispatched."""
    counts = Counts()
    with _Counter(counts):
        fn(*args, **kwargs)
    return counts


def forward_graph(fn, *args) -> torch.fx.GraphModule:
    """The forward graph torch.compile(fn) hands inductor for these arguments (fullgraph, static shapes): AOTAutograd
    with inductor's decompositions and the input mutations kept in the graph, as inductor compiles it. Runs fn once."""
    import torch._dynamo
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    backend = aot_autograd(fw_compiler=keep, decompositions=select_decomp_table(),
                           keep_inference_input_mutations=True)
    torch._dynamo.reset()
    try:
        torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*args)
    finally:
        torch._dynamo.reset()
    return graphs[0]


def count_graph(gm: torch.fx.GraphModule) -> Counts:
    """Count a forward graph from its nodes' shapes (see the module docstring for the reinplacing rule)."""
    nodes = list(gm.graph.nodes)
    placeholders = {n for n in nodes if n.op == "placeholder"}
    reinplaced, silent = set(), set()
    for n in nodes:
        if n.op == "call_function" and _name(n.target) == "aten.copy_" and n.args[0] in placeholders:
            src = n.args[1]
            if (isinstance(src, torch.fx.Node) and src.op == "call_function" and _name(src.target) in SCATTER_LIKE
                    and src.args and src.args[0] is n.args[0]):
                reinplaced.add(src)
                silent.add(n)
    counts = Counts()
    for n in nodes:
        if n.op != "call_function" or n in silent:
            continue
        if not isinstance(n.target, torch._ops.OpOverload):  # getitem of a multi-output op
            continue
        name = _name(n.target)
        if _returns_view(n.target):
            counts.views += 1
            continue
        val = n.meta.get("val")
        if n in reinplaced:
            args = [a.meta["val"] if isinstance(a, torch.fx.Node) else
                    [x.meta["val"] if isinstance(x, torch.fx.Node) else x for x in a] if isinstance(a, (list, tuple))
                    else a for a in n.args]
            nbytes = inplace_bytes(name, args, {}, args[0])
            name += " (in place)"
        else:
            vals = val if isinstance(val, (tuple, list)) else [val]
            nbytes = sum(_nbytes(v) for v in vals)
        counts.add(name, nbytes, name in SYNC_OPS)
    return counts


def count_compiled(fn, *args) -> Counts:
    return count_graph(forward_graph(fn, *args))


def linear_fit(xs: list[int], ys: list[int]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (x, y): bytes = a + b x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def is_linear(xs: list[int], ys: list[int], rel: float = 1e-9) -> bool:
    a, b = linear_fit(xs, ys)
    return all(math.isclose(a + b * x, y, rel_tol=rel, abs_tol=1.0) for x, y in zip(xs, ys))
