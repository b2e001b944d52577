"""The validation loss of every source of a mixture, and the mixture's weighted aggregate.

    from pipeline.eval.sources import SourceValidation
    evaluate = SourceValidation(mixture, batch_size=8, rank=rank, world_size=world)
    metrics = evaluate(engine, max_batches=8)     # val/<source>/{loss,ppl,bpb,accuracy} + val/{loss,ppl,accuracy}

Each source's validation split is read with pipeline/data/shards.py's EvalSplit, one per source kept for the whole
run as a single dataset's is (every rank the same number of forwards of the same shape: a short last batch is
padded; the manifest, each shard's footer and each row group read once per run, not once per evaluation, within
EVAL_CACHE_BYTES shared by the sources), its first `max_batches` batches evaluated by the engine (collective under
DDP/FSDP, the same calls in the same order on every rank), sources in the mixture's order, evaluation-only sources
(weight 0) too.

- val/<source>/loss: mean cross-entropy per predicted token (nats); ppl = exp(loss); accuracy as val/accuracy.
- val/<source>/bpb: bits per UTF-8 byte of the predicted text, loss x tokens / ln 2 / bytes, where bytes are what
  the predicted tokens decode to (pipeline/data/tokenizer.py utf8_bytes: SentencePiece's dropped leading space of
  each document not counted). Tokens per byte differ between tokenizers: bpb compares runs that loss cannot.
- val/loss, val/ppl, val/accuracy: the aggregate weighted by the mixture's weights (sources of weight 0 not
  counted), so sweeps and checkpoint ranking keep their metric.

Ray-free (torch, numpy, the shard readers); the engine is duck-typed (`evaluate(batches, max_batches)`, `device`).
"""
from __future__ import annotations

import itertools
import math
from typing import Any, Iterable, Iterator

import numpy as np

from pipeline.data.mixture import Mixture
from pipeline.data.shards import EVAL_CACHE_BYTES, EvalSplit
from pipeline.data.tokenizer import Tokenizer
from pipeline.storage import join
from pipeline.tracking.names import ACCURACY, BPB, EVAL, LOSS, PPL, VAL, VAL_ACCURACY, VAL_LOSS, VAL_PPL, split_metric


class _Counted:
    """Batches passed through unchanged while the target tokens of their counted rows and those tokens' UTF-8
    bytes are summed (host side, on tensors already in memory)."""

    def __init__(self, batches: Iterable[dict[str, Any]], size: np.ndarray, lead: np.ndarray, eos_id: int):
        self.batches, self.size, self.lead, self.eos_id = batches, size, lead, eos_id
        self.tokens = 0
        self.bytes = 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.batches:
            tokens = batch["tokens"].numpy()  # (B, T+1)
            if "pad" in batch:
                tokens = tokens[~batch["pad"].numpy()]
            targets = tokens[:, 1:]
            doc_first = tokens[:, :-1] == self.eos_id  # the target right after an EOS begins a document
            self.tokens += targets.size
            self.bytes += int(self.size[targets].sum() - self.lead[targets[doc_first]].sum())
            yield batch


class SourceValidation:
    """`evaluate(engine, max_batches)` for pipeline/train/loop.py's fit over a mixture (module docstring)."""

    def __init__(self, mixture: Mixture, batch_size: int, rank: int = 0, world_size: int = 1, prefix: str = "val"):
        self.mixture, self.batch_size, self.rank, self.world_size, self.prefix = (mixture, batch_size, rank,
                                                                                  world_size, prefix)
        self.size = self.lead = None  # a mixture of synthetic datasets has no tokenizer: no bytes, no bpb
        self.eos_id = mixture.manifest.eos_id
        # One reader per source for the object's lifetime (a run: pipeline/train/local.py, ray_train.py), rewound at
        # each evaluation; the single dataset's bound on decoded rows kept, shared by the sources.
        cache = max(16 << 20, EVAL_CACHE_BYTES // max(1, len(mixture.sources)))
        self.splits = [EvalSplit(s.dataset_dir, batch_size, rank, world_size, cache_bytes=cache, manifest=s.manifest)
                       for s in mixture.sources]
        if mixture.manifest.tokenizer_file:
            self.size, self.lead = Tokenizer(join(mixture.dataset_dir, mixture.manifest.tokenizer_file)).utf8_bytes()

    def __call__(self, engine, max_batches: int | None = None) -> dict[str, float]:
        import torch

        p = self.prefix
        out: dict[str, float] = {}
        counted = []
        for src, split in zip(self.mixture.sources, self.splits):
            reader = split()
            batches = itertools.islice(reader, max_batches) if max_batches is not None else reader
            c = _Counted(batches, self.size, self.lead, self.eos_id) if self.size is not None else None
            m = engine.evaluate(c if c is not None else batches, max_batches=max_batches)
            counted.append([c.tokens, c.bytes] if c is not None else [0, 0])
            out.update({split_metric(p, LOSS, src.name): m[VAL_LOSS], split_metric(p, PPL, src.name): m[VAL_PPL],
                        split_metric(p, ACCURACY, src.name): m[VAL_ACCURACY]})
        totals = torch.tensor(counted, dtype=torch.int64, device=engine.device)  # (sources, 2): tokens, bytes
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(totals)
        for src, (tokens, nbytes) in zip(self.mixture.sources, totals.tolist()):
            if self.size is not None:
                loss = out[split_metric(p, LOSS, src.name)]
                out[split_metric(p, BPB, src.name)] = loss * tokens / math.log(2) / nbytes if nbytes else float("nan")
        weighted = [s for s in self.mixture.sources if s.weight > 0]
        total = sum(s.weight for s in weighted)
        loss = sum(s.weight * out[split_metric(p, LOSS, s.name)] for s in weighted) / total
        out[split_metric(p, LOSS)] = loss
        out[split_metric(p, PPL)] = math.exp(loss) if loss < 700 else float("inf")
        out[split_metric(p, ACCURACY)] = sum(s.weight * out[split_metric(p, ACCURACY, s.name)]
                                             for s in weighted) / total
        return out


def source_names(metrics: dict[str, float], prefix: str = VAL) -> list[str]:
    """The sources that `metrics` has per-source values for, in their order."""
    return [k.split("/")[1] for k in metrics
            if k.count("/") == 2 and k == split_metric(prefix, LOSS, k.split("/")[1])]


def source_table(metrics: dict[str, float], weights: dict[str, float], prefix: str = EVAL) -> str:
    """The per-source metrics as a table (one row per source, then the weighted mixture)."""
    rows = ["source        weight     loss      ppl      bpb  accuracy"]
    for name in source_names(metrics, prefix):
        m = {k: metrics.get(split_metric(prefix, k, name), float("nan")) for k in (LOSS, PPL, BPB, ACCURACY)}
        rows.append(f"{name:<12} {weights.get(name, 0.0):6.1%} {m[LOSS]:8.4f} {m[PPL]:8.2f} {m[BPB]:8.4f} "
                    f"{m[ACCURACY]:9.4f}")
    rows.append(f"{'mixture':<12} {1:6.0%} {metrics[split_metric(prefix, LOSS)]:8.4f} "
                f"{metrics[split_metric(prefix, PPL)]:8.2f} {'':>8} {metrics[split_metric(prefix, ACCURACY)]:9.4f}")
    return "\n".join(rows)
