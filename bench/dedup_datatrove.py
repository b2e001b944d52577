"""datatrove's MinHash deduplication on the same .jsonl files, for bench/dedup.py (run with the Python of a virtualenv
that has datatrove; it imports nothing of longtrain):

    python3 -m venv .venv-datatrove && .venv-datatrove/bin/pip install datatrove==0.10.1 spacy 'xxhash<4' regex tokenizers
    .venv-datatrove/bin/python bench/dedup_datatrove.py --work DIR --workers 2 FILE.jsonl ...

FineWeb's recipe as datatrove's examples/minhash_deduplication.py runs it: word 5-grams, 14 buckets of 8 hashes,
64-bit precision; stage 1 signatures (a task per file), stage 2 buckets (one task per bucket), stage 3 clusters (one
task: datatrove's union-find runs in a single process), stage 4 the filter. Every stage on a LocalPipelineExecutor
with `--workers` processes. Prints one JSON line: each stage's seconds and the removed documents as (file index,
line) pairs.
"""
from __future__ import annotations

import argparse
import json
import struct
import time
from pathlib import Path


def main() -> None:
    from datatrove.data import Document
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup.minhash import (MinhashConfig, MinhashDedupBuckets, MinhashDedupCluster,
                                                  MinhashDedupFilter, MinhashDedupSignature)
    from datatrove.utils.hashing import HashConfig

    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    work = Path(args.work)
    files = list(args.files)
    config = MinhashConfig(hash_config=HashConfig(precision=64), num_buckets=14, hashes_per_bucket=8, n_grams=5)

    def reader(data, rank: int = 0, world_size: int = 1):
        """Task `rank` reads file `rank` (one task per file), its lines as documents in order."""
        with open(files[rank]) as f:
            for line_no, line in enumerate(f):
                yield Document(text=json.loads(line)["text"], id=f"{rank}/{line_no}")

    seconds = {}
    stages = [
        ("signatures", [reader, MinhashDedupSignature(output_folder=str(work / "signatures"), config=config)],
         len(files)),
        ("buckets", [MinhashDedupBuckets(input_folder=str(work / "signatures"), output_folder=str(work / "buckets"),
                                         config=config)], config.num_buckets),
        ("clusters", [MinhashDedupCluster(input_folder=str(work / "buckets"), output_folder=str(work / "remove_ids"),
                                          config=config)], 1),
        ("filter", [reader, MinhashDedupFilter(input_folder=str(work / "remove_ids"))], len(files)),
    ]
    for name, pipeline, tasks in stages:
        t0 = time.perf_counter()
        LocalPipelineExecutor(pipeline=pipeline, tasks=tasks, workers=min(args.workers, tasks),
                              logging_dir=str(work / "logs" / name), skip_completed=False).run()
        seconds[name] = time.perf_counter() - t0
    removed = []
    for rank in range(len(files)):
        path = work / "remove_ids" / f"{rank:06d}.remove"
        if path.exists():
            data = path.read_bytes()
            removed += [[rank, i] for (i,) in struct.iter_unpack("<I", data)]
    print(json.dumps({"seconds": seconds, "removed": removed}))


if __name__ == "__main__":
    main()
