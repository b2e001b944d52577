"""The decode loop over a model alone: KV-cached batched generation with the cuda_ops sampler, token ids in, token
ids out (as litgpt's generate/base.py: `generate(model, prompt, ...)`; this module needs only torch and cuda_ops).

    from model.decode_loop import generate_ids, generation_autocast
    with generation_autocast(model):
        new = generate_ids(model, [[2, 17, 33], [2, 5]], max_new_tokens=64, top_p=0.95)  # (2, 64) int64
    python bench/generate.py                          # decode tokens/s at batch 1, 8, 64

Loading a checkpoint, its tokenizer and text in and out belong to the command (pipeline/train/handoff/text_generation.py:
`python pipeline/run.py generate --checkpoint ... --prompt ...`).

Prompts of different lengths are left-padded into one batch; the KV cache masks the pads and starts each row's
RoPE positions at its first real token. The prompt is one forward (prefill); then one fixed-shape decode step per
new token for the whole batch: model -> logits -> cuda_ops Sampler -> EOS bookkeeping -> the token written into
the output, all on the device, with no host sync inside the loop.

The whole step in one CUDA graph. For a model with a graph-safe `decode_compute(tok, cache, span)` (model/decoder.py;
any model that adds one to the `new_kv_cache` + `model(ids, kv_cache=cache)` protocol gets the same path), the
step -- model, sampler (a fixed sequence of Numba launches on buffers prepared once per generation), EOS mask and
output write -- is captured once per attention span bucket (model/kv_cache.py: a handful per generation), and each
later token is one graph replay: one host call per token. `decode_plan` decides, from the spans ahead: after
WARMUP_STEPS eager steps, a span is captured only once a step has run it eagerly (its compile and first launches
happen outside the capture); the graphs share one memory pool. The step can be
compiled first (`compile_step`: torch.compile of model + logits, default mode, which fuses the norms, RoPE, the
softmax and the SwiGLU into a few Triton kernels and keeps the step graph-capturable), so a replay runs about a
dozen kernels per layer instead of ~40. A model without `decode_compute` (only the generic protocol) runs the
same step eagerly. An fp32 model (the eval-time samples) generates under bf16 autocast on CUDA
(generation_autocast); the command loads a checkpoint in bf16.

Long prompts. What a prompt costs before the first token is bounded apart from its length where it can be: the
cache is allocated once (zeros: a memset at the device's bandwidth); the prompt runs in chunks of at most
PREFILL_CHUNK tokens a row when it is longer (each chunk attends to the cache filled so far, so activations and any
mask stay at B x PREFILL_CHUNK x ...; without left padding no mask is materialised at all, model/kv_cache.py); the
compiled step does not specialise on the cache's length or the span (those dimensions are marked dynamic before
the first compile), so a process compiles the step once per batch size whatever its prompts, and inductor's cache
serves the same graph to the next process; graph capture records one graph per span bucket (a few per generation).

Timing (GenerationTimings): prefill = the cache allocation, the prompt forward(s) and its logits; warm-up = the
first sampling call (where Numba compiles the sampling kernel on first use), the eager warm-up steps (where
torch.compile compiles) and the graph capture; decode = the remaining steps (a capture for a new span bucket
included). Each phase ends with a device sync, so the three are measured apart and the decode figure is the steady
state; cache_s, first_sample_s, first_step_s and capture_s split out what happens once.
"""
from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass

import torch

from cuda_ops.sampling import Sampler

WARMUP_STEPS = 2  # eager decode steps before capture: cuBLAS and the allocator settle on the side stream first
COMPILE_MIN_TOKENS = 8192  # compile_step=None compiles on CUDA when batch x new tokens reach this (amortised)
PREFILL_CHUNK = 4096  # prompt tokens a row per prefill forward: longer prompts run in chunks


@dataclass
class GenerationTimings:
    """Seconds and token counts per phase (see the module docstring). Decode tokens count every row at every
    timed step (rows past EOS included: they are computed all the same)."""
    prefill_tokens: int  # real prompt tokens (left pads not counted)
    prefill_s: float
    warmup_tokens: int
    warmup_s: float
    decode_tokens: int
    decode_s: float
    decode_cpu_s: float  # process CPU time during decode (all threads): on a shared CPU, less noisy than decode_s
    cuda_graph: bool  # whether the decode steps replayed a CUDA graph (model + sampler: the whole step)
    compiled: bool = False  # whether the step was compiled (torch.compile) before capture
    graphs: int = 0  # CUDA graphs captured (one per attention span bucket the generation crossed)
    # what comes before the first token, apart (prefill_s above covers cache_s + the prompt's forward):
    cache_s: float = 0.0  # allocating the KV cache / generation state
    prefill_chunks: int = 1  # forwards the prompt took (PREFILL_CHUNK tokens a row at most, long prompts)
    first_sample_s: float = 0.0  # the first sampler call (Numba compiles the kernel there on first use), in warmup_s
    first_step_s: float = 0.0  # the first decode step (torch.compile traces and compiles there), in warmup_s
    capture_s: float = 0.0  # recording the CUDA graphs (in warmup_s for the first, decode_s for later buckets)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / max(self.prefill_s, 1e-9)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / max(self.decode_s, 1e-9) if self.decode_tokens else 0.0


@dataclass
class GenerationOutput:
    token_ids: list[list[int]]  # new tokens per prompt (up to and including EOS when it came)
    texts: list[str]  # decoded new text per prompt
    new_tokens: int  # total new tokens across the batch
    seconds: float  # the whole call, warm-up included
    tokens_per_s: float  # new_tokens / seconds
    timings: GenerationTimings


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _decode_logits(decoder, tok: torch.Tensor, cache, span: int | None) -> torch.Tensor:
    """tok (B,) -> logits (B, V) fp32 through the model's graph-safe step (what is captured)."""
    return decoder.logits(decoder.decode_compute(tok, cache, span))


def _decode_logits_spanned(decoder, tok: torch.Tensor, cache, span_slots: torch.Tensor | None) -> torch.Tensor:
    """_decode_logits for torch.compile: the span arrives as the length of a (span,) view of cache.slots, whose
    dimension is marked dynamic, so the compiled step holds it symbolic from its first compile (a Python int would
    be specialised, and a second span bucket or prompt length would compile again)."""
    span = None if span_slots is None else span_slots.shape[0]
    return decoder.logits(decoder.decode_compute(tok, cache, span))


def _mark_length_dynamic(cache) -> None:
    """The dimensions of a KV cache that follow the prompt length, dynamic for torch.compile (maybe_: a dimension
    the graph needs static stays static instead of failing). A cache without them (the resonance state) is left."""
    from torch._dynamo import maybe_mark_dynamic

    for t in list(getattr(cache, "k", [])) + list(getattr(cache, "v", [])):
        maybe_mark_dynamic(t, 2)
    for name, dim in (("key_bias", 3), ("cos", 0), ("sin", 0), ("slots", 0)):
        if isinstance(getattr(cache, name, None), torch.Tensor):
            maybe_mark_dynamic(getattr(cache, name), dim)


_compiled_decode_logits = {}  # torch.compile backend -> the compiled _decode_logits (compiled once per process)


def _step_fn(decoder, cache, compile_backend: str | None):
    """(tok (B,), span) -> logits (B, V) fp32; whether the step advances cache.length itself (generic protocol)."""
    if not hasattr(decoder, "decode_compute"):
        return (lambda tok, span: decoder.logits(decoder(tok[:, None], kv_cache=cache)[:, -1])), True
    if compile_backend is None:
        return (lambda tok, span: _decode_logits(decoder, tok, cache, span)), False
    # default mode: no CUDA graphs of its own (the loop captures the whole step); the cache's length dimensions and
    # the span are dynamic from the first compile (_mark_length_dynamic, _decode_logits_spanned)
    fn = _compiled_decode_logits.get(compile_backend)
    if fn is None:
        fn = _compiled_decode_logits[compile_backend] = torch.compile(_decode_logits_spanned, backend=compile_backend)
    _mark_length_dynamic(cache)
    slots = getattr(cache, "slots", None)

    def step(tok, span):
        if span is None or slots is None:
            return fn(decoder, tok, cache, None)
        view = slots[:span]
        torch._dynamo.maybe_mark_dynamic(view, 0)
        return fn(decoder, tok, cache, view)
    return step, False


def _graph_wanted(decoder, device: torch.device, cuda_graph: bool | None) -> bool:
    """None (auto): on CUDA, for a model with a graph-safe decode step. True where it cannot run is an error."""
    possible = device.type == "cuda" and hasattr(decoder, "decode_compute")
    if cuda_graph and not possible:
        raise ValueError("cuda_graph=True needs a CUDA device and a model with decode_compute (model/decoder.py)")
    return possible if cuda_graph is None else bool(cuda_graph)


def _compile_backend(decoder, device: torch.device, compile_step: bool | str | None, tokens: int) -> str | None:
    """The torch.compile backend for the step, or None. None (auto): inductor on CUDA for a model with
    decode_compute once batch x new tokens reach COMPILE_MIN_TOKENS; True: inductor; a string: that backend."""
    if compile_step is None:
        compile_step = device.type == "cuda" and hasattr(decoder, "decode_compute") and tokens >= COMPILE_MIN_TOKENS
    if not compile_step:
        return None
    if not hasattr(decoder, "decode_compute"):
        raise ValueError("compile_step needs a model with decode_compute (model/decoder.py)")
    return compile_step if isinstance(compile_step, str) else "inductor"


class _DecodeLoop:
    """The device state of one generation and its step: tok (B,) the last token, done (B,) bool, out (B, N),
    col (1,) the next output column; `step(span)` runs model + sampler + bookkeeping with no host sync."""

    def __init__(self, decoder, cache, sampler: Sampler, out: torch.Tensor, eos_id: int | None,
                 compile_backend: str | None):
        self.cache, self.sampler, self.out, self.eos_id = cache, sampler, out, eos_id
        device = out.device
        self.tok = torch.zeros(out.shape[0], dtype=torch.int64, device=device)
        self.done = torch.zeros(out.shape[0], dtype=torch.bool, device=device)
        self.col = torch.zeros(1, dtype=torch.int64, device=device)
        self.model_step, self.advances_itself = _step_fn(decoder, cache, compile_backend)
        # the span a step attends over when `length` tokens are cached; None for a model without spans
        self.span_at = getattr(cache, "span_for", None) if not self.advances_itself else None
        self.graphs: dict = {}
        self.capture_s = 0.0
        self.pool = None  # one memory pool shared by every captured span (they replay one after another, never together)

    def emit(self, nxt: torch.Tensor) -> None:
        if self.eos_id is not None:
            nxt = torch.where(self.done, torch.full_like(nxt, self.eos_id), nxt)
            self.done.logical_or_(nxt == self.eos_id)
        self.out.index_copy_(1, self.col, nxt[:, None])
        self.col += 1
        self.tok.copy_(nxt)

    def step(self, span: int | None) -> None:
        self.emit(self.sampler(self.model_step(self.tok, span)))

    def span(self) -> int | None:
        return self.span_at(self.cache.length) if self.span_at is not None else None

    def spans(self, steps: int) -> list[int | None]:
        """The span of each of the next `steps` steps (host arithmetic on cache.length; nothing runs)."""
        now = self.cache.length
        return [self.span_at(now + i) if self.span_at is not None else None for i in range(steps)]

    def check_room(self) -> None:
        """A clear error before a step the cache has no room for (host-side; any cache with length and max_len)."""
        if self.cache.length + 1 > self.cache.max_len:
            raise ValueError(f"generation cache is full: {self.cache.length} + 1 tokens > "
                             f"max_len={self.cache.max_len}; create it with a larger max_len")

    def run_eager(self) -> None:
        """One real step, host bookkeeping included."""
        if not self.advances_itself:
            self.check_room()
        self.step(self.span())
        if not self.advances_itself:
            self.cache.length += 1

    def capture(self, span, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
        """Record the step for `span` (nothing runs: the device state and cache.length stay where they are)."""
        t0 = time.perf_counter()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream, pool=self.pool):
            self.step(span)
        self.graphs[span] = graph
        self.capture_s += time.perf_counter() - t0
        return graph

    def replay(self, span) -> None:
        """One real step by replaying `span`'s graph."""
        self.check_room()
        self.graphs[span].replay()
        self.cache.length += 1


EAGER, CAPTURE, REPLAY = "eager", "capture", "replay"


def decode_plan(spans: list, warmup: int = WARMUP_STEPS) -> list[str]:
    """What each decode step does under CUDA graphs, from the span each one attends over (None for a model without
    spans): EAGER (it runs), CAPTURE (its span's graph is recorded, then replayed for it) or REPLAY.

    The first `warmup` steps run eagerly; after that a span is captured the first time a step attends over it
    AGAIN, having run eagerly before. So a capture never meets a span for the first time: under torch.compile a
    span that never ran would compile inside the capture, whose first launch synchronises and breaks it."""
    plan, ran, captured = [], set(), set()
    for i, span in enumerate(spans):
        if span in captured:
            plan.append(REPLAY)
        elif i >= warmup and span in ran:
            plan.append(CAPTURE)
            captured.add(span)
        else:
            plan.append(EAGER)
            ran.add(span)
    return plan


@torch.no_grad()
def generate_ids_timed(decoder, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 1.0,
                       top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int = 0,
                       eos_id: int | None = None, pad_id: int = 0, cuda_graph: bool | None = None,
                       sampling_backend: str | None = None,
                       compile_step: bool | str | None = None) -> tuple[torch.Tensor, GenerationTimings]:
    """`generate_ids` plus the per-phase timings. sampling_backend: None (cuda_ops dispatch), "reference"
    or "numba", passed to cuda_ops.sampling.Sampler. compile_step: see _compile_backend."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = decoder.output_weight.device
    use_graph = _graph_wanted(decoder, device, cuda_graph)
    B, longest = len(prompts), max(len(p) for p in prompts)
    backend = _compile_backend(decoder, device, compile_step, B * max_new_tokens)
    left_pad = torch.tensor([longest - len(p) for p in prompts], dtype=torch.int64)
    idx = torch.full((B, longest), pad_id, dtype=torch.int64)
    for i, p in enumerate(prompts):
        idx[i, longest - len(p):] = torch.tensor(p, dtype=torch.int64)
    idx, left_pad = idx.to(device), left_pad.to(device)  # one copy each, not one per prompt
    out = torch.empty(B, max_new_tokens, dtype=torch.int64, device=device)
    seeds = torch.arange(B, dtype=torch.int64, device=device) + seed  # an independent stream per row
    V = decoder.output_weight.shape[0]
    sampler = Sampler(B, V, device=device, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                      seed=seeds, backend=sampling_backend, graph=False)  # captured into the step's graph instead

    _sync(device)
    t0 = time.perf_counter()
    ragged = longest > min(len(p) for p in prompts)
    cache = decoder.new_kv_cache(B, longest + max_new_tokens, left_pad=left_pad if ragged else None)
    _sync(device)
    cache_s = time.perf_counter() - t0
    chunks = [(a, min(a + PREFILL_CHUNK, longest)) for a in range(0, longest, PREFILL_CHUNK)]
    for a, b in chunks:  # one forward for a prompt up to PREFILL_CHUNK tokens (see "Long prompts" above)
        hidden = decoder(idx[:, a:b], kv_cache=cache)
    logits = decoder.logits(hidden[:, -1])  # (B, V) fp32: the last position only
    _sync(device)
    t1 = time.perf_counter()
    loop = _DecodeLoop(decoder, cache, sampler, out, eos_id, backend)
    loop.emit(sampler(logits))  # token 0 (step 0 of every row's stream)
    _sync(device)
    first_sample_s = time.perf_counter() - t1
    steps = max_new_tokens - 1
    plan = decode_plan(loop.spans(steps)) if use_graph else [EAGER] * steps
    side = torch.cuda.Stream(device) if use_graph else None
    # warm-up: the steps up to the first capture (all of them when nothing is captured: then one, as timing goes)
    warm = plan.index(CAPTURE) if CAPTURE in plan else min(steps, WARMUP_STEPS if use_graph else 1)
    failed = False  # a capture failed: every later step runs eagerly (always correct)
    t2 = cpu2 = None
    first_step_s = 0.0
    for i, action in enumerate(plan):
        if i == warm:
            _sync(device)
            t2, cpu2 = time.perf_counter(), time.process_time()
        span = loop.span()
        if failed:
            action = EAGER
        if action == CAPTURE:
            try:
                side.wait_stream(torch.cuda.current_stream(device))
                loop.capture(span, side)
            except RuntimeError as exc:
                _sync(device)
                warnings.warn(f"CUDA-graph capture of the decode step failed, decoding eagerly: {exc}", stacklevel=2)
                failed, action = True, EAGER
                loop.graphs.clear()
        if action != EAGER:
            loop.replay(span)
        elif side is not None:  # a graphed generation's eager steps run on the side stream, as its captures do
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                loop.run_eager()
            torch.cuda.current_stream(device).wait_stream(side)
        else:
            loop.run_eager()
        if i == 0:
            _sync(device)
            first_step_s = time.perf_counter() - (t1 + first_sample_s)
    if t2 is None:  # too few steps to reach the decode phase
        _sync(device)
        t2, cpu2 = time.perf_counter(), time.process_time()
    graphed = bool(loop.graphs)
    _sync(device)
    t3, cpu3 = time.perf_counter(), time.process_time()
    timings = GenerationTimings(prefill_tokens=sum(map(len, prompts)), prefill_s=t1 - t0,
                                warmup_tokens=B * (1 + warm), warmup_s=t2 - t1,
                                decode_tokens=B * (steps - warm), decode_s=t3 - t2,
                                decode_cpu_s=cpu3 - cpu2, cuda_graph=graphed, compiled=backend is not None,
                                graphs=len(loop.graphs), cache_s=cache_s, prefill_chunks=len(chunks),
                                first_sample_s=first_sample_s, first_step_s=first_step_s, capture_s=loop.capture_s)
    return out, timings


def generate_ids(decoder, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int = 0,
                 eos_id: int | None = None, pad_id: int = 0, cuda_graph: bool | None = None,
                 sampling_backend: str | None = None, compile_step: bool | str | None = None) -> torch.Tensor:
    """(B, max_new_tokens) int64 new tokens for token-id prompts (rows finished at EOS are padded with eos_id).

    temperature 0 is greedy. Prompts are left-padded to the longest; the cache hides the pads. cuda_graph: None
    (auto: on CUDA for a model with decode_compute), True or False. compile_step: None (auto: on CUDA for long
    generations, see COMPILE_MIN_TOKENS), True / False, or a torch.compile backend name.
    """
    ids, _ = generate_ids_timed(decoder, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                                top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, eos_id=eos_id, pad_id=pad_id,
                                cuda_graph=cuda_graph, sampling_backend=sampling_backend, compile_step=compile_step)
    return ids


def generation_autocast(decoder):
    """bf16 autocast for an fp32 model on CUDA (the residual stream stays fp32, matmuls and the KV cache run in
    bf16); a no-op on CPU and for a model already in bf16."""
    weight = decoder.output_weight
    enabled = weight.device.type == "cuda" and weight.dtype == torch.float32
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=enabled) if enabled else contextlib.nullcontext()
