"""datatrove's MinHash deduplication on the same .jsonl files, for bench/dedup.py and bench/dedup_speed.py (run with
the Python of a virtualenv that has datatrove; it imports nothing of longtrain):

    python3 -m venv .venv-datatrove && .venv-datatrove/bin/pip install datatrove==0.10.1 spacy 'xxhash<4' regex tokenizers
    .venv-datatrove/bin/python bench/dedup_datatrove.py --work DIR --workers 2 [--words matched|spacy] FILE.jsonl ...

FineWeb's recipe as datatrove's examples/minhash_deduplication.py runs it: word 5-grams, 14 buckets of 8 hashes,
64-bit precision; stage 1 signatures (a task per file), stage 2 buckets (one task per bucket), stage 3 clusters (one
task: datatrove's union-find runs in a single process), stage 4 the filter. Every stage on a LocalPipelineExecutor
with `--workers` processes. Word splitting (`--words`): `spacy`, datatrove's stock English word tokenizer after its
text normalisation (lowercase, digits to 0, punctuation removed, diacritics stripped); `matched`, longtrain's own
(lowercase, words = runs of `\w`, nothing else normalised), so that the two differ by their method alone. Prints one
JSON line: each stage's seconds and the removed documents as (file index, line) pairs.
"""
from __future__ import annotations

import argparse
import json
import re
import struct
import time
from pathlib import Path

_WORD = re.compile(r"\w+")


def main() -> None:
    from datatrove.data import Document
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup.minhash import (MinhashConfig, MinhashDedupBuckets, MinhashDedupCluster,
                                                  MinhashDedupFilter, MinhashDedupSignature)
    from datatrove.utils.hashing import HashConfig
    from datatrove.utils.text import TextNormConfig
    from datatrove.utils.typeshelper import Languages
    from datatrove.utils.word_tokenizers import WordTokenizer

    class WordRuns(WordTokenizer):
        """longtrain's words: runs of `\\w` in the lowercased text (datatrove lowercases first)."""

        def word_tokenize(self, text: str) -> list[str]:
            return _WORD.findall(text)

        def sent_tokenize(self, text: str) -> list[str]:
            return [text]

        def span_tokenize(self, text: str) -> list[tuple[int, int]]:
            return [(0, len(text))]

    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--words", choices=("matched", "spacy"), default="spacy")
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    work = Path(args.work)
    files = list(args.files)
    norm = (TextNormConfig(lowercase=True, norm_whitespace=False, remove_punctuation=False,
                           norm_unicode_diacritics=False, norm_numbers=False) if args.words == "matched"
            else TextNormConfig())
    language = WordRuns() if args.words == "matched" else Languages.english  # the stock default
    config = MinhashConfig(hash_config=HashConfig(precision=64), num_buckets=14, hashes_per_bucket=8, n_grams=5,
                           norm_config=norm)

    def reader(data, rank: int = 0, world_size: int = 1):
        """Task `rank` reads file `rank` (one task per file), its lines as documents in order."""
        with open(files[rank]) as f:
            for line_no, line in enumerate(f):
                yield Document(text=json.loads(line)["text"], id=f"{rank}/{line_no}")

    seconds = {}
    stages = [
        ("signatures", [reader, MinhashDedupSignature(output_folder=str(work / "signatures"), config=config,
                                                       language=language)],
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
    print(json.dumps({"seconds": seconds, "removed": removed, "words": args.words}))


if __name__ == "__main__":
    main()
