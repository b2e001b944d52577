"""Prepare and deduplication speed, back to back in one run on the same cores, with the quality beside it: the goals
of docs/data.md#what-deduplication-costs.

    python bench/dedup_speed.py --mb 30 --datatrove .venv-datatrove/bin/python --stock --fresh
    python bench/dedup_speed.py --mb 300 --mb 900 --datatrove .venv-datatrove/bin/python
    python bench/dedup_speed.py --mb 2 --repeat 1 --smoke          # seconds: checks that the bench runs

Per corpus size (a planted corpus of bench/dedup_corpus.py: its copies and their true Jaccard similarities known):
  limit      SentencePiece's encode alone on the same cores: one process per core, each encoding its share of the
             corpus's cleaned documents (read and cleaned beforehand, not timed), all at once: corpus MB / the
             slowest process's seconds. The ceiling of a prepare on these cores.
  prepares   one child process, one local Ray (started and warmed up first, on a small corpus, with every mode: a
             cluster starts once, and Numba compiles once), then prepares of the corpus with data.dedup = none,
             exact and near, alternated --repeat times; per prepare its seconds, its dedup stage's seconds and
             stages, its tokenizing seconds, CPU-seconds by process kind (Ray's process titles) and the peak machine
             memory above what it was before it (sampled every 0.25 s). The best of each mode counts.
  stage      deduplicate() alone (near) in that Ray, after the prepares: the stage's own seconds as datatrove's are
             timed (from the .jsonl files to the list of removed documents), and the removed set for the quality.
  datatrove  datatrove 0.10.1's MinHash stages 1-3 (and 4, its filter) on the same files and cores, with longtrain's
             word splitting (`matched`) and, with --stock, its own spaCy splitting (bench/dedup_datatrove.py).
  quality    per side, against the planted truth: recall of pairs at true Jaccard >= 0.85, merges of pairs below
             0.6 (false merges) and of distinct documents, and the share merged per Jaccard bin.
  fresh      (--fresh) each mode once more in a fresh process that starts its own Ray, as `python pipeline/run.py
             prepare` runs: what a user waits for.
Across sizes: the plain prepare's marginal rate, (MB2 - MB1) / (s2 - s1) of the best `none` prepares, against the
limit measured at the larger size. Writes bench/results/dedup_speed_<sizes>mb-<device>-<date>.json.
"""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import write_result  # noqa: E402
from bench.dedup import corpus_for, datatrove, last_json, machine_used_bytes, planted_quality, \
    run_prepare_child, train_tokenizer_once  # noqa: E402
from bench.dedup_corpus import corpus_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODES = ("none", "exact", "near")


# ----------------------------------------------------------------------------------------------- the encode limit
def _encode_share(files: list[str], tokenizer: str, share: int, shares: int, start, out) -> None:
    """One core's share, every `shares`-th batch of 256 documents from `share` on: read and clean them (untimed),
    wait for every process, then encode."""
    from pipeline.data.cleaning import clean_batch
    from pipeline.data.corpus import read_document_file
    from pipeline.data.tokenizer import Tokenizer

    tok = Tokenizer(tokenizer)
    batches, i = [], 0
    for f in files:
        with open(f, "rb") as fh:
            for block in read_document_file(fh, f, "jsonl", "text"):
                for a in range(0, block.num_rows, 256):
                    if i % shares == share:
                        batches.append(clean_batch(block.slice(a, 256))[0])
                    i += 1
    start.wait()
    t0, c0 = time.perf_counter(), time.process_time()
    tokens = sum(len(x) for texts in batches for x in tok.encode_batch(texts))
    out.put((sum(len(t.encode()) for texts in batches for t in texts), time.perf_counter() - t0, tokens,
             time.process_time() - c0))


def encode_limit(files: list[Path], tokenizer: Path, cores: int, max_mb: float) -> dict:
    """Corpus MB/s of SentencePiece alone on `cores` processes at once, each encoding its share of the documents of
    the corpus's first files up to `max_mb` (a rate: a sample does): their bytes over the slowest process's seconds;
    and each process's MB per CPU-second (what the load of other tenants moves least)."""
    sample, total = [], 0
    for f in files:
        if sample and total >= max_mb * 1e6:
            break
        sample.append(f)
        total += f.stat().st_size
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(cores), ctx.Queue()
    procs = [ctx.Process(target=_encode_share, args=([str(f) for f in sample], str(tokenizer), i, cores, start, out))
             for i in range(cores)]
    for p in procs:
        p.start()
    got = [out.get() for _ in procs]
    for p in procs:
        p.join()
    slowest = max(s for _, s, _, _ in got)
    return {"processes": cores, "sample_mb": round(total / 1e6, 1), "mb_per_s": round(total / 1e6 / slowest, 3),
            "corpus_mb_per_cpu_s": round(total / 1e6 / sum(c for _, _, _, c in got), 3),
            "text_mb_per_s_per_process": [round(b / 1e6 / s, 3) for b, s, _, _ in got],
            "load_1min": round(os.getloadavg()[0], 2)}


# ----------------------------------------------------------------------------------------------- the warm child
class _Peak:
    """The machine's used memory above its value at start, and this process's RSS, sampled every 0.25 s."""

    def __init__(self):
        import psutil

        self.me, self.base, self.machine, self.driver = psutil.Process(), machine_used_bytes(), 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.machine = max(self.machine, machine_used_bytes() - self.base)
            self.driver = max(self.driver, self.me.memory_info().rss)
            self._stop.wait(0.25)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {"peak_machine_above_start_mb": round(self.machine / 2**20, 1),
                "driver_peak_rss_mb": round(self.driver / 2**20, 1)}


def operator_stats(text: str) -> dict:
    """Per operator of a Ray Data stats text (Dataset.stats()): its tasks and their summed remote wall and CPU
    seconds."""
    ops: dict = {}
    name = None
    for line in text.splitlines():
        m = re.match(r"Operator \d+ (.+?): (\d+) tasks executed", line)
        if m:
            name = m.group(1)
            ops[name] = {"tasks": int(m.group(2))}
            continue
        m = re.match(r"\* Remote (wall|cpu) time: .* ([\d.]+)(us|ms|s) total", line)
        if m and name:
            ops[name][f"remote_{m.group(1)}_s"] = round(float(m.group(2)) * {"us": 1e-6, "ms": 1e-3, "s": 1}[m.group(3)],
                                                        3)
    return ops


def child_warm(args: argparse.Namespace) -> None:
    """_warm: a local Ray, a warm-up on --warmup-path, then the prepares of --path (modes alternated --repeat times)
    and deduplicate() alone; one JSON line on stdout."""
    import numpy as np
    import ray

    from bench.data_throughput import TreeCPU
    from pipeline.config import Config
    from pipeline.data.corpus import DOC_ID_BITS
    from pipeline.data.dedup import GroupSource, dedup_spec, deduplicate
    from pipeline.data.pack import prepare_dataset
    from pipeline.ray_runtime import ensure_ray

    notes: list[str] = []  # the prepare's debug lines: Ray Data's stats of its two passes

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            notes.append(record.getMessage())

    data_log = logging.getLogger("longtrain.data")
    data_log.setLevel(logging.DEBUG)
    data_log.addHandler(Keep())
    base = {"data.source": "files", "data.tokenizer": args.tokenizer, "data.seq_len": args.seq_len,
            "run.root": str(Path(args.work) / "runs"), "model.tier": "B"}
    t0 = time.perf_counter()
    ensure_ray(None, Config().replace({**base, "data.path": args.path}))
    ray_start_s = time.perf_counter() - t0

    def prepare(path: str, mode: str, tag: str) -> dict:
        cfg = Config().replace({**base, "data.path": path, "data.dedup": mode,
                                "data.dataset_dir": str(Path(args.work) / f"ds-{tag}-{mode}-{os.getpid()}")})
        notes.clear()
        load, peak, tree = os.getloadavg()[0], _Peak(), TreeCPU().start()
        t = time.perf_counter()
        _, m = prepare_dataset(cfg)
        seconds = time.perf_counter() - t
        cpu = tree.stop()
        return {"mode": mode, "prepare_s": round(seconds, 2), "dedup_s": (m.dedup or {}).get("seconds", 0.0),
                "dedup_stages": (m.dedup or {}).get("stage_seconds", {}), "tokenize_s": m.extra.get("tokenize_s"),
                "shards_after_tokenize_s": m.extra.get("shards_after_tokenize_s"), "cpu_s": round(cpu, 1),
                "cpu_by_process_kind": {k: round(v, 1) for k, v in sorted(tree.by_kind.items(), key=lambda kv: -kv[1])
                                        if v >= 0.1},
                "documents": m.counts.get("documents"), "tokens": m.counts.get("tokens_total"),
                "load_1min": [round(load, 2), round(os.getloadavg()[0], 2)], **peak.stop(),
                "ray_data": {n.split(":", 1)[0]: operator_stats(n) for n in notes if n.startswith("Ray Data")}}

    t1 = time.perf_counter()
    for mode in MODES:  # Ray's workers up, Numba's kernels compiled: what a cluster that has run once has
        prepare(args.warmup_path, mode, "warmup")
    warmup_s = time.perf_counter() - t1
    runs = []
    for i in range(args.repeat):
        for mode in MODES:
            runs.append({"round": i, **prepare(args.path, mode, f"r{i}")})
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    cfg = Config().replace({**base, "data.path": args.path, "data.dedup": "near"})
    t = time.perf_counter()
    result = deduplicate([GroupSource("", cfg.data, 0)], dedup_spec(cfg.data))
    stage = {"seconds": round(time.perf_counter() - t, 2), "stages": result.stage_seconds, "record": result.record(0)}
    nodes = np.concatenate([ray.get(ref).column("node").to_numpy() for ref in result.removal(0).refs] or [[]])
    mask = (1 << DOC_ID_BITS) - 1
    removed = [[int(n & mask) >> 32, int(n & mask) & 0xFFFFFFFF] for n in nodes]
    print(json.dumps({"ray_start_s": round(ray_start_s, 2), "warmup_s": round(warmup_s, 2), "runs": runs,
                      "stage": stage, "removed": removed}))


def run_warm(corpus: Path, warmup: Path, tokenizer: Path, work: Path, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "_warm", "--path", str(corpus), "--warmup-path",
           str(warmup), "--tokenizer", str(tokenizer), "--work", str(work), "--repeat", str(args.repeat),
           "--seq-len", str(args.seq_len)]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "RAY_worker_niceness": "0"})
    if out.returncode != 0:
        raise SystemExit(f"warm child failed ({out.returncode})")
    return last_json(out.stdout)


# ----------------------------------------------------------------------------------------------- one size
def measure(mb: float, args: argparse.Namespace, work: Path) -> dict:
    corpus = corpus_for(mb, work, args.seed)
    files = sorted(corpus.glob("*.jsonl"))
    size = corpus_bytes(files) / 1e6
    tokenizer = train_tokenizer_once(files, work)
    warmup = corpus_for(args.warmup_mb, work, args.seed + 1)
    cores = len(os.sched_getaffinity(0))
    row: dict = {"corpus_mb": round(size, 1), "cores": cores, "load_1min_start": round(os.getloadavg()[0], 2)}
    limits = [encode_limit(files, tokenizer, cores, args.limit_mb)]
    print(f"[{size:.0f} MB] SentencePiece alone on {cores} cores: {limits[0]['mb_per_s']:.2f} MB/s", flush=True)
    warm = run_warm(corpus, warmup, tokenizer, work, args)
    limits.append(encode_limit(files, tokenizer, cores, args.limit_mb))  # after the prepares too: the best counts
    row["encode_limit"] = {"mb_per_s": max(x["mb_per_s"] for x in limits), "runs": limits}
    print(f"[{size:.0f} MB] SentencePiece alone on {cores} cores, after: {limits[1]['mb_per_s']:.2f} MB/s", flush=True)
    row.update({k: warm[k] for k in ("ray_start_s", "warmup_s", "runs", "stage")})
    best = {m: min((r for r in warm["runs"] if r["mode"] == m), key=lambda r: r["prepare_s"]) for m in MODES}
    row["best_prepare_s"] = {m: best[m]["prepare_s"] for m in MODES}
    row["extra_over_none"] = {m: round(best[m]["prepare_s"] / best["none"]["prepare_s"] - 1, 4) for m in ("exact", "near")}
    row["dedup_stage_share_of_none"] = {m: round(best[m]["dedup_s"] / best["none"]["prepare_s"], 4)
                                        for m in ("exact", "near")}
    row["prepare_mb_per_s"] = {m: round(size / best[m]["prepare_s"], 2) for m in MODES}
    # CPU-seconds, which the other tenants of a shared machine move far less than seconds: the signature pass's (Ray
    # Data's own count of its tasks) and the prepares' (every process of the Ray, by bench/data_throughput.py TreeCPU)
    for run in warm["runs"]:
        ops = run["ray_data"].get("Ray Data, the signatures", {})
        run["signatures_cpu_s"] = round(sum(op.get("remote_cpu_s", 0.0) for op in ops.values()), 2)
    row["least_cpu_s"] = {m: min(r["cpu_s"] for r in warm["runs"] if r["mode"] == m) for m in MODES}
    row["signatures_cpu_share_of_none"] = {
        m: round(min(r["signatures_cpu_s"] for r in warm["runs"] if r["mode"] == m) / row["least_cpu_s"]["none"], 4)
        for m in ("exact", "near")}
    print(f"[{size:.0f} MB] prepares (best of {args.repeat}): {row['best_prepare_s']} s; extra over none "
          f"{row['extra_over_none']}; dedup stage alone {warm['stage']['seconds']} s", flush=True)
    where = {}
    pos = 0
    for i, f in enumerate(files):
        for line_no, _ in enumerate(open(f)):
            where[(i, line_no)] = pos
            pos += 1
    sides = {"longtrain": {where[(f, i)] for f, i in warm["removed"]}}
    if args.datatrove:
        row["datatrove"] = {}
        for words in ("matched", "spacy") if args.stock else ("matched",):
            seconds, removed = datatrove(args.datatrove, files, work / f"datatrove-{words}-{mb:g}", cores, words)
            sides[f"datatrove_{words}"] = removed
            s13 = sum(seconds[k] for k in ("signatures", "buckets", "clusters"))
            row["datatrove"][words] = {"seconds": {k: round(v, 2) for k, v in seconds.items()},
                                       "stages_1_3_s": round(s13, 2), "stages_1_3_mb_per_s": round(size / s13, 2)}
            print(f"[{size:.0f} MB] datatrove stages 1-3, {words} words: {s13:.1f} s", flush=True)
    row["quality"] = planted_quality(files, work, args.seed, mb, sides)
    if args.fresh:
        row["fresh"] = {m: run_prepare_child(corpus, m, tokenizer, work, args.seq_len) for m in MODES}
        fresh = {m: row["fresh"][m]["prepare_s"] + row["fresh"][m]["ray_start_s"] for m in MODES}
        row["fresh_extra_over_none"] = {m: round(fresh[m] / fresh["none"] - 1, 4) for m in ("exact", "near")}
    row["load_1min_end"] = round(os.getloadavg()[0], 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", nargs="?", default="run", choices=["run", "_warm"])
    ap.add_argument("--mb", type=float, action="append")
    ap.add_argument("--datatrove", default="", help="the Python of a virtualenv with datatrove")
    ap.add_argument("--stock", action="store_true", help="also datatrove's stock spaCy word splitting")
    ap.add_argument("--fresh", action="store_true", help="also each mode in a fresh process with its own Ray")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--warmup-mb", type=float, default=2.0)
    ap.add_argument("--limit-mb", type=float, default=100.0, help="the corpus sample SentencePiece's limit encodes")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default="", help="where corpora and datasets go (default: a temporary directory)")
    ap.add_argument("--smoke", action="store_true", help="a tiny run (checks the bench itself); written as _smoke")
    ap.add_argument("--out-dir", default="", help="results directory (default bench/results)")
    ap.add_argument("--path")
    ap.add_argument("--warmup-path")
    ap.add_argument("--tokenizer")
    args = ap.parse_args()
    if args.what == "_warm":
        child_warm(args)
        return
    args.mb = sorted(args.mb or [30.0])
    work = Path(args.work or tempfile.mkdtemp(prefix="dedup-speed-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = [measure(mb, args, work) for mb in args.mb]
    result: dict = {"args": {k: v for k, v in vars(args).items() if k not in ("path", "warmup_path", "tokenizer")},
                    "sizes": rows}
    if len(rows) >= 2:
        small, big = rows[0], rows[-1]
        marginal = (big["corpus_mb"] - small["corpus_mb"]) / (big["best_prepare_s"]["none"]
                                                             - small["best_prepare_s"]["none"])
        result["marginal_prepare_mb_per_s"] = round(marginal, 2)
        result["marginal_over_encode_limit"] = round(marginal / big["encode_limit"]["mb_per_s"], 3)
        print(f"marginal prepare rate {marginal:.2f} MB/s = {result['marginal_over_encode_limit']:.2f} x "
              f"SentencePiece's limit on these cores", flush=True)
        # the same in CPU-seconds: SentencePiece's CPU-s per MB alone over the prepare's marginal CPU-s per MB
        encode_cpu = 1 / max(x["corpus_mb_per_cpu_s"] for x in big["encode_limit"]["runs"])
        marginal_cpu = (big["least_cpu_s"]["none"] - small["least_cpu_s"]["none"]) / (big["corpus_mb"]
                                                                                     - small["corpus_mb"])
        result["marginal_cpu_s_per_mb"] = round(marginal_cpu, 4)
        result["encode_cpu_s_per_mb"] = round(encode_cpu, 4)
        # None when the two sizes' CPU cannot be told apart: the Ray's processes were not counted (a Ray this bench
        # did not start, as a test's session Ray: only the driver's CPU is seen) or the sizes are too close
        result["marginal_cpu_efficiency"] = round(encode_cpu / marginal_cpu, 3) if marginal_cpu > 0 else None
    name = "dedup_speed_smoke" if args.smoke else "dedup_speed_" + "_".join(f"{m:g}" for m in args.mb) + "mb"
    print(f"wrote {write_result(name, result, Path(args.out_dir) if args.out_dir else None)}")


if __name__ == "__main__":
    main()
