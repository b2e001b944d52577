"""Where the time of a prepare goes, stage by stage, in one process and without Ray: the CPU-seconds each step of
deduplication and of tokenizing and packing takes over a planted corpus, as MB per CPU-second (one core's rate, which
is also how each scales to more cores: every step is per document, per batch or per band, but the exact groups and
the components, one task each, whose rates are hundreds of times the others'). Ray's own share (its tasks, transfers
and start-ups) is what bench/dedup_speed.py measures around them.

    python bench/dedup_profile.py --mb 30 --work /tmp/dedup-work     # the corpus and tokenizer of bench/dedup.py
    python bench/dedup_profile.py --mb 900 --work /tmp/dedup-work

Steps: read (the .jsonl reader of the prepare), clean, exact hash (the whitespace normalisation in Python, as exact
mode runs it, and in the kernel, as near mode does; then BLAKE2b), near signature (lowercase and UTF-8, the words,
shingles and MinHash kernel, band keys), the signature rows as the prepare's map builds them in each mode, the exact
groups, the band tasks (each band's keys sorted, candidates checked), the components and removal, the tokenizing
pass's drop of removed documents, SentencePiece's encode, the token stream's assembly, and the shards (windows cut,
Parquet with zstd and page checksums, sha256). Writes bench/results/dedup_profile_<mb>mb-<device>-<date>.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from bench.common import write_result  # noqa: E402
from bench.dedup import corpus_for, train_tokenizer_once  # noqa: E402
from bench.dedup_corpus import corpus_bytes  # noqa: E402

BATCH = 256  # documents per batch, as the prepare's maps take them


class Clock:
    """CPU-seconds of this process per named step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def time(self, name: str, fn, *args, **kwargs):
        t0 = time.process_time()
        out = fn(*args, **kwargs)
        self.seconds[name] = self.seconds.get(name, 0.0) + time.process_time() - t0
        return out


def profile(files: list[Path], tokenizer: Path, seq_len: int, work: Path) -> dict:
    from pipeline.data.cleaning import clean_batch
    from pipeline.data.corpus import read_document_file, with_doc_ids
    from pipeline.data.dedup import _signature_rows, removed_mask
    from pipeline.data.dedup_kernels import near_minhash, utf8_batch
    from pipeline.data.dedup_signatures import DedupParams, Signer, exact_hashes
    from pipeline.data.dedup_tasks import band_edges, exact_rows, removal_task
    from pipeline.data.pack import token_stream
    from pipeline.data.shards import rows_per_row_group, shard_schema, token_numpy_type, windows_table, write_shard
    from pipeline.data.tokenizer import Tokenizer

    clock, params = Clock(), DedupParams()
    signer = Signer(params)
    signer.sign(["warm up the kernels"])  # compiled or loaded once (Numba's start-up, ~0.5-0.9 s): not timed
    batches = []
    for i, f in enumerate(files):
        with open(f, "rb") as fh:
            blocks = clock.time("read .jsonl", lambda: list(read_document_file(fh, str(f), "jsonl", "text")))
        rows = 0
        for block in blocks:
            block = with_doc_ids(block, (i << 32) + rows)
            rows += block.num_rows
            batches += [block.slice(a, BATCH) for a in range(0, block.num_rows, BATCH)]
    texts = [clock.time("clean", clean_batch, b)[0] for b in batches]
    for t in texts:
        clock.time("exact hash, exact mode (Python normalisation + blake2b)", exact_hashes, t)
        clock.time("exact hash, near mode (kernel normalisation + blake2b)", exact_hashes, t, compiled=True)
    lowered = [clock.time("near: lowercase + UTF-8", lambda t: utf8_batch([x.lower() for x in t]), t) for t in texts]
    minhash = [clock.time("near: words, shingles, 112 MinHash (kernel)", near_minhash, lb, params.ngram, signer.a,
                          signer.b)[0] for lb in lowered]
    for m in minhash:
        clock.time("near: band keys + sketch", lambda: (signer.band_keys(m), (m & 0xFF).astype(np.uint8)))
    for b in batches:
        clock.time("signature rows, exact mode (the map: clean + exact hash)", _signature_rows, b, 0, "exact", None)
    tables = [clock.time("signature rows, near mode (the map: clean + both hashes)", _signature_rows, b, 0, "near",
                         params) for b in batches]
    exact_removed, _ = clock.time("exact copies (one task)", exact_rows, tables, 1)
    edges = clock.time(f"bands ({params.bands} bands, one task)", band_edges, tables, list(range(params.bands)),
                       params.threshold)
    removed, info = clock.time("components + removal (one task)", removal_task, exact_removed, edges)
    nodes = removed.column("node").to_numpy()
    for b in batches:
        clock.time("drop removed (tokenizing pass)", removed_mask, b.column("doc").to_numpy(), [nodes])
    tok = Tokenizer(tokenizer)
    dtype = token_numpy_type(tok.vocab_size)
    ids = [clock.time("SentencePiece encode", tok.encode_batch, t) for t in texts]
    streams = [clock.time("token stream (ids laid end to end, EOS after each)", token_stream, i, tok.eos_id, dtype)[0]
               for i in ids]
    del ids
    stream = np.concatenate(streams)
    width = seq_len + 1
    windows = stream[:len(stream) // width * width].reshape(-1, width)
    group = rows_per_row_group(seq_len, tok.vocab_size)
    schema = shard_schema(seq_len, tok.vocab_size)

    def shards() -> None:
        for s in range(0, len(windows), 1024):
            rows = windows[s:s + 1024]
            tables_ = (windows_table(rows[a:a + group], np.arange(s + a, s + a + len(rows[a:a + group])),
                                     tok.eos_id, tok.vocab_size) for a in range(0, len(rows), group))
            write_shard(work / f"profile-{s}.parquet", tables_, schema)

    clock.time("shards (windows, Parquet zstd, sha256)", shards)
    mb = corpus_bytes(files) / 1e6
    return {"corpus_mb": round(mb, 1), "documents": sum(b.num_rows for b in batches), "tokens": int(len(stream)),
            "removed": int(len(nodes)), "edges": info["edges"],
            "steps": {k: {"cpu_s": round(v, 3), "mb_per_cpu_s": round(mb / v, 1) if v > 0 else None}
                      for k, v in clock.seconds.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=30.0)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default="", help="where the corpus goes (default: a temporary directory)")
    ap.add_argument("--out-dir", default="", help="results directory (default bench/results)")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="dedup-profile-"))
    work.mkdir(parents=True, exist_ok=True)
    files = sorted(corpus_for(args.mb, work, args.seed).glob("*.jsonl"))
    tokenizer = train_tokenizer_once(files, work)
    with tempfile.TemporaryDirectory(dir=work) as shards:
        result = profile(files, tokenizer, args.seq_len, Path(shards))
    result["load_1min"] = round(os.getloadavg()[0], 2)
    print(f"{result['corpus_mb']} MB, {result['documents']:,} documents, {result['tokens']:,} tokens "
          f"(CPU-seconds of one process; MB per CPU-second = one core's rate)")
    for name, s in result["steps"].items():
        print(f"  {name:48s} {s['cpu_s']:8.2f} CPU-s  {s['mb_per_cpu_s'] or 0:8.1f} MB/CPU-s")
    print(f"wrote {write_result(f'dedup_profile_{args.mb:g}mb', {'args': vars(args), **result}, Path(args.out_dir) if args.out_dir else None)}")  # noqa: E501


if __name__ == "__main__":
    main()
