"""The training side of a mixture-of-experts model: its auxiliary losses, its selection bias and its metrics.

    balance = MoEBalance.for_model(decoder, cfg, device)     # None for a dense model
    loss = loss + balance.loss(n_micro)                       # after each micro-batch's forward (engine.py)
    balance.after_step(applied)                               # after each optimizer step: the selection bias
    metrics, dropped_flops = balance.pull(step)               # at each log: moe/* metrics (one host transfer)

Each MoE layer's training forward records its RouterStats (model/moe_routing.py). After a micro-batch this reads
them from every MoE layer: the per-expert assignment counts are summed over every worker (one all-reduce of
(layers, E + 1) numbers, under a process group; every rank runs it once per micro-batch, in the step's collective
region), so the balancing sees the global batch (model/moe_routing.py: f from the global counts, P from this rank's
tokens, whose mean over the ranks is the global batch's loss). Then

    model.moe_balance=aux    loss += moe_aux_weight x mean over MoE layers of L_aux, + moe_z_weight x z-loss
    model.moe_balance=bias   loss += moe_z_weight x z-loss; after each applied optimizer step every layer's
                             selection bias moves by moe_bias_rate against the step's load (all micro-batches,
                             all workers: the same bias on every worker)

divided by the micro-batches of the step, as the token loss is. L_aux is measured under `bias` too (it is the
balance's clearest single number), without a gradient. Statistics stay on the device until `pull`; `history` keeps
each pull's load per expert (every layer) for the picture of load over steps (pipeline/tracking/expert_load_plot.py).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from model.moe_routing import balance_loss, update_selection_bias
from pipeline.tracking.names import (MOE_AUX_LOSS, MOE_BIAS_ABS_MAX, MOE_DROPPED, MOE_LOAD_MAX, MOE_LOAD_MIN,
                                     MOE_Z_LOSS, moe_layer_metric)


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """t summed over every worker of the process group (in place), when there is one of more than one rank."""
    import torch.distributed as dist

    if _world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


class MoEBalance:
    """See the module docstring. layers: the model's MoE feed-forwards (model/moe.py moe_layers), block_index: the
    block each one sits in (for metric names)."""

    def __init__(self, layers: list[nn.Module], block_index: list[int], *, balance: str, aux_weight: float,
                 z_weight: float, bias_rate: float, device: torch.device):
        self.layers, self.block_index = layers, block_index
        spec = layers[0].spec
        self.E, self.k = spec.num_experts, spec.experts_per_token
        self.aux_weight = aux_weight if balance == "aux" else 0.0
        self.z_weight = z_weight
        self.bias_rate = bias_rate if balance == "bias" else 0.0
        # 6 x 3 D F: the training FLOPs one dropped assignment did not run (train/mfu counts what ran)
        self.flops_per_assignment = 18 * layers[0].d_model * spec.expert_ffn
        L, E = len(layers), self.E
        self._load = torch.zeros(L, E, dtype=torch.float64, device=device)  # interval: assignments per expert
        self._step_load = torch.zeros(L, E, dtype=torch.float32, device=device)  # this optimizer step (bias)
        self._layer = torch.zeros(L, 2, dtype=torch.float64, device=device)  # interval: entropy sum, dropped
        self._scalars = torch.zeros(3, dtype=torch.float64, device=device)  # interval: aux sum, z sum, micro-batches
        self._tokens = torch.zeros((), dtype=torch.float64, device=device)  # interval: tokens (all workers)
        self.history: list[tuple[int, list[list[float]]]] = []  # (step, load fraction per layer and expert)

    @classmethod
    def for_model(cls, decoder: nn.Module, cfg, device: torch.device) -> "MoEBalance | None":
        """The balance of `decoder`'s MoE layers under cfg.model's settings; None for a dense model."""
        from model.moe import MoEFeedForward

        index = [i for i, block in enumerate(decoder.blocks) if isinstance(block.mlp, MoEFeedForward)]
        if not index:
            return None
        m = cfg.model
        return cls([decoder.blocks[i].mlp for i in index], index, balance=m.moe_balance, aux_weight=m.moe_aux_weight,
                   z_weight=m.moe_z_weight, bias_rate=m.moe_bias_rate, device=device)

    def loss(self, n_micro: int) -> torch.Tensor:
        """The auxiliary terms of the micro-batch just forwarded, divided by the step's micro-batches (a 0-dim
        tensor, differentiable). A collective under a process group (the global counts)."""
        stats = [layer.stats for layer in self.layers]
        if any(s is None for s in stats):
            raise RuntimeError("a MoE layer recorded no router statistics: call loss() after a training forward")
        local = torch.cat([torch.stack([s.counts for s in stats]),  # (L, E)
                           torch.stack([s.dropped.float() for s in stats])[:, None]], dim=1)  # (L, E + 1)
        global_ = _all_reduce_sum(local.detach().clone())
        counts, dropped = global_[:, :-1], global_[:, -1]
        tokens = float(stats[0].tokens)
        counted = counts[0].sum() / self.k  # every worker's tokens (each makes k assignments before any drop)
        aux = torch.stack([balance_loss(c, s.prob_sum, tokens, self.k, counted)
                           for c, s in zip(counts, stats)]).mean()
        z = torch.stack([s.z_sum for s in stats]).mean() / tokens
        with torch.no_grad():
            self._load += counts.double()
            self._step_load += counts
            self._layer[:, 0] += torch.stack([s.entropy_sum for s in stats]).double() / tokens
            self._layer[:, 1] += dropped.double()
            self._scalars += torch.stack([aux.detach(), z.detach(), torch.ones_like(z)]).double()
            self._tokens += counted.double()
        for layer in self.layers:
            layer.stats = None  # consumed: a forward that records nothing is an error next time, not a repeat
        total = self.aux_weight * aux + self.z_weight * z
        return total / n_micro

    @torch.no_grad()
    def after_step(self, applied: bool) -> None:
        """After the optimizer step: move each layer's selection bias against the step's load (bias balancing, when
        the step was applied), and start the next step's count."""
        if self.bias_rate and applied:
            for layer, load in zip(self.layers, self._step_load):
                update_selection_bias(layer.expert_bias, load, self.bias_rate)
        self._step_load.zero_()

    def pull(self, step: int) -> tuple[dict[str, float], float]:
        """(moe/* metrics over the interval, the training FLOPs the dropped assignments did not run); one host
        transfer; resets the interval and appends the interval's load to `history`. Under a process group a
        collective, as the engine's pull is: the losses and entropies each rank measured on its tokens are averaged
        over the ranks (the counts already are every rank's)."""
        L = len(self.layers)
        world = _world_size()
        if world > 1:
            mine = _all_reduce_sum(torch.cat([self._layer[:, 0], self._scalars[:2]])) / world
            self._layer[:, 0], self._scalars[:2] = mine[:L], mine[L:]
        biases = [layer.expert_bias for layer in self.layers if layer.expert_bias is not None]
        bias = (torch.stack(biases).abs().amax(dim=1).double() if biases
                else torch.zeros(L, dtype=torch.float64, device=self._load.device))
        flat = torch.cat([self._load.flatten(), self._layer.flatten(), self._scalars, self._tokens[None],
                          bias]).tolist()
        E = self.E
        load = [flat[i * E:(i + 1) * E] for i in range(L)]
        layer = flat[L * E:L * E + 2 * L]
        aux_sum, z_sum, micro, tokens = flat[L * E + 2 * L:L * E + 2 * L + 4]
        bias_max = flat[L * E + 2 * L + 4:]
        self._load.zero_()
        self._layer.zero_()
        self._scalars.zero_()
        self._tokens.zero_()
        if not micro:
            return {}, 0.0
        out: dict[str, float] = {MOE_AUX_LOSS: aux_sum / micro, MOE_Z_LOSS: z_sum / micro}
        worst_max, worst_min, dropped_all = 0.0, float("inf"), 0.0
        fractions = []
        for i, (block, counts) in enumerate(zip(self.block_index, load)):
            total = sum(counts)
            mean = total / E if total else 1.0
            hi, lo = max(counts) / mean, min(counts) / mean
            dropped = layer[2 * i + 1]
            out[moe_layer_metric(block, "load_max")] = hi
            out[moe_layer_metric(block, "load_min")] = lo
            out[moe_layer_metric(block, "entropy")] = layer[2 * i] / micro
            out[moe_layer_metric(block, "dropped")] = dropped / max(total, 1.0)
            if biases:
                out[moe_layer_metric(block, "bias_abs_max")] = bias_max[i]
            worst_max, worst_min, dropped_all = max(worst_max, hi), min(worst_min, lo), dropped_all + dropped
            fractions.append([c / total if total else 0.0 for c in counts])
        out[MOE_LOAD_MAX], out[MOE_LOAD_MIN] = worst_max, worst_min
        out[MOE_DROPPED] = dropped_all / max(tokens * self.k * L, 1.0)
        if biases:
            out[MOE_BIAS_ABS_MAX] = max(bias_max)
        self.history.append((step, fractions))
        return out, dropped_all * self.flops_per_assignment
