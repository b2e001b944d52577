"""Token sampling for generation: temperature -> top-k -> top-p -> min-p, then one seeded draw per row.

    next_tok = sample(logits, temperature=0.8, top_k=50, top_p=0.95, seed=1234, step=t)   # (B,) int64

Index names (fixed for this file, as in llm.c's dev/cuda files):
    B    rows (sequences) in the batch          V    vocabulary size; `i` indexes the vocabulary
    l_i  logit (fp32), m = max_i l_i, T = temperature of the row
    w_i  = exp((l_i - m) / T) in fp32: unnormalised probability, w = 1 at the argmax

Semantics (the reference and the kernel implement exactly these; the tests check both against them):
    temperature <= 0          greedy: argmax, lowest index on ties (torch.argmax's rule).
    top_k = k in (0, V)       keep logits >= the k-th largest logit. TIES: every logit equal to the k-th value is
                              kept, so more than k tokens survive when the k-th value is repeated. k <= 0 or >= V: off.
    top_p = p < 1             nucleus over the top-k survivors: sort them by logit, descending; n = the fewest leading
                              tokens whose mass reaches p * (their total mass); keep logits >= the n-th logit (ties at
                              that value kept, as for top-k). p >= 1: off. p <= 0 keeps only the argmax (and its ties).
    min_p = q > 0             keep tokens with w_i >= q, i.e. p_i >= q * p_max (ratios survive renormalisation, so
                              it does not matter that it runs after top-p). The argmax always survives every filter.
    draw                      u in [0, 1) from a counter-based hash of (seed[row], step[row]); the token is the first
                              i in VOCAB order whose running sum of kept w exceeds u * sum(kept w) (inverse CDF).
Reference and kernel share the hash, so they draw the same u and pick the same token, except where u * sum lands
within floating-point rounding of a CDF boundary or a filter threshold (the sums are taken in different orders:
sorted cumsum in fp64 in the reference, tree reductions in fp64 over fp32 w in the kernel).
Inputs: finite logits (-inf allowed) with at least one finite logit per row; fp16/bf16 logits are upcast to fp32.

Two entry points:
    sampler = Sampler(B, V, device=dev, temperature=0.8, top_p=0.95, seed=1234)   # once per generation
    tok = sampler(logits)     # per step: (B,) int64, a static buffer; the step counter advances on the device
    tok = sample(logits, temperature=0.8, top_p=0.95, seed=1234, step=t)          # one-off, a fresh tensor
A Sampler prepares the per-row parameters, the step counter and every kernel buffer once; a call on CUDA is a fixed
sequence of launches of the sorting-free kernel in cuda_ops/sampling_kernel.py (no sort, no host sync, no
allocation), so it can be captured in a CUDA graph: inside a capture it records into the caller's graph
(model/decode_loop.py captures model + sampler as one graph), and called on its own it captures its own
graph on the second call and replays it after (one launch per call).

Parts: 1. reference (pure torch: the oracle and the CPU path)  2. the simulator driver of the kernel
       3. Sampler  4. public entry `sample`.
"""
from __future__ import annotations

import time
import warnings

import torch

from cuda_ops.dispatch import resolve_backend
from cuda_ops.sampling_kernel import INV_2_53, SamplingPlan, counter_bits53

def counter_uniform(seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """(B,) int64 seeds and steps -> (B,) float64 uniforms in [0, 1); the kernel computes the same values."""
    return counter_bits53(seed.long(), step.long()).double() * INV_2_53


# ---------------------------------------------------------------------------------------------------------------
# 1. Reference (pure torch): the test oracle and the CPU path
# ---------------------------------------------------------------------------------------------------------------

def _kept_weights(logits, temps, ks, ps, minps):
    """(B, V) logits and (B,) params -> (B, V) float64 unnormalised kept weights w_i (0 where filtered) and (B,)
    bool greedy mask. Greedy rows get a one-hot weight at the argmax."""
    x = logits.float()  # (B, V)
    B, V = x.shape
    greedy = ~(temps > 0)  # NaN temperature counts as greedy, as in the kernel
    m = x.max(dim=1, keepdim=True).values  # (B, 1)
    t = torch.where(greedy, torch.ones_like(temps), temps).float()[:, None]  # (B, 1)
    w32 = torch.exp((x - m) / t)  # (B, V) fp32, the kernel's formula
    # top-k: keep l >= k-th largest (ties kept)
    xs, order = x.sort(dim=1, descending=True, stable=True)  # (B, V)
    kth = xs.gather(1, (ks - 1).clamp(0, V - 1)[:, None])  # (B, 1)
    k_on = ((ks > 0) & (ks < V))[:, None]
    keep = ~k_on | (x >= kth)  # (B, V)
    # top-p over the top-k survivors: n = first sorted position where the cumulative mass reaches p * total
    ws = (w32.double() * keep).gather(1, order)  # (B, V) sorted by logit, descending
    cum = ws.cumsum(dim=1)
    need = ps.double()[:, None] * cum[:, -1:]
    n = (cum < need).sum(dim=1, keepdim=True).clamp(max=V - 1)  # (B, 1)
    p_on = (ps < 1)[:, None]
    keep = keep & (~p_on | (x >= xs.gather(1, n)))
    # min-p: w_i >= q (w_max = 1), compared in fp32 as in the kernel
    keep = keep & (w32 >= minps.float()[:, None])
    w = w32.double() * keep  # (B, V)
    onehot = torch.zeros_like(w).scatter_(1, x.argmax(dim=1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], onehot, w), greedy


def filtered_probs_reference(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """(B, V) logits -> (B, V) float64 probabilities after all filters, renormalised; zero outside the kept set."""
    temps, ks, ps, minps, _, _ = _row_params(logits, temperature, top_k, top_p, min_p, 0, 0)
    w, _ = _kept_weights(logits, temps, ks, ps, minps)
    return w / w.sum(dim=1, keepdim=True)


def _sample_reference_rows(logits, temps, ks, ps, minps, seeds, steps) -> torch.Tensor:
    w, greedy = _kept_weights(logits, temps, ks, ps, minps)  # (B, V) float64
    cum = w.cumsum(dim=1)  # (B, V) in vocab order
    target = counter_uniform(seeds, steps) * cum[:, -1]  # (B,)
    tok = torch.searchsorted(cum, target[:, None], right=True)[:, 0]  # first i with cum_i > target
    V = w.shape[1]
    last_kept = V - 1 - (w > 0).flip(1).int().argmax(dim=1)  # rounding guard: target >= cum[-1]
    tok = torch.minimum(tok, last_kept)
    return torch.where(greedy, logits.float().argmax(dim=1), tok)


def sample_reference(logits, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, step=0) -> torch.Tensor:
    """Pure-torch `sample` (same signature minus backend): sort-based filters, fp64 cumsum inverse CDF."""
    return _sample_reference_rows(logits, *_row_params(logits, temperature, top_k, top_p, min_p, seed, step))


# ---------------------------------------------------------------------------------------------------------------
# 2. The kernel's launch sequence on numpy arrays (the CUDA simulator's driver; tests only)
# ---------------------------------------------------------------------------------------------------------------

def _needs(temps, ks, ps, V) -> tuple[bool, bool, bool]:
    """(greedy only, some row has top-k, some row has top-p) from host-side per-row values."""
    hot = [float(t) > 0 for t in temps]
    needs_k = any(h and 0 < int(k) < V for h, k in zip(hot, ks))
    needs_p = any(h and float(p) < 1.0 for h, p in zip(hot, ps))
    return not any(hot), needs_k, needs_p


def _sample_numba_arrays(logits, temps, ks, ps, minps, seeds, steps, *, block=None, nb=None, splits=None,
                         until_done=False, return_steps=False):
    """numpy driver (tests, CUDA simulator): (B, V) logits and (B,) params -> (B,) int64 tokens (and the advanced
    copy of `steps` with return_steps). until_done stops the fixed launch sequence once every row is done (a host
    check between launches, which only the simulator can afford: it runs each GPU thread as a Python thread)."""
    import numpy as np

    from cuda_ops.sampling_kernel import BLOCK, DONE, NB, PHASE

    x = np.ascontiguousarray(logits, dtype=np.float32)
    B, V = x.shape
    row = lambda a, dt: np.array(np.broadcast_to(np.asarray(a, dtype=dt), (B,)))  # noqa: E731 (writable copy)
    params = [row(temps, np.float32), row(ks, np.int64), row(ps, np.float32), row(minps, np.float32),
              row(seeds, np.int64), row(steps, np.int64)]
    plan = SamplingPlan(B, V, splits=splits, block=block or BLOCK, nb=nb or NB)
    out = np.full(B, -1, dtype=np.int64)
    ws = [np.zeros(shape, dt) for shape, dt in plan.workspace_shapes()]
    kernel = plan.configured()
    n = plan.n_launches(*_needs(params[0], params[1], params[2], V))
    for i in range(n):
        last = i == n - 1 or (until_done and i > 0 and bool((ws[0][i % 2, :, PHASE] == DONE).all()))
        kernel(x, x.view(np.int32), *params, out, *ws, i, last)
        if last:
            break
    return (out, params[5]) if return_steps else out


# ---------------------------------------------------------------------------------------------------------------
# 3. Sampler: everything a generation's sampling calls need, prepared once
# ---------------------------------------------------------------------------------------------------------------

class Sampler:
    """Per-generation sampling: per-row parameters, the step counter and the kernel's buffers allocated once.

    Sampler(B, V, device=..., temperature, top_k, top_p, min_p, seed, step): each parameter a Python number or a
    (B,) tensor (as for `sample`). sampler(logits (B, V) any float dtype) -> (B,) int64 tokens, then every row's
    step advances by 1 on the device; the same (logits, parameters, seed, step) give the same tokens as `sample`.
    On the Numba backend the result is `sampler.out`, a buffer the next call overwrites; logits are first copied
    into `sampler.logits` (fp32), so writing them there directly saves the copy. graph: None (default) captures
    the launch sequence in a CUDA graph on the second call outside any capture; False never does.
    Python-number parameters let the launch sequence skip the top-k / top-p searches nobody uses; tensor
    parameters are not read on the host (that would sync), so the sequence then covers every filter.
    """

    def __init__(self, batch_size: int, vocab_size: int, *, device: torch.device | str = "cpu", temperature=1.0,
                 top_k=0, top_p=1.0, min_p=0.0, seed=0, step=0, backend: str | None = None,
                 splits: int | None = None, graph: bool | None = None):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.B, self.V, self.device = batch_size, vocab_size, device
        probe = torch.empty(batch_size, vocab_size, device="meta")
        temps, ks, ps, minps, seeds, steps = _row_params(probe, temperature, top_k, top_p, min_p, seed, step,
                                                         device=device)
        self.temps, self.ks, self.ps, self.minps, self.seeds = temps, ks, ps, minps, seeds
        self.steps = steps.clone()  # (B,) int64, advanced in place by every call
        self.backend = resolve_backend(device, backend)
        if any(isinstance(v, torch.Tensor) for v in (temperature, top_k, top_p)):
            self.needs = (False, True, True)  # not read on the host: every filter may be on
        else:
            self.needs = _needs([temperature] * batch_size, [top_k] * batch_size, [top_p] * batch_size, vocab_size)
        self.graph_wanted = graph is not False
        self._graph = None
        self._calls = 0
        if self.backend == "numba":
            self._setup_numba(splits)

    def _setup_numba(self, splits):
        from cuda_ops.dispatch import as_numba, check_same_device

        B, V, dev = self.B, self.V, self.device
        n_sm = torch.cuda.get_device_properties(dev).multi_processor_count
        self.plan = SamplingPlan(B, V, splits=splits, n_sm=n_sm)
        self.n_launches = self.plan.n_launches(*self.needs)
        self.logits = torch.empty(B, V, dtype=torch.float32, device=dev)  # (B, V) the kernel's input buffer
        check_same_device(self.logits)
        self.out = torch.empty(B, dtype=torch.int64, device=dev)
        self._ws = [torch.zeros(shape, dtype=getattr(torch, dt), device=dev) for shape, dt in self.plan.workspace_shapes()]
        # Numba views made once, here: nothing of Numba's array machinery runs per call (or during a capture)
        tensors = [self.logits, self.logits.view(torch.int32), self.temps, self.ks, self.ps, self.minps, self.seeds,
                   self.steps, self.out, *self._ws]
        self._args = [as_numba(t) for t in tensors]
        self._kernels = {}  # torch stream pointer -> configured kernel

    def reset(self, *, seed=None, step=0) -> None:
        """Start a new sequence of draws: steps back to `step` (device fill), seeds replaced when given."""
        if isinstance(step, torch.Tensor):
            self.steps.copy_(step)
        else:
            self.steps.fill_(step)
        if seed is not None:
            self.seeds.copy_(_per_row(seed, "seed", self.B, torch.int64, self.device))

    def _launch(self) -> None:
        from cuda_ops.dispatch import torch_stream

        stream = torch.cuda.current_stream(self.device)
        kernel = self._kernels.get(stream.cuda_stream)
        if kernel is None:
            kernel = self._kernels[stream.cuda_stream] = self.plan.configured(torch_stream())
        n = self.n_launches
        for i in range(n):
            kernel(*self._args, i, i == n - 1)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if tuple(logits.shape) != (self.B, self.V):
            raise ValueError(f"Sampler was made for ({self.B}, {self.V}) logits, got {tuple(logits.shape)}")
        if self.backend != "numba":
            tokens = _sample_reference_rows(logits, self.temps, self.ks, self.ps, self.minps, self.seeds, self.steps)
            self.steps += 1
            return tokens
        if logits is not self.logits:
            self.logits.copy_(logits)
        capturing = torch.cuda.is_current_stream_capturing()
        if self._graph is not None and not capturing:
            self._graph.replay()
            return self.out
        self._launch()
        self._calls += 1
        if self.graph_wanted and not capturing and self._calls >= 2:
            # torch.cuda.graph synchronises the device, collects garbage and empties the cache on entry: any of that,
            # or the capture itself, may fail; the launches above already ran, so the tokens stand and later calls
            # launch eagerly, as graph=False does
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):  # records the launches; nothing runs, the step counter stays put
                    self._launch()
                self._graph = graph
            except RuntimeError as exc:
                self.graph_wanted = False
                warnings.warn(f"CUDA-graph capture of the sampler failed, sampling without a graph: {exc}",
                              stacklevel=2)
        return self.out


def warmup(vocab_size: int = 32000) -> float:
    """Compile the kernel ahead of the first generation step (CUDA); returns the seconds it took."""
    t0 = time.perf_counter()
    Sampler(1, vocab_size, device="cuda", top_k=5, top_p=0.9, graph=False)(torch.zeros(1, vocab_size, device="cuda"))
    torch.cuda.synchronize()
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------------------------
# 4. Public entry
# ---------------------------------------------------------------------------------------------------------------

def _per_row(value, name, B, dtype, device):
    """Python scalar -> (B,) tensor filled on `device` (no host sync); tensor -> checked (B,) tensor on `device`.
    Pass per-row tensors already on the logits' device: a CPU tensor is copied synchronously."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            value = value.reshape(1).expand(B)
        if tuple(value.shape) != (B,):
            raise ValueError(f"sample(): {name} must be a Python number or a ({B},) tensor, one value per row of "
                             f"logits; got a tensor of shape {tuple(value.shape)}")
        return value.to(device=device, dtype=dtype).contiguous()
    return torch.full((B,), value, dtype=dtype, device=device)


def _row_params(logits, temperature, top_k, top_p, min_p, seed, step, device=None):
    """Validate scalars (tensor values are not checked: that would sync) and expand everything to (B,) tensors
    on `device` (default: the logits' device)."""
    if logits.dim() != 2:
        raise ValueError(f"sample(): logits must be (B, V), got shape {tuple(logits.shape)}")
    checks = (("temperature", temperature, lambda v: v >= 0, ">= 0 (0 = greedy)"),
              ("top_k", top_k, lambda v: v >= 0 and int(v) == v, "an integer >= 0 (0 = off)"),
              ("top_p", top_p, lambda v: 0 < v <= 1, "in (0, 1] (1 = off)"),
              ("min_p", min_p, lambda v: 0 <= v <= 1, "in [0, 1] (0 = off)"))
    for name, value, ok, rule in checks:
        if not isinstance(value, torch.Tensor) and not ok(value):
            raise ValueError(f"sample(): {name}={value!r} is out of range; it must be {rule}")
    B, dev = logits.shape[0], device or logits.device
    return (_per_row(temperature, "temperature", B, torch.float32, dev),
            _per_row(top_k, "top_k", B, torch.int64, dev),
            _per_row(top_p, "top_p", B, torch.float32, dev),
            _per_row(min_p, "min_p", B, torch.float32, dev),
            _per_row(seed, "seed", B, torch.int64, dev),
            _per_row(step, "step", B, torch.int64, dev))


def sample(logits, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, step=0, backend=None) -> torch.Tensor:
    """Draw one token per row. logits (B, V) any float dtype; each parameter a Python number or a (B,) tensor.

    Returns a new (B,) int64 tensor on logits.device. Same (logits, params, seed, step) -> same tokens; advance
    `step` every generation step (a (B,) `step` tensor is accepted too). On CUDA with numba-cuda this runs a
    one-off Sampler (its buffers are allocated per call: a generation loop should hold a Sampler instead); with
    per-row tensors already on the device nothing syncs. Elsewhere, or with backend="reference", the pure-torch
    reference runs. See the module docstring for the exact filter rules.
    """
    params = _row_params(logits, temperature, top_k, top_p, min_p, seed, step)
    B, V = logits.shape
    if B == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    if resolve_backend(logits.device, backend) == "numba":
        sampler = Sampler(B, V, device=logits.device, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                          seed=seed, step=step, backend="numba", graph=False)
        return sampler(logits)
    return _sample_reference_rows(logits, *params)
