"""Downstream-task scoring speed: longtrain's harness model (pipeline/eval/harness_model.py: contexts shared by
their choices through a KV cache copy, batched by length) against lm-evaluation-harness's own Hugging Face backend
on the same model exported (pipeline/train/handoff/hf_export.py), same machine, same tasks, side by side; also the
largest difference of their log-likelihoods and whether acc / acc_norm agree. JSON to bench/results/harness.json.

    python bench/harness.py                      # a tiny checkpoint trained here (nano, 30 steps), then both backends
    python bench/harness.py --checkpoint runs/<run>/checkpoints/phase0/step_000200 --rounds 3

items/s counts the task's examples (questions or documents) scored per second of the backend's own requests (the
harness's task building and metrics are outside the timing); the rounds alternate the two backends.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import write_result  # noqa: E402


def requests_of(task_config: dict, limit: int):
    """The harness's own Instances of a task config (its prompts, its choices), at most `limit` documents."""
    from lm_eval.tasks import TaskManager

    task = TaskManager(include_defaults=False).load([task_config])["tasks"]
    (task,) = task.values()
    task.build_all_requests(limit=limit, rank=0, world_size=1)
    return task, task.instances


def timed(fn, instances, kind: str):
    start = time.perf_counter()
    out = getattr(fn, kind)(instances)
    return out, time.perf_counter() - start


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", help="a checkpoint (default: train a tiny one here)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--limit", type=int, default=200, help="documents per task")
    p.add_argument("--batch-size", type=int, default=16, help="the HF backend's batch size")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    from lm_eval.models.huggingface import HFLM

    from pipeline.data.shards import dataset_tokenizer
    from pipeline.eval.builtin_tasks import builtin_task_config
    from pipeline.eval.harness_model import LongtrainLM
    from pipeline.eval.harness_tasks import quiet_harness
    from pipeline.train.handoff.hf_export import export_checkpoint
    from pipeline.train.handoff.loaded_checkpoint import load_for_eval

    quiet_harness()
    work = Path(tempfile.mkdtemp(prefix="bench-harness-"))
    checkpoint = args.checkpoint or tiny_checkpoint(work)
    loaded = load_for_eval(checkpoint)
    tokenizer = dataset_tokenizer(loaded.dataset_dir, manifest=loaded.manifest)
    hf_dir = export_checkpoint(checkpoint, work / "hf").out_dir
    max_length = loaded.cfg.data.seq_len
    ours = LongtrainLM(loaded.engine.module.decoder, tokenizer, max_length)
    theirs = HFLM(pretrained=str(hf_dir), backend="causal", add_bos_token=False, prefix_token_id=tokenizer.eos_id,
                  max_length=max_length, batch_size=args.batch_size, device="cpu", dtype="float32")
    figures = {}
    for name, kind in (("builtin_cloze", "loglikelihood"), ("builtin_docs", "loglikelihood_rolling")):
        task, instances = requests_of(builtin_task_config(name, loaded.dataset_dir, loaded.manifest, tokenizer),
                                      args.limit)
        docs = len({i.doc_id for i in instances})
        times = {"longtrain": [], "hf": []}
        for _ in range(args.rounds):
            a, ta = timed(ours, instances, kind)
            b, tb = timed(theirs, instances, kind)
            times["longtrain"].append(ta)
            times["hf"].append(tb)
        first = [x[0] if isinstance(x, tuple) else x for x in a]
        second = [x[0] if isinstance(x, tuple) else x for x in b]
        diff = max(abs(x - y) for x, y in zip(first, second))
        med = {k: statistics.median(v) for k, v in times.items()}
        figures[name] = {"kind": kind, "documents": docs, "requests": len(instances),
                         "longtrain_s": med["longtrain"], "hf_s": med["hf"],
                         "longtrain_items_per_s": docs / med["longtrain"], "hf_items_per_s": docs / med["hf"],
                         "speedup": med["hf"] / med["longtrain"], "max_abs_loglikelihood_diff": diff,
                         "rounds": times}
        print(f"{name}: {docs} documents, {len(instances)} {kind} requests; longtrain {docs / med['longtrain']:.1f} "
              f"items/s, HF backend {docs / med['hf']:.1f} items/s: {med['hf'] / med['longtrain']:.2f}x; largest "
              f"log-likelihood difference {diff:.2e}")
    shapes = {"tier": loaded.cfg.model.tier, "mixer": loaded.cfg.model.mixer, "max_length": max_length,
              "vocab": loaded.manifest.vocab_size, "hf_batch_size": args.batch_size, "threads": torch.get_num_threads()}
    return write_result("harness", {"shapes": shapes, "figures": figures, "checkpoint": str(checkpoint),
                                    "goal": "longtrain items/s >= 1.5x the HF backend's (multiple choice)"})


def tiny_checkpoint(root: Path) -> Path:
    """A nano model trained 30 steps on tests' small real-text dataset (no Ray): what the equality test uses too."""
    from tests.pipeline.train.hf_helpers import build_dataset
    from pipeline.train.local import train_local

    cfg, ds = build_dataset(root / "data", seq_len=256)
    ckpt, _ = train_local(cfg.replace({"train.max_steps": 30, "train.checkpoint_every": 30, "train.eval_every": 30}),
                          ds, root / "run", None)
    return ckpt


if __name__ == "__main__":
    main()
