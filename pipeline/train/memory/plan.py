"""The memory model: what one training worker holds at its peak for a tier, a sequence length, a micro-batch,
activation checkpointing, a worker count and DDP or FSDP -- computed, not run, so it answers for tier F on 64
GPUs from a laptop.

    python -m pipeline.train.max_batch --tier F --seq-len 32768 --workers 8 --memory-limit-gib 80   # the plan
    from pipeline.train.memory.plan import estimate, plan
    est = estimate(cfg, 32000, workers=8, parallel="fsdp", device_type="cuda")   # est.total, est.parts()
    p = plan(cfg, 32000, workers=8, limit_gib=80, device_type="cuda")          # p.choice, p.rows

Terms, in bytes per worker (P parameters, W workers; P_w = P / W under FSDP, P under DDP or one process; N = B x T / c
tokens of the micro-batch this worker computes, c the context-parallel degree (train.context_parallel_degree: a row
of T tokens split over c workers; the W workers shard the state whatever c is); d, d_ff, q = heads x head_dim,
kv = kv_heads x head_dim; V vocabulary):

  state        fp32 master weights 4 P_w and AdamW's two moments 8 P_w; gradients 4 P_w from backward to the
               optimizer step (DDP keeps them in its buckets, gradient_as_bucket_view: 4 P for the whole run).
  activations  what backward needs, per token this worker computes and block (the saved-tensor lists of one block,
               traced with torch.autograd.graph.saved_tensors_hooks: bench/common.py saved_tensor_bytes; `python
               bench/mixer.py` prints them per tier):
                 fp32, eager (CPU)            24 d + 12 q + 12 kv + 16 d_ff + 4 heads + 8
                 bf16 autocast, eager         20 d +  6 q +  6 kv +  8 d_ff + 4 heads + 8
                 bf16 autocast, compiled       8 d +  8 q +  6 kv +  6 d_ff + 4 heads + 8   (inductor recomputes
                                              the norms and the SiLU instead of saving them)
               (the 16 / 8 / 6 d_ff of a dense MLP; a mixture-of-experts layer's feed-forward instead keeps, per token,
               k x (8 d + 16 F + 24) + 8 E + 48 in fp32 (its rows in expert order, the experts' SwiGLU tensors, the
               rows picked back for the weighted combine, the slots), k x (6 d + 8 F + 24) + 8 E + 48 under bf16
               autocast on a CPU and k x (4 d + 8 F + 24) + 8 E + 48 on CUDA, whose combine kernel keeps the bf16
               rows; shared experts add a SwiGLU of their width and their gated output; `_ffn_bytes`; fitted on
               CPU by tests/pipeline/train/test_memory_plan.py),
               plus, for a dense attention mask, the mask SDPA converts to floats in every block (T per token, in
               the compute dtype: the whole row's keys) and once per forward the boolean mask (T bytes per token).
               Context parallelism keeps only this worker's K and V (model/context.py); a block's backward also holds
               the whole row's K and V gathered again and their gradients (4 B T kv, in the compute dtype). A checkpointed block
               keeps only its input (4 d per token) and one block is recomputed at a time in backward. The
               resonance mixer's own tensors are measured by running one mixer on a short row (`_mixer_bytes`).
  head         the fused cross-entropy computes its gradients in forward: grad_weight (V, d) fp32 and grad_hidden
               (N, d), one fp32 logits chunk buffer (at most its byte budget, cuda_ops/cross_entropy.py), and the
               final norm's saved tensors; tied embeddings add the embedding's dense gradient and its sum in
               backward.
  working      FSDP: the root's parameters (embedding, final norm; kept fp32) unsharded for the whole step, two
               blocks' gathered parameters (one running, one prefetched) and, in a block's backward, its unsharded
               gradients, its fp32 reduce-scatter input and a third block's parameters; bf16 autocast without
               FSDP: the bf16 weight copies autocast keeps for backward (2 bytes per matmul parameter).
  optimizer    CUDA: fused AdamW, no temporaries; CPU: AdamW's per-tensor path, two temporaries of the largest
               (local) parameter.

The peak is the largest of four moments: the start of backward (state without gradients, working, every saved
activation, the head's gradients), each block's backward (the activations below it, its own, the gradients above),
the end of backward (all gradients, the tied embedding's extra copies) and the optimizer step. On CPU the model is
checked against the counted tensor storage of real steps (tests/pipeline/train/test_memory_plan.py); on CUDA
against the H100 peaks of tiers B, C and D at 32,768 tokens (docs/scaling.md).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from typing import Any

from pipeline.console import size_text

GIB = 2**30
AC_OPTIONS = ("none", "every_4", "every_2", "all")  # from the least recompute to the most (resonance adds mixer)
TOKEN_BYTES = 28  # per token: int64 tokens and shifted targets, int32 doc ids, fp32 loss and int32 correct rows


@dataclass(frozen=True)
class Shape:
    """What the model needs to know about one training configuration."""
    mixer: str
    tier: Any  # model/tiers.py Tier or ResonanceTier
    vocab_size: int
    seq_len: int
    batch_size: int
    activation_checkpointing: str
    tie_embeddings: bool
    ce_chunk_size: int
    device_type: str  # cuda | cpu
    bf16: bool  # bf16 autocast (CUDA with train.precision auto|bf16)
    compiled: bool  # regional torch.compile of the blocks
    attention: str  # the backend a training forward runs (model/decoder.py resolve_attention)
    doc_masking: bool
    context: int = 1  # train.context_parallel_degree: workers that split one row

    @property
    def tokens(self) -> int:
        """Tokens of the micro-batch one worker computes: its 1/context of each row."""
        return self.batch_size * self.seq_len // self.context


@dataclass
class MemoryEstimate:
    """Bytes per worker at the peak, by part (see the module docstring). `total` is the peak itself."""
    params: int
    optimizer_state: int
    grads: int
    activations: int
    head: int
    working: int
    optimizer_temp: int
    total: int
    moment: str  # which moment is the peak: the start of backward | a block's backward | the end of backward |
    # the optimizer step
    parallel: str
    workers: int
    batch_size: int
    activation_checkpointing: str

    def gib(self, name: str = "total") -> float:
        return getattr(self, name) / GIB

    def parts(self) -> dict[str, float]:
        """GiB by part, for printing: state (params + grads + AdamW), working, activations, head."""
        return {"state": (self.params + self.optimizer_state + self.grads) / GIB, "working": self.working / GIB,
                "activations": self.activations / GIB, "head": self.head / GIB, "total": self.total / GIB}


def shape_of(cfg, vocab_size: int, device_type: str, *, batch_size: int | None = None,
             activation_checkpointing: str | None = None, context: int | None = None) -> Shape:
    """The Shape of `cfg` (pipeline/config.py Config) trained on a `device_type` device."""
    from model.decoder import resolve_attention
    from pipeline.config import model_tier

    m, t = cfg.model, cfg.train
    bf16 = device_type == "cuda" and t.precision != "fp32"
    compiled = m.compile == "on" or (m.compile == "auto" and device_type == "cuda")
    attention = resolve_attention(m.attention, device_type, m.doc_masking) if m.mixer == "attention" else "none"
    context = context or t.context_parallel_degree
    if context > 1 and attention == "sdpa":  # a split row attends through a mask (model/decoder.py _split_mask)
        attention = "dense"
    return Shape(m.mixer, model_tier(cfg), vocab_size, cfg.data.seq_len,
                 batch_size or t.batch_size, activation_checkpointing or m.activation_checkpointing,
                 m.tie_embeddings, t.ce_chunk_size, device_type, bf16, compiled, attention, m.doc_masking, context)


# ------------------------------------------------------------------------------------------- the terms
def _param_split(s: Shape) -> tuple[int, int, int]:
    """(total, root, per block): the root holds the embedding, the final norm and an untied output weight."""
    from model.flops import param_count

    total = param_count(s.tier, s.vocab_size, s.tie_embeddings)
    d = s.tier.d_model
    root = s.vocab_size * d * (1 if s.tie_embeddings else 2) + d
    return total, root, (total - root) // s.tier.n_layers


def _largest_param(s: Shape, expert_degree: int = 1) -> int:
    t = s.tier
    d = t.d_model
    if s.mixer == "attention":
        block = max(d * (t.n_heads + 2 * t.n_kv_heads) * t.head_dim, 2 * d * t.d_ff)
    else:
        block = max(2 * d * d, 2 * d * t.d_ff)
    spec = getattr(t, "moe", None)
    if spec is not None:  # one layer's stacked experts' gate and up weights, (E / degree, 2F, d) on a worker
        block = max(block, spec.num_experts // expert_degree * 2 * spec.expert_ffn * d)
    return max(block, s.vocab_size * d)


def _dense_ffn_bytes(s: Shape, width: int) -> int:
    """Bytes per token a SwiGLU MLP of `width` keeps beyond its input: 16 / 8 / 6 x width (fp32, bf16, compiled)."""
    return (16 if not s.bf16 else 6 if s.compiled else 8) * width


def _ffn_bytes(s: Shape) -> float:
    """Bytes per token one block's feed-forward keeps beyond its input, averaged over the blocks (dense first layers
    of a MoE tier keep the dense MLP's): module docstring."""
    t = s.tier
    spec = getattr(t, "moe", None)
    if spec is None:
        return _dense_ffn_bytes(s, t.d_ff)
    d, E, k, F = t.d_model, spec.num_experts, spec.experts_per_token, spec.expert_ffn
    if not s.bf16:
        per_assignment, shared_out = 8 * d + 16 * F + 24, 4 * d + 8
    elif s.device_type == "cuda":
        per_assignment, shared_out = 4 * d + 8 * F + 24, 2 * d + 4
    else:
        per_assignment, shared_out = 6 * d + 8 * F + 24, 2 * d + 4
    moe = k * per_assignment + 8 * E + 48
    if spec.shared_experts:
        moe += _dense_ffn_bytes(s, spec.shared_ffn) + shared_out
    n_moe = spec.moe_layers(t.n_layers)
    return (n_moe * moe + (t.n_layers - n_moe) * _dense_ffn_bytes(s, t.d_ff)) / t.n_layers


def ffn_width(tier) -> int:
    """The hidden width one token runs through in a feed-forward: d_ff, or k x expert_ffn + the shared width."""
    spec = getattr(tier, "moe", None)
    return tier.d_ff if spec is None else spec.experts_per_token * spec.expert_ffn + spec.shared_ffn


def block_bytes_per_token(s: Shape) -> float:
    """Bytes one block saves for backward per token of the micro-batch (module docstring)."""
    t = s.tier
    d, ffn = t.d_model, _ffn_bytes(s)
    if s.mixer == "attention":
        q, kv, heads = t.n_heads * t.head_dim, t.n_kv_heads * t.head_dim, t.n_heads
        if not s.bf16:
            core = 24 * d + 12 * q + 12 * kv + ffn + 4 * heads + 8
        elif s.compiled:
            core = 8 * d + 8 * q + 6 * kv + ffn + 4 * heads + 8
        else:
            core = 20 * d + 6 * q + 6 * kv + ffn + 4 * heads + 8
        if s.attention == "dense":  # SDPA turns the boolean mask into a float mask in every block and saves it
            core += s.seq_len * (2 if s.bf16 else 4)
        return core
    # resonance: the norms (the group norm's included), the input projection's (u, gate) output, the gate, the
    # output projection and the SwiGLU MLP, traced as above, plus the mixer itself (measured)
    if not s.bf16:
        rest = 52 * d + ffn + 16
    elif s.compiled:
        rest = 18 * d + ffn + 16
    else:
        rest = 38 * d + ffn + 16
    return rest + _mixer_bytes(d, t.n_groups, t.n_eigen, t.chunk_size, _mixer_form(s), s.bf16)


def mlp_half_bytes_per_token(s: Shape) -> float:
    """Of block_bytes_per_token, what the MLP half keeps (its norm's input and output, the SwiGLU tensors): all a
    resonance block keeps, with its input, under activation_checkpointing=mixer (the mixer half is recomputed)."""
    d, ffn = s.tier.d_model, _ffn_bytes(s)
    if not s.bf16:
        return 12 * d + ffn + 4
    return (6 * d + ffn + 4) if s.compiled else (10 * d + ffn + 4)


def _mixer_form(s: Shape) -> str:
    """The core form whose saved tensors stand for the training form: the Numba scan kernel (CUDA) keeps its output
    s and the starts, as the FFT form's autograd Function keeps s, so the FFT form measures it on a CPU; off CUDA
    the reference scan with doc masking, else the FFT form (model/resonance.py core_form)."""
    if s.device_type == "cuda" or not s.doc_masking:
        return "fft"
    return "scan"


@lru_cache(maxsize=64)
def _mixer_bytes(d_model: int, n_groups: int, n_eigen: int, chunk: int, form: str, bf16: bool) -> float:
    """Bytes per token one resonance mixer saves for backward, measured: the mixer (its parameters are small:
    G x K x P complex weights) runs forward on a row of four chunks on the CPU (under bf16 autocast for a bf16
    run: its projections run in the autocast dtype around an fp32 core) with a saved-tensors hook counting every
    distinct storage. Its tensors are (B, T, G, K) complex or (B, T, D) real, so bytes per token do not depend on
    the row length (the FFT form's length-2T transforms included); the scan adds its starts (1 byte per token)."""
    import contextlib

    import torch

    from model.resonance import ResonanceMixer

    T = 4 * chunk
    with torch.random.fork_rng(devices=[]):
        mixer = ResonanceMixer(d_model, n_groups, n_eigen, chunk)
    params = {p.untyped_storage().data_ptr() for p in mixer.parameters()}
    u = torch.zeros(1, T, d_model, requires_grad=True)
    starts = torch.zeros(1, T, dtype=torch.bool) if form == "scan" else None
    seen: dict[int, int] = {}

    def pack(x):
        st = x.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return x

    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x), autocast:
        mixer(u, form=form, starts=starts)
    seen.pop(u.untyped_storage().data_ptr(), None)  # the block's own term counts its input
    return sum(seen.values()) / T + (1 if bf16 else 0)  # the kernel's starts, (B, T) uint8


def _shared_per_token(s: Shape) -> int:
    """Bytes per token held once per forward, not per block: the batch itself, the boolean mask, RoPE tables."""
    shared = TOKEN_BYTES
    if s.attention == "dense":
        shared += s.seq_len  # the boolean (B, 1, T, T) mask
    if s.mixer == "attention":
        shared += 4 * s.tier.head_dim  # RoPE cos and sin, (B, T, 1, head_dim / 2) fp32 each
    return shared


def _head(s: Shape) -> tuple[int, int]:
    """(at the start of backward, extra at the end of backward) for the fused cross-entropy head and the root."""
    import torch

    from cuda_ops.cross_entropy import auto_chunk_rows

    d, V = s.tier.d_model, s.vocab_size
    n = s.tokens
    # the head sees the fp32 residual stream, so its logits chunk is fp32; ce_chunk_size=0 sizes it to the
    # cross-entropy's byte budget (on a GPU also at most a quarter of the free memory, which a plan cannot know)
    rows = min(s.ce_chunk_size, n) if s.ce_chunk_size > 0 else auto_chunk_rows(n, V, torch.float32,
                                                                               torch.device("cpu"))
    final_norm = n * (8 * d + 4)  # its input and normalised input, fp32
    grad_hidden = 4 * n * d
    grad_weight = 4 * V * d
    # forward: the hidden states and the logits chunk buffer while the loop runs; backward start: the weight
    # gradient copied into .grad beside the saved one
    transient = max(4 * n * d + rows * V * 4, grad_weight)
    start = final_norm + grad_hidden + grad_weight + transient
    end = 8 * V * d if s.tie_embeddings else 0  # the embedding's dense gradient and the sum with the head's
    return int(start), int(end)


def estimate(cfg, vocab_size: int, *, workers: int = 1, parallel: str = "ddp", device_type: str = "cuda",
             batch_size: int | None = None, activation_checkpointing: str | None = None,
             shape: Shape | None = None, expert_degree: int = 1) -> MemoryEstimate:
    """Peak bytes per worker of a training step of `cfg` with `workers` workers under `parallel` (ddp | fsdp;
    ddp with one worker is the one-process run) on a `device_type` device.

    expert_degree: a mixture of experts' routed experts split over that many workers (expert parallelism): a
    worker holds E / degree experts of every MoE layer; under FSDP the experts are sharded over the workers as the
    rest is (degree x the workers left of the mesh), so the state per worker is the same, and a block's gathered
    parameters hold no experts, while every layer's E / degree experts stay gathered from their forward to their
    backward (their own FSDP units: pipeline/train/distributed/expert_parallel.py); under DDP the experts' state
    itself is divided by the degree. Each MoE layer also holds the rows it sends and receives (k d per token
    each, in the compute dtype). The load is taken as balanced.

    Backward is followed block by block: block i's backward holds the activations of the blocks below it, its
    own (saved, or recomputed when checkpointed), the residual stream's gradient in and out, and the gradients
    of its own weights and of the blocks above it, so both ends of backward and every block between are candidates
    for the peak. `shape`: cfg's Shape on `device_type` where the caller resolved it already (shape_of); the
    micro-batch and activation checkpointing asked for here replace its own."""
    from model.layers import checkpointed_layers

    if parallel not in ("ddp", "fsdp"):
        raise ValueError(f"parallel={parallel!r}: choose ddp or fsdp")
    if shape is None:
        s = shape_of(cfg, vocab_size, device_type, batch_size=batch_size,
                     activation_checkpointing=activation_checkpointing)
    else:
        s = replace(shape, batch_size=batch_size or shape.batch_size,
                    activation_checkpointing=activation_checkpointing or shape.activation_checkpointing)
    from model.flops import expert_params

    total_p, root_p, block_p = _param_split(s)
    L, d = s.tier.n_layers, s.tier.d_model
    n = s.tokens
    fsdp = parallel == "fsdp"
    shard = workers if fsdp else 1
    expert_p = expert_params(s.tier)
    if expert_degree > 1:  # a worker's experts: E / degree of them, sharded further by FSDP over what is left
        if not expert_p or s.tier.moe.num_experts % expert_degree or (fsdp and workers % expert_degree):
            raise ValueError(f"expert_degree={expert_degree} must divide the tier's experts (and the workers)")
        held = expert_p // expert_degree
        total_p -= expert_p - held  # what this worker's state is made of, before FSDP's sharding
        block_p -= (expert_p - held) // L
        shard_e = shard // expert_degree if fsdp else 1
        local = math.ceil((total_p - held) / shard) + math.ceil(held / shard_e)
    else:
        local = math.ceil(total_p / shard)
    params, adam, grads = 4 * local, 8 * local, 4 * local
    buckets = grads if (not fsdp and workers > 1) else 0  # DDP: gradients live in its buckets all run long
    grow = 0 if buckets else 1  # gradients appear during backward unless the buckets already hold them
    if fsdp:  # the root unsharded, two blocks gathered (one running, one prefetched); in a block's backward also
        p_bytes = 2 if s.bf16 else 4  # its unsharded gradients, its fp32 reduce-scatter input and a third block's
        gathered = block_p - (held // L if expert_degree > 1 else 0)  # split experts: not in a block's gather
        working = 4 * root_p + 2 * p_bytes * gathered  # parameters (the next one gathers before the last is freed)
        block_working = (2 * p_bytes + 4) * gathered
        if expert_degree > 1:  # split experts are their own FSDP units, gathered from their forward to their
            working += p_bytes * held  # backward: every MoE layer's block of E / degree experts at once
    else:
        working = 2 * (total_p - root_p + vocab_size * d) if s.bf16 else 0  # autocast's bf16 weight copies
        block_working = 0
    opt_temp = 0 if device_type == "cuda" else 2 * 4 * math.ceil(_largest_param(s, expert_degree) / shard)

    full = block_bytes_per_token(s) * n
    # inside a block's backward: the residual stream's gradient in and out (8 d), and one d_ff-wide gradient in the
    # compute dtype live beside the block's activations (the MLP's; fitted on CPU: checkpointed blocks within 5%)
    grad_ff = ffn_width(s.tier) * (2 if s.bf16 else 4)
    if expert_degree > 1:  # the rows a MoE layer sends and receives
        grad_ff += 2 * s.tier.moe.experts_per_token * d * (2 if s.bf16 else 4)
    # context parallelism: the whole row's K and V gathered again in a block's backward, and their gradients
    gathered = (4 * s.batch_size * s.seq_len * s.tier.n_kv_heads * s.tier.head_dim * (2 if s.bf16 else 4)
                if s.context > 1 and s.mixer == "attention" else 0)
    kept = 4 * d * n  # a checkpointed block keeps its input
    current = full  # what the block whose backward runs holds: its saved or recomputed activations
    if s.activation_checkpointing == "mixer":  # resonance: every block keeps its MLP half and its input, and the
        mlp = mlp_half_bytes_per_token(s) * n  # mixer half is recomputed after the MLP half's backward freed it
        saved = [mlp + kept] * L
        current = max(mlp, full - mlp) + kept
    else:
        ckpt = checkpointed_layers(s.activation_checkpointing, L)
        saved = [kept if i in ckpt else full for i in range(L)]
    base = params + adam + buckets + working + _shared_per_token(s) * n
    head_start, head_end = _head(s)
    # the root's gradient after the head's backward: the output weight's, unsharded until the end under FSDP
    root_grad = 4 * vocab_size * d if fsdp else grow * 4 * vocab_size * d
    moments = {"the start of backward": (base + sum(saved) + head_start, sum(saved))}
    for i in reversed(range(L)):
        acts = sum(saved[:i]) + current
        live = (base + block_working + acts + (8 * d + grad_ff) * n + root_grad + gathered
                + grow * (L - i) * math.ceil(4 * block_p / shard))
        if live > moments.get("a block's backward", (0,))[0]:
            moments["a block's backward"] = (live, acts)
    # the end: every gradient; FSDP still holds the root unsharded and reduce-scatters its gradient into a new
    # shard, DDP copies the head's gradient into a bucket
    end = params + adam + grads + head_end + (4 * vocab_size * d if buckets else 0)
    moments["the end of backward"] = (end + (4 * root_p + math.ceil(4 * root_p / shard) if fsdp else 0), 0)
    moments["the optimizer step"] = (params + adam + grads + opt_temp, 0)
    moment = max(moments, key=lambda k: moments[k][0])
    peak, acts = moments[moment]
    late = moment in ("the end of backward", "the optimizer step")
    return MemoryEstimate(params, adam, grads if late else buckets, int(acts),
                          head_start if moment == "the start of backward" else 0, working,
                          opt_temp if moment == "the optimizer step" else 0, int(peak), moment, parallel, workers,
                          s.batch_size, s.activation_checkpointing)


# ------------------------------------------------------------------------------------------- the plan
CUDA_HEADROOM = 0.05  # of a GPU's memory kept free: the CUDA context, library workspaces, allocator fragmentation


def usable_bytes(limit_gib: float, device_type: str) -> float:
    """What the plan may fill of a `limit_gib` device: all of a CPU's simulated size (the count is exact), 95% of a
    GPU (the model counts tensors; the device also holds the CUDA context and allocator slack)."""
    return limit_gib * GIB * (1 - CUDA_HEADROOM if device_type == "cuda" else 1.0)


@dataclass
class PlanRow:
    parallel: str
    activation_checkpointing: str
    max_batch: int  # 0: not even one sequence fits
    peak_bytes: int  # the estimated peak at max_batch (at batch 1 when nothing fits)
    estimate: MemoryEstimate


@dataclass
class Plan:
    tier: str
    mixer: str
    seq_len: int
    vocab_size: int
    workers: int
    limit_gib: float
    usable_bytes: float
    device_type: str
    rows: list[PlanRow] = field(default_factory=list)
    choice: PlanRow | None = None  # the least recompute that fits one sequence; DDP before FSDP at equal recompute
    context: int = 1  # train.context_parallel_degree planned for: workers that split one row
    expert_degree: int = 1  # train.expert_parallel_degree planned for: workers a MoE model's experts are split over

    @property
    def fits(self) -> bool:
        return self.choice is not None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def max_batch_by_model(cfg, vocab_size: int, *, limit_bytes: float, upper: int = 1024,
                       **kw) -> tuple[int, MemoryEstimate]:
    """(largest micro-batch in 1..upper whose estimate fits limit_bytes, its estimate); (0, estimate at batch 1)."""
    def est(b: int) -> MemoryEstimate:
        return estimate(cfg, vocab_size, batch_size=b, **kw)

    if est(1).total > limit_bytes:
        return 0, est(1)
    lo, hi = 1, 2
    while hi <= upper and est(hi).total <= limit_bytes:
        lo, hi = hi, hi * 2
    hi = min(hi, upper + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if est(mid).total <= limit_bytes else (lo, mid)
    return lo, est(lo)


def plan(cfg, vocab_size: int, *, workers: int, limit_gib: float, device_type: str = "cuda",
         upper: int = 1024, expert_degree: int | None = None) -> Plan:
    """Every (parallel, activation checkpointing) with its largest micro-batch by the model, and the choice: the
    least recompute that fits one sequence, DDP before FSDP at equal recompute (one worker: DDP only). cfg's
    train.context_parallel_degree splits each row over that many of the `workers` (a multiple of it); expert_degree
    (default train.expert_parallel_degree) splits a MoE tier's experts over that many (estimate says how)."""
    from pipeline.train.distributed.context_parallel import check_degree

    check_degree(cfg.train.context_parallel_degree, workers)
    ep = expert_degree or cfg.train.expert_parallel_degree
    usable = usable_bytes(limit_gib, device_type)
    out = Plan(cfg.model.tier, cfg.model.mixer, cfg.data.seq_len, vocab_size, workers, limit_gib, usable, device_type,
               context=cfg.train.context_parallel_degree, expert_degree=ep)
    modes = ("ddp", "fsdp") if workers > 1 else ("ddp",)
    options = AC_OPTIONS if cfg.model.mixer != "resonance" else ("none", "every_4", "mixer", "every_2", "all")
    shape = shape_of(cfg, vocab_size, device_type)  # the tier resolved once for every estimate below
    for ac in options:
        for mode in modes:
            if mode == "fsdp" and workers % ep:
                continue
            b, est = max_batch_by_model(cfg, vocab_size, limit_bytes=usable, upper=upper, workers=workers,
                                        parallel=mode, device_type=device_type, activation_checkpointing=ac,
                                        shape=shape, expert_degree=ep)
            row = PlanRow(mode, ac, b, est.total, est)
            out.rows.append(row)
            if out.choice is None and b >= 1:
                out.choice = row
    return out


MAX_CONTEXT_DEGREE = 64  # the largest degree the plan tries (a row over 64 GPUs: eight 8-GPU nodes)


def context_degrees(seq_len: int, upper: int = MAX_CONTEXT_DEGREE) -> list[int]:
    """The degrees a plan tries for a row of seq_len tokens: powers of two up to `upper` that split it equally."""
    return [c for c in (2 ** i for i in range(upper.bit_length())) if c <= upper and seq_len % c == 0]


def smallest_context_degree(cfg, vocab_size: int, *, limit_gib: float, device_type: str = "cuda", workers: int = 1,
                            seq_len: int | None = None, upper: int = 1024) -> Plan | None:
    """The plan at the smallest context-parallel degree at which cfg's tier and row length (or `seq_len`) fit a
    worker of limit_gib (train.context_parallel_degree 1, 2, 4, ... up to MAX_CONTEXT_DEGREE; `workers`, rounded up
    to a multiple of the degree, shard the state), or None when even that many do not hold it. Degrees the config
    refuses (a row longer than the tier's max_seq_len x the degree) are skipped."""
    from pipeline.config import ConfigError

    seq_len = seq_len or cfg.data.seq_len
    for c in context_degrees(seq_len):
        w = -(-max(workers, c) // c) * c
        try:
            ccfg = cfg.replace({"train.context_parallel_degree": c, "ray.num_workers": w, "ray.min_workers": 0,
                                "data.seq_len": seq_len})
        except ConfigError:
            continue
        p = plan(ccfg, vocab_size, workers=w, limit_gib=limit_gib, device_type=device_type, upper=upper)
        if p.fits:
            return p
    return None


def expert_degrees(num_experts: int, workers: int) -> list[int]:
    """The expert-parallel degrees a plan tries: the divisors of the experts that also divide the workers, from 1."""
    return [e for e in range(1, min(num_experts, workers) + 1) if num_experts % e == 0 and workers % e == 0]


def smallest_expert_degree(cfg, vocab_size: int, *, workers: int, limit_gib: float, device_type: str = "cuda",
                           upper: int = 1024) -> Plan | None:
    """The plan at the smallest expert-parallel degree at which cfg's MoE tier fits `workers` workers of limit_gib
    each (train.expert_parallel_degree 1, 2, ... dividing both the experts and the workers), or None when no degree
    does (or the tier is dense). Each plan is `plan(..., expert_degree=e)`: DDP and FSDP, every checkpointing."""
    from pipeline.config import model_tier

    spec = model_tier(cfg).moe
    if spec is None:
        return None
    for e in expert_degrees(spec.num_experts, workers):
        p = plan(cfg, vocab_size, workers=workers, limit_gib=limit_gib, device_type=device_type, upper=upper,
                 expert_degree=e)
        if p.fits:
            return p
    return None


def choose_parallel(cfg, vocab_size: int, *, workers: int, limit_gib: float, device_type: str,
                    shape: Shape | None = None) -> tuple[str, str]:
    """train.parallel=auto: ("ddp" | "fsdp", why). FSDP when a full copy with its gradients, AdamW state and the
    configured micro-batch's activations would not fit `limit_gib`; one worker has nothing to shard across."""
    if workers == 1:
        return "ddp", "one worker: nothing to shard across"
    usable = usable_bytes(limit_gib, device_type)
    shape = shape or shape_of(cfg, vocab_size, device_type)  # the tier resolved once for both estimates
    ddp = estimate(cfg, vocab_size, workers=workers, parallel="ddp", device_type=device_type, shape=shape)
    room = f"{size_text(usable)} usable per worker"
    if ddp.total <= usable:
        return "ddp", f"a full copy fits: {size_text(ddp.total)} by the memory model, {room}"
    fsdp = estimate(cfg, vocab_size, workers=workers, parallel="fsdp", device_type=device_type, shape=shape)
    tail = "" if fsdp.total <= usable else (f", which does not fit either: see `python -m pipeline.train.max_batch "
                                            f"--workers {workers}` for micro-batch and activation checkpointing")
    return "fsdp", (f"a full copy needs {size_text(ddp.total)} by the memory model, {room}; sharded over {workers} "
                    f"workers it needs {size_text(fsdp.total)}{tail}")


def fit_table(cfg, vocab_size: int, tiers: list[str], workers: list[int], *, limit_gib: float,
              device_type: str = "cuda") -> str:
    """Markdown: for each tier (rows) and worker count (columns), the plan's choice -- parallel mode, activation
    checkpointing, micro-batch and the peak per worker -- or "does not fit"."""
    head = "| tier | params | " + " | ".join(f"{w} x {limit_gib:g} GiB" for w in workers) + " |"
    lines = [head, "|" + "---|" * (2 + len(workers))]
    from model.flops import param_count
    from pipeline.config import model_tier

    for tier in tiers:
        tcfg = cfg.replace({"model.tier": tier})
        n = param_count(model_tier(tcfg), vocab_size, tcfg.model.tie_embeddings)
        cells = []
        for w in workers:
            c = plan(tcfg, vocab_size, workers=w, limit_gib=limit_gib, device_type=device_type, upper=64).choice
            mode = "unsharded" if c is not None and w == 1 else getattr(c, "parallel", "")
            cells.append("does not fit" if c is None else
                         f"{mode}, AC {c.activation_checkpointing}, batch {c.max_batch} ({c.peak_bytes / GIB:.1f} GiB)")
        lines.append(f"| {tier} | {n / 1e9:.2f}B | " + " | ".join(cells) + " |")
    return "\n".join(lines)
