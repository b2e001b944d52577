"""Loss by position in the document: does a model predict a token better the more of its document it has seen?

    python pipeline/run.py eval --resume runs/<run> --by-position          # the validation split, as trained
    python pipeline/run.py train --train.eval_by_position=true             # at every training evaluation

    stats = PositionStats(row_len=256, device=device)
    stats.add(losses, doc_ids, pad)       # losses (B, T) nats per target, doc_ids (B, T+1), pad (B,) bool
    result = stats.result()               # all-reduced over the ranks: one host transfer
    result.metrics("val")                 # {"val/pos_loss/1-64": ..., "val/pos_docs/1-64": ..., "val/cum_ppl/64": ...}

Positions. A row's target j (the token after input j) has position p = the number of tokens of its own document
before it in the row: the context the model had for it under document masking (positions restart per document
there). p runs from 1 to the row length T. A document cut by the row's start counts from the cut, as the model
sees it; a target that starts the next document (the token after an EOS) belongs to no position and is left out.
With `model.doc_masking=false` the whole row is one document (the model attends across documents).

Buckets. Log-spaced: 1-64, 64-256, 256-1024, ... (bucket lo-hi holds lo <= p < hi; the last one ends at the row
length and holds p = T too). A target counts toward its bucket only when its document reaches the bucket's end
(has a target at position hi - 1, or T for the last bucket), so a bucket is not an average over short documents:
every document in bucket 256-1024 has seen at least 1,023 of its own tokens by the end of it. Each bucket
reports its mean loss (`pos_loss`), how many documents (`pos_docs`) and how many tokens (`pos_tokens`) it holds.

Cumulative-mean perplexity (the curve the YaRN and Gemini reports draw): at context length L, exp of the mean loss
of positions 1..L over the documents that reach L (`cum_ppl/<L>`, L = 16, 32, ..., and the row length).

Scoring a suffix. `score_from` leaves the first targets of every row out of the statistics (they are context
only): `--seq-len 2x` (pipeline/eval/long_rows.py) scores only the last window of a longer row.

Per-token losses come from the hidden states through the output projection in chunks of rows (`token_losses`),
so a 32k row never materializes (tokens x vocab) logits beyond one chunk. Everything stays on the device until
`result()`, whose one all-reduce every rank makes (DDP and FSDP alike run the same forwards and this collective).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pipeline.tracking.names import CUM_PPL, POS_DOCS, POS_LOSS, POS_TOKENS, position_metric

FIRST_BUCKET_END = 64  # bucket 1-64: the first sentence or two of a document
BUCKET_GROWTH = 4  # each bucket ends 4x further than the one before (log-spaced)
CUM_FIRST = 16  # the cumulative curve's first context length; then doubling up to the row length
LOGITS_CHUNK_BYTES = 64 << 20  # fp32 logits per chunk in token_losses when no chunk size is given


def bucket_edges(row_len: int) -> list[int]:
    """[1, 64, 256, ..., row_len + 1]: bucket i holds positions edges[i] <= p < edges[i + 1]."""
    if row_len < 1:
        raise ValueError(f"row_len must be >= 1, got {row_len}")
    edges, end = [1], FIRST_BUCKET_END
    while end < row_len:
        edges.append(end)
        end *= BUCKET_GROWTH
    return edges + [row_len + 1]


def bucket_names(row_len: int) -> list[str]:
    """'1-64', '64-256', ..., '<lo>-<row_len>': the metric suffixes (the last bucket named by the row length)."""
    edges = bucket_edges(row_len)
    return [f"{lo}-{hi}" for lo, hi in zip(edges[:-1], edges[1:-1] + [row_len])]


def cumulative_lengths(row_len: int) -> list[int]:
    """Context lengths of the cumulative-mean curve: 16, 32, 64, ... below the row length, then the row length."""
    out, length = [], CUM_FIRST
    while length < row_len:
        out.append(length)
        length *= 2
    return out + [row_len]


def token_losses(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                 chunk_rows: int = 0) -> torch.Tensor:
    """hidden (B, T, D), weight (V, D), targets (B, T) int64 -> (B, T) fp32 cross-entropy per target (nats; 0 where
    the target is negative: ignored rows). Logits are made `chunk_rows` rows at a time (0: as many as fit
    LOGITS_CHUNK_BYTES of fp32), in the current autocast dtype, and reduced in fp32."""
    B, T, D = hidden.shape
    flat, tgt = hidden.reshape(B * T, D), targets.reshape(B * T)
    rows = chunk_rows if chunk_rows > 0 else max(1, LOGITS_CHUNK_BYTES // (4 * weight.shape[0]))
    out = torch.empty(B * T, dtype=torch.float32, device=hidden.device)
    for lo in range(0, B * T, rows):
        logits = F.linear(flat[lo:lo + rows], weight).float()  # (rows, V)
        out[lo:lo + rows] = F.cross_entropy(logits, tgt[lo:lo + rows].clamp(min=0), reduction="none")
    return out.masked_fill_(tgt < 0, 0.0).view(B, T)


def target_positions(doc_ids: torch.Tensor | None, B: int, T: int, device: torch.device) -> tuple[torch.Tensor,
                                                                                                   torch.Tensor,
                                                                                                   torch.Tensor]:
    """(position (B, T) int64, same_doc (B, T) bool, doc (B, T) int64) of every target: its position in its document
    (1..T), whether it belongs to the document of its input, and that document's id within the row."""
    from model.decoder import doc_positions

    if doc_ids is None:  # no document masking: the row is one document
        doc = torch.zeros(B, T, dtype=torch.int64, device=device)
        return torch.arange(1, T + 1, device=device).expand(B, T), torch.ones(B, T, dtype=torch.bool,
                                                                                device=device), doc
    doc_ids = doc_ids.to(device)
    inputs = doc_ids[:, :-1]
    return doc_positions(inputs) + 1, doc_ids[:, 1:] == inputs, inputs.long()


@dataclass
class Bucket:
    name: str  # '64-256'
    lo: int  # first position it holds
    hi: int  # last position it holds + 1
    loss: float  # mean loss (nats) of its tokens; nan when it has none
    docs: int  # documents that reach its end and have a counted token in it
    tokens: int  # targets counted in it


@dataclass
class CumulativePoint:
    length: int  # context length L
    ppl: float  # exp(mean loss of positions 1..L over the documents that reach L); nan when none does
    docs: int
    tokens: int


@dataclass
class PositionResult:
    row_len: int
    buckets: list[Bucket] = field(default_factory=list)
    cumulative: list[CumulativePoint] = field(default_factory=list)
    scored_tokens: int = 0  # every scored target (any position), for the mean below
    loss: float = float("nan")  # mean loss over every scored target, the next document's first token included

    def metrics(self, prefix: str) -> dict[str, float]:
        """MLflow metrics under `prefix` ("val" at training evaluations, "eval" or "eval_2x" from the eval stage):
        <prefix>/pos_loss|pos_docs|pos_tokens/<bucket> for each bucket with tokens, <prefix>/cum_ppl/<L>."""
        out: dict[str, float] = {}
        for b in self.buckets:
            if b.tokens:
                out[position_metric(prefix, POS_LOSS, b.name)] = b.loss
                out[position_metric(prefix, POS_DOCS, b.name)] = float(b.docs)
                out[position_metric(prefix, POS_TOKENS, b.name)] = float(b.tokens)
        for c in self.cumulative:
            if c.tokens:
                out[position_metric(prefix, CUM_PPL, str(c.length))] = c.ppl
        return out

    def table(self) -> str:
        """The buckets as aligned text lines (what the eval stage prints)."""
        lines = [f"{'position':>13} {'loss':>8} {'ppl':>10} {'docs':>7} {'tokens':>10}"]
        for b in self.buckets:
            ppl = math.exp(b.loss) if b.tokens and b.loss < 700 else float("nan")
            lines.append(f"{b.name:>13} {b.loss:8.4f} {ppl:10.2f} {b.docs:7,d} {b.tokens:10,d}")
        return "\n".join(lines)


class PositionStats:
    """On-device sums per position bucket and per cumulative length over the batches `add`ed; see the module
    docstring for the definitions. row_len: the model's row length T (targets per row)."""

    def __init__(self, row_len: int, device: torch.device | str = "cpu"):
        self.row_len, self.device = row_len, torch.device(device)
        self.edges = bucket_edges(row_len)
        self.names = bucket_names(row_len)
        self.lengths = cumulative_lengths(row_len)
        nb, nl = len(self.names), len(self.lengths)
        # The last position each bucket holds: a document counts toward the bucket when it reaches it.
        self._ends = torch.tensor([hi - 1 for hi in self.edges[1:]], dtype=torch.int64, device=self.device)
        self._inner = torch.tensor(self.edges[1:-1], dtype=torch.int64, device=self.device)
        self._cum_len = torch.tensor(self.lengths, dtype=torch.int64, device=self.device)
        # One fp64 vector, so `result` is one all-reduce and one host copy: [loss, tokens, docs] per bucket,
        # [loss, tokens, docs] per cumulative length, then [loss, tokens] over every scored target.
        self._sums = torch.zeros(3 * nb + 3 * nl + 2, dtype=torch.float64, device=self.device)

    def add(self, losses: torch.Tensor, doc_ids: torch.Tensor | None, pad: torch.Tensor | None = None,
            score_from: int = 0) -> None:
        """losses (B, T) per-target nats; doc_ids (B, T+1) as the batch carries them, or None (no document masking:
        the row is one document); pad (B,) bool rows not to count; score_from: targets j < score_from are context
        only. Queued device ops, no host sync."""
        B, T = losses.shape
        if T != self.row_len:
            raise ValueError(f"rows of {T} targets, but these statistics are for rows of {self.row_len}")
        dev = self.device
        losses = losses.to(dev, torch.float64)
        pos, same_doc, doc = target_positions(doc_ids, B, T, dev)
        scored = torch.zeros(B, T, dtype=torch.bool, device=dev)
        scored[:, score_from:] = True
        if pad is not None:
            scored &= ~pad.to(dev)[:, None]
        nb, nl = len(self.names), len(self.lengths)
        self._sums[-2] += (losses * scored).sum()
        self._sums[-1] += scored.sum()
        valid = scored & same_doc
        # Documents numbered across the batch: row b's document d is b * (T + 1) + d.
        key = (torch.arange(B, device=dev)[:, None] * (T + 1) + doc)[valid]  # (N,)
        p, loss = pos[valid], losses[valid]  # (N,) each
        reach = torch.zeros(B * (T + 1), dtype=torch.int64, device=dev)
        reach.scatter_reduce_(0, key, p, reduce="amax")  # the furthest position each document reaches
        doc_reach = reach[key]  # (N,)

        bucket = torch.bucketize(p, self._inner, right=True)  # (N,) index i: edges[i] <= p < edges[i + 1]
        counted = doc_reach >= self._ends[bucket]
        s = self._sums
        s[0:nb] += torch.zeros(nb, dtype=torch.float64, device=dev).index_add_(0, bucket[counted], loss[counted])
        s[nb:2 * nb] += torch.bincount(bucket[counted], minlength=nb).to(torch.float64)
        s[2 * nb:3 * nb] += self._distinct_docs(key[counted], bucket[counted], B * (T + 1), nb)

        # (N, nl): target within the first L positions of a document that reaches L
        within = (p[:, None] <= self._cum_len[None]) & (doc_reach[:, None] >= self._cum_len[None])
        c = 3 * nb
        s[c:c + nl] += (loss[:, None] * within).sum(0)
        s[c + nl:c + 2 * nl] += within.sum(0).to(torch.float64)
        rows, cols = within.nonzero(as_tuple=True)
        s[c + 2 * nl:c + 3 * nl] += self._distinct_docs(key[rows], cols, B * (T + 1), nl)

    def _distinct_docs(self, key: torch.Tensor, column: torch.Tensor, n_docs: int, n_cols: int) -> torch.Tensor:
        """(n_cols,) fp64: how many distinct documents have at least one (document, column) pair."""
        seen = torch.zeros(n_docs, n_cols, dtype=torch.bool, device=self.device)
        seen[key, column] = True
        return seen.sum(0).to(torch.float64)

    def result(self) -> PositionResult:
        """The statistics over every rank's batches (an all-reduce when a process group is up: every rank must
        call it) in one host transfer."""
        sums = self._sums
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            sums = sums.clone()
            torch.distributed.all_reduce(sums)
        v = sums.tolist()
        nb, nl = len(self.names), len(self.lengths)
        out = PositionResult(self.row_len, scored_tokens=int(v[-1]),
                             loss=v[-2] / v[-1] if v[-1] else float("nan"))
        for i, name in enumerate(self.names):
            tokens = int(v[nb + i])
            out.buckets.append(Bucket(name, self.edges[i], self.edges[i + 1], v[i] / tokens if tokens else float("nan"),
                                      int(v[2 * nb + i]), tokens))
        c = 3 * nb
        for i, length in enumerate(self.lengths):
            tokens = int(v[c + nl + i])
            mean = v[c + i] / tokens if tokens else float("nan")
            out.cumulative.append(CumulativePoint(length, math.exp(min(mean, 700.0)) if tokens else float("nan"),
                                                  int(v[c + 2 * nl + i]), tokens))
        return out


@torch.no_grad()
def evaluate_by_position(engine, batches, row_len: int, max_batches: int | None = None,
                         score_from: int = 0) -> PositionResult:
    """Loss by position of `engine`'s model over `batches` ({"tokens": (B, row_len+1), "doc_ids", "pad"?}): one
    forward per batch through the engine's own module (pipeline/train/engine.py LossModule, per_token=True), so
    under FSDP the root and every block gather their shards as in a normal evaluation. Every rank must call it
    with batches of the same count and shape (eval_reader pads the last one); ends with one all-reduce. Under context
    parallelism the ranks of a context group read the same rows, each forward returns the whole rows' losses on
    every one of them, and only the group's first rank (engine.counts_rows) adds them."""
    engine.module.eval()
    stats = PositionStats(row_len, engine.device)
    for i, batch in enumerate(batches):
        if max_batches is not None and i >= max_batches:
            break
        tokens, doc_ids = engine._to_device(batch)
        pad = batch.get("pad")
        pad = pad.to(engine.device) if pad is not None else None
        with engine._autocast():
            losses = engine.module(tokens, doc_ids, pad, per_token=True)  # (B, row_len)
        if not getattr(engine, "counts_rows", True):  # a row split over a context group: its first rank counts it
            pad = torch.ones(losses.shape[0], dtype=torch.bool, device=engine.device)
        stats.add(losses, doc_ids, pad, score_from)
    return stats.result()
