"""Token-level training / evaluation metrics that stay on the device until they are read.

    metrics = TokenMetrics(device)
    for batch in batches:
        res = linear_cross_entropy(hidden, weight, targets)      # CEResult(loss_sum, n_tokens, n_correct)
        metrics.add(res.loss_sum, res.n_tokens, res.n_correct)   # or metrics.add(res); queued device adds, no sync
    metrics.all_reduce()                                         # DDP: every rank now holds the global sums
    print(metrics.pull())                                        # {'loss': .., 'ppl': .., 'accuracy': .., 'tokens': ..}

Why pure torch and no Numba kernel: the work per step is three scalar adds on 0-dim tensors; what matters is that
nothing reaches the host until `pull()`. `add` only queues device ops (on CUDA: no host sync, so the training loop
never stalls on a metric), and `pull` makes exactly one device-to-host transfer (stack, then `.tolist()`).

Accumulators: loss sum in fp64 (a long run sums billions of per-token losses; fp32 would stop growing), token and
correct counts in int64 (exact). `pull` moves them to the host as fp64, exact for counts below 2**53.
"""
from __future__ import annotations

import math

import torch


class TokenMetrics:
    """On-device sums of loss, counted tokens and correctly predicted tokens since the last `pull()`.

    device: where the accumulators live; pass the device the loss is computed on (adding a tensor from another
    device copies it, and a CUDA -> CPU copy would sync).
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)  # sum of per-token losses (nats)
        self.n_tokens = torch.zeros((), dtype=torch.int64, device=self.device)
        self.n_correct = torch.zeros((), dtype=torch.int64, device=self.device)

    def add(self, loss_sum, n_tokens=None, n_correct=None) -> None:
        """Accumulate one batch. Either add(CEResult) or add(loss_sum, n_tokens, n_correct).

        loss_sum: summed loss over the batch's counted tokens (a tensor, detached here, or a Python number);
        n_tokens, n_correct: counts (int tensors or Python ints). Tensors with more than one element are summed.
        Queues device ops only: no host sync.
        """
        if n_tokens is None and n_correct is None and hasattr(loss_sum, "n_tokens"):
            loss_sum, n_tokens, n_correct = loss_sum.loss_sum, loss_sum.n_tokens, loss_sum.n_correct
        if n_tokens is None or n_correct is None:
            raise TypeError("TokenMetrics.add takes a CEResult, or loss_sum, n_tokens and n_correct together")
        self._accumulate(self.loss_sum, loss_sum)
        self._accumulate(self.n_tokens, n_tokens)
        self._accumulate(self.n_correct, n_correct)

    def _accumulate(self, acc: torch.Tensor, value) -> None:
        if isinstance(value, torch.Tensor):
            # detach: metrics must never keep the autograd graph of the step alive
            acc.add_(value.detach().to(device=self.device, dtype=acc.dtype).sum())
        else:
            acc.add_(value)  # a Python number goes to the kernel as an argument: no host-to-device copy

    def reset(self) -> None:
        """Zero the accumulators (device ops, no sync)."""
        for acc in (self.loss_sum, self.n_tokens, self.n_correct):
            acc.zero_()

    def all_reduce(self, group=None) -> "TokenMetrics":
        """Sum the accumulators over the ranks of `group` (default: the world) when torch.distributed is
        initialised; otherwise do nothing. A collective: every rank must call it. Two all_reduce calls, fp64 for
        the loss and int64 for the counts, so counts stay exact. Returns self, for `metrics.all_reduce().pull()`."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self
        counts = torch.stack([self.n_tokens, self.n_correct])  # (2,) int64
        dist.all_reduce(self.loss_sum, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
        self.n_tokens.copy_(counts[0])
        self.n_correct.copy_(counts[1])
        return self

    def pull(self) -> dict[str, float]:
        """One device-to-host transfer, then reset. Returns

            loss      mean loss per counted token (nats)
            ppl       exp(loss) (inf when exp overflows)
            accuracy  n_correct / n_tokens
            tokens    n_tokens (int)

        With zero tokens since the last pull (say, an evaluation over only padding), loss, ppl and accuracy are
        float('nan') and tokens is 0: an empty interval has no mean, and NaN shows that in logs instead of a
        made-up 0.
        """
        loss_sum, tokens, correct = torch.stack(
            [self.loss_sum, self.n_tokens.double(), self.n_correct.double()]).tolist()
        self.reset()
        tokens = int(tokens)
        if tokens == 0:
            return {"loss": math.nan, "ppl": math.nan, "accuracy": math.nan, "tokens": 0}
        loss = loss_sum / tokens
        ppl = math.inf if loss > 709.0 else math.exp(loss)  # exp overflows a double just above 709.78; NaN stays NaN
        return {"loss": loss, "ppl": ppl, "accuracy": correct / tokens, "tokens": tokens}
