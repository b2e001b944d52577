"""The one training engine: model, AdamW, warmup + cosine, accumulation, clipping, non-finite guard,
metrics, evaluation and the full training state. No Ray, no MLflow: Ray Train (pipeline/train/ray_train.py)
and the benchmarks (bench/engine_throughput.py) both drive this same code.

    from pipeline.train.engine import Engine
    engine = Engine(cfg, vocab_size=manifest.vocab_size)
    outcome = engine.train_step([batch])          # one optimizer step over grad_accum micro-batches
    engine.save("ckpt/step_00050"); engine.load("ckpt/step_00050")

Under a process group (Ray Train workers, or torch.distributed in tests and benchmarks) the engine shares the
model across the workers by DDP or FSDP2 (train.parallel; pipeline/train/distributed/parallel.py); without one it is the
plain one-process engine. With train.context_parallel_degree = d the workers form a (data x context) mesh and each
row is split over d of them (pipeline/train/distributed/context_parallel.py): the model gets the whole row and a
RowSplit, returns this rank's tokens, and the loss is scaled so that DDP's or FSDP's mean over all the ranks is the
mean over every data rank's whole rows: cp = 2 trains as cp = 1. Checkpoint layouts and loaders: pipeline/train/checkpoints/state.py. The loop that feeds it
(epochs, cursor, logging, evaluation, checkpoints) is pipeline/train/loop.py.
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
import torch.nn as nn

from cuda_ops.cross_entropy import linear_cross_entropy
from cuda_ops.metrics import TokenMetrics
from model.decoder import build_model
from model.flops import (attention_flops_per_pair, causal_pairs, matmul_flops_per_token,
                         within_document_causal_pairs)
from model.flops import feed_forward_params, flops_per_token, resonance_flops_per_token
from model.context import NOT_SPLIT, RowSplit
from model.layers import checkpointed_layers
from model.rope import RopeConfig
from model.tiers import get_mixer_tier
from pipeline.config import Config, model_tier
from pipeline.eval.positions import token_losses
from pipeline.tracking import names
from pipeline.train.checkpoints import state as checkpoint
from pipeline.train.checkpoints.state import (CHECKPOINT_FORMAT, CheckpointError, check_checkpoint_fits,  # noqa: F401
                                       read_checkpoint_meta)
from pipeline.train.memory.hardware import autocast_dtype, configure_cuda_math, default_device, peak_flops, peak_memory_gib
from pipeline.train.memory.limit import MemoryLimit
from pipeline.train.memory.plan import shape_of
from pipeline.train.moe_balance import MoEBalance
from pipeline.train.distributed.context_parallel import ContextMesh
from pipeline.train.distributed.parallel import resolve_parallel, shard_model
from pipeline.train.spike_detector import SpikeSettings, Verdict
from pipeline.train.spike_guard import RewindDue, SpikeGuard

# Steady state: train/steady_tokens_per_s and train/steady_mfu leave out the first optimizer steps an Engine takes
# in its process (torch.compile of every block, the allocator's and autotuners' first shapes) and count only the
# time inside optimizer steps (not the data waits between them, evaluation, checkpoints or logging).
STEADY_AFTER_STEPS = 3
IGNORE_INDEX = -100  # linear_cross_entropy's default: targets of padding rows


class NonFiniteLossError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""


class LossModule(nn.Module):
    """Decoder + fused projection/cross-entropy head, so DDP wraps one forward that returns the loss.

    forward(tokens (B, T+1) int64, doc_ids (B, T+1) int32 | None, pad (B,) bool | None)
        -> CEResult(loss_sum, n_tokens, n_correct); rows flagged in `pad` (an evaluation batch filled up to its
        shape, pipeline/data/shards.py eval_reader) run through the model but count no token.
    per_token=True returns the (B, T) fp32 loss of every target instead (0 in `pad` rows), projected in chunks
    (pipeline/eval/positions.py: loss by position in the document); through this forward, so FSDP gathers as usual.
    `context` (model/context.py): a row split over ranks. Labels are shifted on the whole row, the model gets the
    whole row and returns this rank's tokens, the result counts only those (per_token: the whole row's losses, on
    every rank of the context group).
    """

    def __init__(self, decoder: nn.Module, ce_chunk_size: int, context: RowSplit = NOT_SPLIT):
        super().__init__()
        self.decoder = decoder
        self.ce_chunk_size = ce_chunk_size
        self.context = context

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None, pad: torch.Tensor | None = None,
                per_token: bool = False):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]  # (B, T) each: labels shifted on the whole row
        if pad is not None:
            targets = targets.masked_fill(pad[:, None], IGNORE_INDEX)
        doc = doc_ids[:, :-1] if doc_ids is not None else None
        if self.context.degree > 1:
            hidden = self.decoder(inputs, doc, context=self.context)  # (B, T/d, D): this rank's tokens
            targets = self.context.take(targets)  # (B, T/d), in the same order
        else:
            hidden = self.decoder(inputs, doc)  # (B, T, D)
        if per_token:
            losses = token_losses(hidden, self.decoder.output_weight, targets, self.ce_chunk_size)  # (B, T/d)
            return self.context.whole(losses)  # (B, T)
        return linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), self.decoder.output_weight,
                                    targets.reshape(-1), chunk_size=self.ce_chunk_size)


@dataclass
class StepOutcome:
    step: int  # optimizer steps taken so far (after this one, if it counted)
    skipped: bool  # non-finite loss or gradient, or a loss spike skipped: no update was applied
    sequences: int  # sequences this worker consumed in the step
    tokens: int  # tokens of the rows this worker trained on in the step (its share under context parallelism)
    spike: Verdict | None = None  # the spike detector's view of the step (None when train.spike_action=off)
    rewind: RewindDue | None = None  # a rewind the spike guard calls for (pipeline/train/spike_rewind.py makes it)


def lr_lambda(step: int, warmup: int, total: int, min_ratio: float, rewarmup_start: int = 0,
              rewarmup_steps: int = 0) -> float:
    """Linear warmup from 1/warmup to 1, then cosine from 1 to min_ratio at `total` steps. A re-warmup (a phase's
    lr_warmup_steps, PhaseSchedule) multiplies that one schedule by a ramp from 1/rewarmup_steps to 1 over the steps
    [rewarmup_start, rewarmup_start + rewarmup_steps): the cosine goes on underneath, there is no second schedule."""
    if warmup > 0 and step < warmup:
        factor = (step + 1) / warmup
    else:
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        factor = min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if rewarmup_steps > 0 and rewarmup_start <= step < rewarmup_start + rewarmup_steps:
        factor *= (step - rewarmup_start + 1) / rewarmup_steps
    return factor


@dataclass(frozen=True)
class PhaseSchedule:
    """Where the running phase starts in the one schedule, and what happens there (pipeline/train/session/train_session.py)."""
    start_step: int = 0  # the optimizer step the phase starts at (the steps of the phases before it)
    lr_warmup_steps: int = 0  # > 0: the learning rate ramps up again over this many steps from start_step
    reset_optimizer: bool = False  # AdamW's moments start from zero at start_step (the weights carry over)


_ROPE_NOTED = False  # the resonance family's "no RoPE" note is printed once per process


def model_rope(cfg: Config, *, say: bool = True, tier=None) -> RopeConfig | None:
    """The RoPE base and scaling cfg.model asks for (model/rope.py RopeConfig), for build_model. The resonance
    family has no RoPE: None, and, when model.rope_* differ from their defaults, a note printed once per process
    (`say`: rank 0 only, under Ray Train). `tier`: cfg's tier where the caller resolved it already."""
    global _ROPE_NOTED
    m = cfg.model
    if m.mixer != "attention":
        if say and not _ROPE_NOTED and (m.rope_theta != 0 or m.rope_scaling != "none"):
            _ROPE_NOTED = True
            print(f"note: model.mixer={m.mixer} has no RoPE; model.rope_theta and model.rope_scaling are ignored",
                  flush=True)
        return None
    tier = tier or get_mixer_tier(m.tier, m.mixer)
    return RopeConfig(theta=m.rope_theta or tier.rope_base, scaling=m.rope_scaling, factor=m.rope_factor,
                      original_max_len=m.rope_original_max_len, beta_fast=m.rope_beta_fast,
                      beta_slow=m.rope_beta_slow, low_freq_factor=m.rope_low_freq_factor,
                      high_freq_factor=m.rope_high_freq_factor)


class Engine:
    """Owns one worker's model, optimizer, scheduler and counters.

    `parallel` (none | ddp | fsdp) overrides what train.parallel and the process group decide
    (pipeline/train/distributed/parallel.py). `module` is the LossModule itself (sharded in place under FSDP), `model` what
    a training forward calls (the DDP wrapper under DDP); saving and evaluation use `module`. `context` overrides
    train.context_parallel_degree (1: whole rows in this process, as evaluation and generation from a checkpoint run).
    world_size counts every worker; data_world_size the data-parallel ranks (world_size / the degree): the workers
    that read distinct rows.
    """

    # The timer of train/tokens_per_s and the steady-state figures (seconds, monotonic). A test swaps it for a clock
    # it drives (tests/pipeline/train/test_engine.py) to check those figures exactly, whatever the machine's load.
    clock = staticmethod(time.perf_counter)

    def __init__(self, cfg: Config, vocab_size: int, device: torch.device | None = None, *, rank: int = 0,
                 world_size: int = 1, parallel: str | None = None, context: int | None = None,
                 experts: int | None = None):
        self.cfg, self.vocab_size = cfg, vocab_size
        self.device = device or default_device()
        self.rank, self.world_size = rank, world_size
        configure_cuda_math()
        torch.manual_seed(cfg.train.seed)  # identical initial weights on every worker and every run
        # The tier and everything the memory model needs, resolved once here and handed on (the model, RoPE, FLOPs,
        # the choice of DDP or FSDP): pipeline/train/memory/plan.py Shape
        self.shape = shape_of(cfg, vocab_size, self.device.type)
        tier = self.shape.tier
        decoder = build_model(tier, vocab_size, mixer=cfg.model.mixer, rope=model_rope(cfg, say=rank == 0, tier=tier),
                              tie_embeddings=cfg.model.tie_embeddings, doc_masking=cfg.model.doc_masking,
                              attention=cfg.model.attention, activation_checkpointing=cfg.model.activation_checkpointing)
        decoder.to(self.device)
        self.n_params = sum(p.numel() for p in decoder.parameters())  # every expert counted, whatever the split
        cp_degree = cfg.train.context_parallel_degree if context is None else context
        ep_degree = cfg.train.expert_parallel_degree if experts is None else experts
        # Expert parallelism: every rank built the whole model from the same seed and keeps its block of experts
        # (pipeline/train/distributed/expert_parallel.py); before compile and before DDP or FSDP see the parameters
        self.experts = None
        if ep_degree > 1:
            from pipeline.train.distributed.expert_parallel import ExpertMesh, ExpertParallel

            self.experts = ExpertParallel.split(
                ExpertMesh.build(ep_degree, cp_degree, self.device.type, cfg.train.collective_timeout_s), decoder)
        if cfg.model.compile == "on" or (cfg.model.compile == "auto" and self.device.type == "cuda"):
            decoder.compile_blocks()  # before sharding: FSDP's hooks stay outside the compiled graphs
        self.moe = MoEBalance.for_model(decoder, cfg, self.device)  # a mixture of experts' aux losses, bias, metrics
        self.amp_dtype = autocast_dtype(cfg.train.precision, self.device)
        # The (data x context) mesh: every rank builds it here (it creates the context groups), before the model is
        # shared over all the ranks (DDP or FSDP over data x context); one line when the workers cannot form it
        self.mesh = ContextMesh.build(cp_degree, self.device.type)
        self.data_world_size = max(1, world_size // self.mesh.degree)
        self.counts_rows = self.mesh.context_rank == 0  # a row's per-token statistics: once per context group
        self.module = LossModule(decoder, cfg.train.ce_chunk_size, self.mesh.split(decoder.CONTEXT_LAYOUT))
        if parallel is None:
            self.parallel, self.parallel_reason = resolve_parallel(cfg, vocab_size, self.device, shape=self.shape)
        else:
            self.parallel, self.parallel_reason = parallel, "set by the caller"
        if (self.mesh.degree > 1 or self.experts is not None) and self.parallel == "none":  # gradients must be reduced
            raise ValueError("context and expert parallelism need DDP or FSDP over their workers (parallel='none' "
                             "was asked)")
        self.model = shard_model(self.module, self.parallel, self.device, self.amp_dtype, experts=self.experts)
        # sharded: the checkpoint is written by every worker (sharded layout), under FSDP and with split experts
        self.sharded = self.parallel == "fsdp" or self.experts is not None
        if cfg.model.mixer == "resonance":  # FFT, reference scan or scan kernel, as the model runs it (model/flops.py)
            self.flops_per_token = resonance_flops_per_token(tier, cfg.data.seq_len, vocab_size,
                                                             form=decoder.training_form(self.device))
        else:
            self.flops_per_token = flops_per_token(tier, cfg.data.seq_len, vocab_size,
                                                   tie_embeddings=cfg.model.tie_embeddings)
        self.peak_flops = peak_flops(self.device)
        # train/mfu counts the FLOPs computed: matmuls plus the (query, key) pairs each batch's attention computed
        # (within documents under doc masking; model/flops.py), summed on the device. train/mfu_causal_equiv keeps
        # the whole-row convention, flops_per_token. A model without attention counts flops_per_token for both.
        counts_pairs = getattr(cfg.model, "mixer", "attention") == "attention"
        self.attention_flops_per_pair = attention_flops_per_pair(tier) if counts_pairs else 0
        self.matmul_flops_per_token = (matmul_flops_per_token(tier, vocab_size) if counts_pairs
                                       else self.flops_per_token)
        # train/hfu also counts the forward activation checkpointing runs again in backward: a third (the forward's
        # share of training) of the checkpointed blocks' FLOPs -- every block's matmuls and attention, not the
        # output projection's 6 V D per token
        if cfg.model.activation_checkpointing == "mixer":  # resonance: every block's mixer half, by its matmuls
            mix = 3 * tier.d_model ** 2 + 4 * tier.d_model * tier.n_eigen
            self.recompute_fraction = mix / (mix + feed_forward_params(tier, active=True) / tier.n_layers) / 3
        else:
            n_ckpt = len(checkpointed_layers(cfg.model.activation_checkpointing, tier.n_layers))
            self.recompute_fraction = n_ckpt / tier.n_layers / 3
        self.block_flops_per_token = self.matmul_flops_per_token - 6 * vocab_size * tier.d_model
        self._interval_attention_pairs = torch.zeros((), dtype=torch.int64, device=self.device)
        self._interval_steady_pairs = torch.zeros((), dtype=torch.int64, device=self.device)  # STEADY_AFTER_STEPS
        # train.memory_limit_gib > 0: steps fail with torch.OutOfMemoryError as on a device of that size.
        self.memory_limit = MemoryLimit.for_device(cfg.train.memory_limit_gib, self.device)

        # Weight decay on matrices only: norms' gains stay free. param_names lists the optimizer's parameters in
        # its own order (train_state.pt numbers them by position; checkpoint.py names them).
        named = list(self.module.named_parameters())
        decay = [(n, p) for n, p in named if p.ndim >= 2]
        no_decay = [(n, p) for n, p in named if p.ndim < 2]
        self.param_names = [n for n, _ in decay + no_decay]
        decay, no_decay = [p for _, p in decay], [p for _, p in no_decay]
        t = cfg.train
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=t.lr, betas=(t.beta1, t.beta2), fused=self.device.type == "cuda")
        # A closure over self.schedule (not a bound method): LambdaLR then leaves it out of its state_dict, and a
        # phase's re-warmup (start_phase) takes effect without rebuilding the scheduler.
        self.schedule = PhaseSchedule()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_lambda(s, t.warmup_steps, t.max_steps, t.min_lr_ratio,
                                                self.schedule.start_step, self.schedule.lr_warmup_steps))

        # Counters that make up the training state besides the tensors.
        self.step = 0
        self.epoch = 0
        self.cursor = 0  # global sequences consumed in the current epoch (all workers); advanced by the loop
        self.tokens_seen = 0  # global tokens trained on
        self.bad_steps_in_row = 0
        self.bad_steps_total = 0
        self.phase = 0
        # Loss spikes: detection in the step's own sync, what an outlier does, the rows rewinds skipped (train.spike_*)
        self.spikes = SpikeGuard(SpikeSettings.of(t), self.device)

        # Metrics live on the device until a log interval pulls them (one host transfer).
        self.train_metrics = TokenMetrics(self.device)
        self._last_grad_norm = torch.zeros((), device=self.device)
        self._interval_start = self.clock()
        self._interval_tokens = 0
        self._steps_run = 0  # train_step calls in this process (a resumed run compiles again)
        self._steady_step = False  # whether the step running now counts as steady state
        self._steady = {"steps": 0, "tokens": 0, "seconds": 0.0, "attention_pairs": 0.0}
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def start_phase(self, schedule: PhaseSchedule, fresh: bool) -> None:
        """Enter a phase of the one schedule (call after load). `fresh`: the phase starts here, from the previous
        phase's state (not a resume inside it), so reset_optimizer clears AdamW's moments now; either way the
        learning rate follows the schedule with the phase's re-warmup from the current step on. Every worker calls
        it (no collectives: under FSDP each clears its own shards' moments)."""
        self.schedule = schedule
        if fresh and schedule.start_step > 0:  # a later phase's data: the spike window warms up again
            self.spikes.new_phase()
        if fresh and schedule.reset_optimizer:
            self.optimizer.state.clear()  # AdamW recreates zero moments (and its step count) at the next step
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
            group["lr"] = base * self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    # ------------------------------------------------------------------------------------------ step
    def _autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def _to_device(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        tokens = batch["tokens"].to(self.device, non_blocking=True)
        doc_ids = batch.get("doc_ids")
        if doc_ids is not None and self.cfg.model.doc_masking:
            doc_ids = doc_ids.to(self.device, non_blocking=True)
        else:
            doc_ids = None
        return tokens, doc_ids

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> StepOutcome:
        """One optimizer step over len(micro_batches) micro-batches (gradient accumulation).

        The loss is the token mean over the whole step. One host sync per step decides whether the
        step is finite; a non-finite loss or gradient zeroes the gradients, applies no update (the
        weights, optimizer and scheduler stay as they were) and is counted. The same transfer carries the spike
        detector's verdict (pipeline/train/spike_detector.py): an outlier is skipped in the same way (or applied,
        train.spike_action=apply), and the outcome says when the guard calls for a rewind.
        """
        self.model.train()
        steady, start = self._steps_run >= STEADY_AFTER_STEPS, self.clock()
        self._steady_step = steady  # _count_attention_pairs adds to the steady-state count too
        if self.memory_limit is not None:
            with self.memory_limit.during(self.module, self.optimizer):
                outcome = self._train_step(micro_batches)
        else:
            outcome = self._train_step(micro_batches)
        self._steps_run += 1
        if steady:  # the step's one host sync makes its time honest to within the optimizer update it queued
            self._steady["steps"] += 1
            self._steady["tokens"] += outcome.tokens * self.data_world_size
            self._steady["seconds"] += self.clock() - start
        return outcome

    def _train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> StepOutcome:
        n_micro = len(micro_batches)
        loss_total = torch.zeros((), device=self.device)
        seqs = toks = 0
        for i, batch in enumerate(micro_batches):
            tokens, doc_ids = self._to_device(batch)
            # DDP: all-reduce gradients only on the last micro-batch.
            sync = i == n_micro - 1 or not hasattr(self.model, "no_sync")
            with (contextlib.nullcontext() if sync else self.model.no_sync()), self._autocast():
                res = self.model(tokens, doc_ids)
                if self.mesh.degree == 1:
                    loss = res.loss_sum / res.n_tokens.clamp(min=1) / n_micro
                else:  # this rank's share of the whole rows' mean, x d: the mean over the d ranks is the rows' mean
                    row_tokens = tokens.shape[0] * (tokens.shape[1] - 1)
                    loss = res.loss_sum * (self.mesh.degree / row_tokens / n_micro)
                if self.moe is not None:  # load balancing and router z-loss (pipeline/train/moe_balance.py)
                    loss = loss + self.moe.loss(n_micro)
            loss.backward()
            loss_total += loss.detach()
            self.train_metrics.add(res.loss_sum.detach(), res.n_tokens, res.n_correct)
            self._count_attention_pairs(tokens, doc_ids)
            seqs += tokens.shape[0]
            toks += tokens.shape[0] * (tokens.shape[1] - 1)
        clip = self.cfg.train.grad_clip if self.cfg.train.grad_clip > 0 else float("inf")
        if self.experts is not None:  # split experts: their gradients summed over their replicas, one global norm
            self.experts.reduce_gradients()
            grad_norm = self.experts.clip_grad_norm(self.module.parameters(), clip)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), clip, foreach=True)
        if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor, already reduced over the shards
            grad_norm = grad_norm.full_tensor()
        verdict = due = None
        hold = False  # a loss spike that applies no update
        guard = self.spikes
        if guard.enabled:  # the verdict rides on the step's one sync (7 numbers instead of 1 flag)
            loss_all = self._mean_over_ranks(loss_total)  # every rank decides on the same numbers
            verdict = guard.detector.verdict(guard.detector.measure(loss_all, grad_norm).tolist())
            finite = verdict.finite
            hold, due = guard.observe(verdict, self.step)
        else:
            finite = bool(torch.isfinite(loss_total) & torch.isfinite(grad_norm))  # the step's one sync
        if finite and not hold:
            self.optimizer.step()
            self.scheduler.step()
            self.step += 1
            self.bad_steps_in_row = 0
            self._last_grad_norm = grad_norm.detach()
            if verdict is not None and not verdict.outlier:
                guard.detector.record(loss_all, grad_norm)  # a device copy into the window
        elif not finite:
            self.bad_steps_in_row += 1
            self.bad_steps_total += 1
        if self.moe is not None:
            self.moe.after_step(finite)  # the selection bias follows the step's load (model.moe_balance=bias)
        self.optimizer.zero_grad(set_to_none=True)
        self.tokens_seen += toks * self.data_world_size
        self._interval_tokens += toks * self.data_world_size
        if self.bad_steps_in_row >= self.cfg.train.max_bad_steps:
            raise NonFiniteLossError(
                f"{self.bad_steps_in_row} optimizer steps in a row had a non-finite loss or gradient "
                f"(at step {self.step}); the run stopped and its last checkpoint is untouched. Lower "
                f"train.lr (now {self.cfg.train.lr}), raise train.warmup_steps, or check the data.")
        return StepOutcome(self.step, not finite or hold, seqs, toks, verdict, due)

    def _mean_over_ranks(self, loss: torch.Tensor) -> torch.Tensor:
        """This rank's step loss averaged over every rank (one all-reduce of one number on the device's stream, no
        host sync): the mean over the data ranks' rows, under context parallelism too (each rank's share is scaled
        so that the mean over all ranks is the rows' mean)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return loss
        total = loss.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total / dist.get_world_size()

    def _count_attention_pairs(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None) -> None:
        """Add the (query, key) pairs this micro-batch's attention computes to an on-device counter: causal pairs
        within each document under doc masking, the whole causal row without. Queued device ops, no host sync.
        tokens, doc_ids: (B, T+1) as the batch carries them; the model sees the first T of each row."""
        if not self.attention_flops_per_pair or self.mesh.context_rank:  # a row's pairs counted once per group
            return
        if doc_ids is not None:
            pairs = within_document_causal_pairs(doc_ids[:, :-1])
        else:
            pairs = tokens.shape[0] * causal_pairs(tokens.shape[1] - 1)
        self._interval_attention_pairs += pairs
        if self._steady_step:
            self._interval_steady_pairs += pairs

    def _pull_grad_norm_pairs_and_peak(self) -> tuple[float, float, float, float]:
        """The last gradient norm, the interval's attention pairs (all steps', steady-state steps'; all workers) and
        the peak memory in GiB (the largest of any worker) in one device-to-host copy; resets the pair counters.
        Under DDP a collective, like TokenMetrics.all_reduce."""
        import torch.distributed as dist

        pairs = torch.stack([self._interval_attention_pairs, self._interval_steady_pairs])
        peak = torch.tensor([self.memory_limit.peak_gib() if self.memory_limit is not None
                             else peak_memory_gib(self.device)], dtype=torch.float64, device=self.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(pairs, op=dist.ReduceOp.SUM)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            scale = 1
        else:
            scale = self.data_world_size  # as tokens are counted: every worker runs batches of the same shape
        grad_norm, pairs_all, pairs_steady, peak_gib = torch.cat(
            [self._last_grad_norm.double().reshape(1), pairs.double(), peak]).tolist()
        self._interval_attention_pairs.zero_()
        self._interval_steady_pairs.zero_()
        return grad_norm, pairs_all * scale, pairs_steady * scale, peak_gib

    def pull_train_metrics(self) -> dict[str, float]:
        """Metrics over the steps since the last pull: one host sync; resets the interval.

        train/executed_flops_per_token: FLOPs computed per token in the interval (matmuls plus the attention pairs
        the batches' documents allowed); train/mfu: those FLOP/s over the device's peak; train/mfu_causal_equiv:
        the whole-row causal convention (flops_per_token x tokens/s over the peak). MFU only where the peak is
        known (not on a CPU). train/steady_tokens_per_s and train/steady_mfu: the same over every step since the
        first STEADY_AFTER_STEPS of this process, inside the steps only (train/steady_steps of them; absent until
        there is one). train/peak_mem_gib: the largest of any worker since the engine started."""
        self.train_metrics.all_reduce()
        m = self.train_metrics.pull()
        grad_norm, attention_pairs, steady_pairs, peak_gib = self._pull_grad_norm_pairs_and_peak()
        moe, dropped_flops = self.moe.pull(self.step) if self.moe is not None else ({}, 0.0)
        self._steady["attention_pairs"] += steady_pairs
        now = self.clock()
        elapsed = max(now - self._interval_start, 1e-9)
        tokens_per_s = self._interval_tokens / elapsed
        out = {
            names.TRAIN_LOSS: m["loss"], names.TRAIN_PPL: m["ppl"], names.TRAIN_ACCURACY: m["accuracy"],
            names.TRAIN_LR: self.scheduler.get_last_lr()[0], names.TRAIN_GRAD_NORM: grad_norm,
            names.TRAIN_TOKENS_PER_S: tokens_per_s, names.TRAIN_TOKENS_PER_S_PER_GPU: tokens_per_s / self.world_size,
            names.TRAIN_TOKENS_SEEN: float(self.tokens_seen),
            names.TRAIN_PEAK_MEM_GIB: peak_gib, names.TRAIN_BAD_STEPS: float(self.bad_steps_total),
        }
        if self.spikes.enabled:
            out[names.TRAIN_SPIKE_SKIPS] = float(self.spikes.skips)
            out[names.TRAIN_SPIKE_REWINDS] = float(len(self.spikes.rewinds))
        executed = (self.matmul_flops_per_token * self._interval_tokens + self.attention_flops_per_pair
                    * attention_pairs - dropped_flops)  # FLOPs computed (MoE: the experts that ran) in the interval
        out[names.TRAIN_EXECUTED_FLOPS_PER_TOKEN] = executed / max(self._interval_tokens, 1)
        out[names.TRAIN_TFLOPS_PER_GPU] = executed / elapsed / self.world_size / 1e12
        if self.peak_flops:  # MFU only where the device's peak is known (not on a CPU)
            out[names.TRAIN_MFU] = executed / elapsed / (self.peak_flops * self.world_size)
            recomputed = self.recompute_fraction * (self.block_flops_per_token * self._interval_tokens
                                                    + self.attention_flops_per_pair * attention_pairs)
            out[names.TRAIN_HFU] = (executed + recomputed) / elapsed / (self.peak_flops * self.world_size)
            out[names.TRAIN_MFU_CAUSAL_EQUIV] = (self.flops_per_token * tokens_per_s
                                                 / (self.peak_flops * self.world_size))
        st = self._steady
        if st["steps"]:
            seconds = max(st["seconds"], 1e-9)
            out[names.TRAIN_STEADY_TOKENS_PER_S] = st["tokens"] / seconds
            out[names.TRAIN_STEADY_STEPS] = float(st["steps"])
            if self.peak_flops:
                steady_executed = (self.matmul_flops_per_token * st["tokens"]
                                   + self.attention_flops_per_pair * st["attention_pairs"])
                out[names.TRAIN_STEADY_MFU] = steady_executed / seconds / (self.peak_flops * self.world_size)
        out.update(moe)
        self._interval_start, self._interval_tokens = now, 0
        return out

    @torch.no_grad()
    def evaluate(self, batches: Iterable[dict[str, torch.Tensor]], max_batches: int | None = None) -> dict[str, float]:
        """Mean validation loss, perplexity and next-token accuracy over `batches` (all workers' tokens). Rows a
        batch flags in `pad` are not counted (the short last batch of eval_reader)."""
        self.module.eval()
        metrics = TokenMetrics(self.device)
        for i, batch in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            tokens, doc_ids = self._to_device(batch)
            pad = batch.get("pad")
            with self._autocast():
                res = self.module(tokens, doc_ids, pad.to(self.device) if pad is not None else None)
            metrics.add(res.loss_sum.detach(), res.n_tokens, res.n_correct)
        metrics.all_reduce()
        m = metrics.pull()
        return {names.VAL_LOSS: m["loss"], names.VAL_PPL: m["ppl"], names.VAL_ACCURACY: m["accuracy"]}

    # ------------------------------------------------------------------------------------- state I/O
    def counters(self) -> dict[str, Any]:
        return {"step": self.step, "epoch": self.epoch, "cursor": self.cursor, "tokens_seen": self.tokens_seen,
                "bad_steps_in_row": self.bad_steps_in_row, "bad_steps_total": self.bad_steps_total,
                "phase": self.phase, "spikes": self.spikes.state_dict()}

    def save(self, directory: str | os.PathLike, extra: dict[str, Any] | None = None) -> Path:
        """Write the full training state to `directory` atomically: the full layout (model.safetensors,
        train_state.pt, meta.json; rank 0 writes it) or, under FSDP, the sharded layout (every worker writes its
        shards; all must call). pipeline/train/checkpoints/state.py describes both."""
        return checkpoint.save(self, directory, extra)

    def load(self, directory: str | os.PathLike, weights_only_model: bool = False,
             meta: dict[str, Any] | None = None) -> dict[str, Any]:
        """Restore the state written by save(), from either layout and any worker count, from a local directory
        or object storage; returns meta.json. Checks tier, vocabulary and model family first."""
        return checkpoint.load(self, directory, weights_only_model, meta)

    @contextlib.contextmanager
    def full_model(self) -> Iterator[nn.Module]:
        """The decoder with whole (unsharded) parameters inside the block, for generation at evaluation steps.

        Under FSDP every worker must enter it (the parameters are all-gathered on entry and freed on exit), and what
        it yields is NOT the sharded module but a plain twin built on the meta device whose parameters and buffers
        are the gathered tensors themselves (no copy): running it fires no FSDP hook. That matters because only
        rank 0 generates. A forward through the sharded modules on one rank alone would record that rank's own
        forward order (FSDP's post_forward_order), and its next backward would prefetch, all-gather, a unit the
        other ranks never gather: a hang. With the twin, the collectives are the unshard and reshard here, which
        every rank runs in the same order."""
        if not self.sharded:
            yield self.module.decoder
            return
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in self.module.modules() if isinstance(m, FSDPModule)]
        for unit in units:
            unit.unshard()
        try:  # split experts: every rank gathers the whole (E, ...) weights; the twin's MoE layers hold them all
            whole = self.experts.whole_weights() if self.experts is not None else {}
            yield _hookless_twin(self.module.decoder, self.cfg, whole)
        finally:
            for unit in units:
                unit.reshard()


def announce_kernels(engine: Engine, tracker=None, say=print) -> str:
    """Once per run (rank 0): the backend each cuda_ops kernel family runs on this worker's device, and why when it
    is not the Numba one, on the console and as the MLflow tag longtrain.kernels. A GPU node whose numba-cuda finds
    no NVVM says so here instead of quietly training on the reference path."""
    from cuda_ops.dispatch import describe_backends

    line = describe_backends(engine.device)
    say(f"kernels: {line}")
    if tracker is not None:
        from pipeline.tracking.names import KERNELS_TAG

        tracker.set_tags({KERNELS_TAG: line})
    return line


def _hookless_twin(decoder: nn.Module, cfg: Config, whole: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """A plain (unsharded, uncompiled) decoder of the same tier whose parameters and buffers ARE `decoder`'s current
    tensors: built on the meta device, then every tensor slot pointed at the original's. Call it while the sharded
    decoder's parameters are unsharded; drop it before they are resharded (their storage is freed then). `whole`:
    tensors that take the place of `decoder`'s by name (split experts' whole weights; the twin holds every expert
    and dispatches locally)."""
    whole = whole or {}
    with torch.device("meta"):
        twin = build_model(model_tier(cfg), decoder.vocab_size, mixer=cfg.model.mixer, rope=model_rope(cfg, say=False),
                           tie_embeddings=cfg.model.tie_embeddings, doc_masking=cfg.model.doc_masking,
                           attention=cfg.model.attention)
    for name, tensor in [*decoder.named_parameters(), *decoder.named_buffers()]:
        tensor = whole.get(name, tensor)
        owner, _, leaf = name.rpartition(".")
        module = twin.get_submodule(owner) if owner else twin
        slots = module._parameters if leaf in module._parameters else module._buffers
        slots[leaf] = nn.Parameter(tensor.detach(), requires_grad=False) if slots is module._parameters else tensor
    left = [n for n, t in [*twin.named_parameters(), *twin.named_buffers()] if t.is_meta]
    if left:  # a tensor the sharded decoder does not have: the twin would compute with placeholders
        raise RuntimeError(f"the generation twin of the sharded decoder lacks {left[:3]}")
    return twin.eval()
