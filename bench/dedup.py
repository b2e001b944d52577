"""Deduplication in prepare: quality and speed on a planted-duplicates corpus against datatrove, memory at three corpus
sizes, and what exact deduplication costs a prepare.

    # datatrove (FineWeb's MinHash) runs in a virtualenv of its own: it is no dependency of longtrain
    python3 -m venv .venv-datatrove && .venv-datatrove/bin/pip install datatrove==0.10.1 spacy 'xxhash<4' regex tokenizers
    python bench/dedup.py quality --mb 30 --datatrove .venv-datatrove/bin/python   # recall, false merges, MB/s
    python bench/dedup.py memory --mb 100 --mb 300 --mb 900     # prepare with data.dedup=near on 2 cores
    python bench/dedup.py cost --mb 100                          # prepare with data.dedup=none / exact / near
    python bench/dedup.py cost --mb 100 --warm --modes none exact  # the same in one process and one Ray

quality: the planted corpus (bench/dedup_corpus.py: exact copies and copies with 1, 2, 5, 10 and 30 % of their words
changed, and distinct documents), deduplicated by longtrain's Ray Data stage (data.dedup=near, threshold 0.75, 5-grams)
and by datatrove's four MinHash stages (14 x 8, 5-grams) on the same files and cores. Per pair its true Jaccard
similarity of 5-gram sets; recall = share of planted pairs at or above 0.85 of which a document was removed; false
merges = the same share for pairs below 0.6 (and for distinct documents: any removed that is no copy). Throughput:
corpus MB / seconds from reading the .jsonl to the removal list (longtrain: `deduplicate`, in a Ray already up, cold =
its first run in that Ray and warm = the second; datatrove: stages 1-3, and 1-4 with its filter). Agreement: the
share of documents both keep or both remove, and the Jaccard similarity of the two kept sets.

memory: one prepare per size in a fresh child process (its own local Ray on the machine's cores), data.dedup=near, a
tokenizer trained once beforehand (not timed); sampled every 0.25 s: the machine's used memory (MemTotal -
MemAvailable) above what it was just before the child started, the child's (the driver's) RSS, and the RSS of the
child's whole process tree (driver, Ray's daemons, workers; shared object-store pages count in every process that maps
them). The child also samples its own RSS every 50 ms. (Its ru_maxrss is no measure: Linux keeps it across the exec,
so it starts at the parent's RSS at the fork, and the parent has just generated the corpus.) The machine is shared:
other tenants' memory moves the first figure; the load average is recorded.

cost: prepares of one corpus with data.dedup=none, exact and near, alternated --repeat times, each in a fresh child
(same tokenizer); the fastest of each. The extra time of exact over none is what exact deduplication costs. With
--warm every prepare runs in one child and one Ray (a cluster is up once, not per dataset), after a first round that
warms Ray's workers up and is left out; also each prepare's own dedup seconds over its prepare seconds.

Writes bench/results/dedup_<what>-<device>-<date>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import write_result  # noqa: E402
from bench.dedup_corpus import corpus_bytes, write_planted  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------- helpers
def last_json(stdout: str) -> dict:
    """A child's result: its last line that is a JSON object (Ray may forward its workers' lines after it)."""
    return json.loads([ln for ln in stdout.strip().splitlines() if ln.startswith("{")][-1])


def machine_used_bytes() -> int:
    info = {}
    for line in open("/proc/meminfo"):
        k, v = line.split(":", 1)
        info[k] = int(v.split()[0]) * 1024
    return info["MemTotal"] - info["MemAvailable"]


class MemorySampler:
    """Peak machine memory above a baseline, and peak RSS of a process and of its tree, sampled every 0.25 s."""

    def __init__(self, pid: int, baseline: int):
        import psutil

        self.proc, self.psutil, self.baseline = psutil.Process(pid), psutil, baseline
        self.peak_machine = self.peak_driver = self.peak_tree = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_machine = max(self.peak_machine, machine_used_bytes() - self.baseline)
            try:
                procs = [self.proc] + self.proc.children(recursive=True)
                rss = {}
                for p in procs:
                    try:
                        rss[p.pid] = p.memory_info().rss
                    except self.psutil.Error:
                        pass
                self.peak_driver = max(self.peak_driver, rss.get(self.proc.pid, 0))
                self.peak_tree = max(self.peak_tree, sum(rss.values()))
            except self.psutil.Error:
                pass
            self._stop.wait(0.25)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        mb = 1 / 2**20
        return {"peak_machine_above_idle_mb": round(self.peak_machine * mb, 1),
                "peak_driver_rss_mb": round(self.peak_driver * mb, 1), "peak_tree_rss_mb": round(self.peak_tree * mb, 1)}


def train_tokenizer_once(files: list[Path], out: Path, vocab: int = 8000) -> Path:
    from pipeline.data.tokenizer import train_tokenizer

    def sample():
        seen = 0
        for f in files:
            for line in open(f):
                t = json.loads(line)["text"]
                yield t
                seen += len(t)
                if seen > 20_000_000:
                    return

    path = out / "tokenizer.model"
    if not path.exists():
        train_tokenizer(sample(), vocab, str(path))
    return path


def run_prepare_child(corpus: Path, mode: str, tokenizer: Path, work: Path, seq_len: int = 2048) -> dict:
    """One prepare in a fresh child process, sampled; returns its figures."""
    baseline = machine_used_bytes()
    load0 = os.getloadavg()[0]
    cmd = [sys.executable, str(Path(__file__).resolve()), "_prepare", "--path", str(corpus), "--dedup", mode,
           "--tokenizer", str(tokenizer), "--work", str(work), "--seq-len", str(seq_len)]
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                             env={**os.environ, "RAY_worker_niceness": "0"})
    sampler = MemorySampler(child.pid, baseline)
    out, err = child.communicate()
    wall = time.perf_counter() - t0
    mem = sampler.stop()
    if child.returncode != 0:
        raise SystemExit(f"prepare child failed ({child.returncode}):\n{err[-3000:]}")
    result = last_json(out)
    return {**result, **mem, "child_wall_s": round(wall, 2), "load_1min": [load0, os.getloadavg()[0]]}


def child_prepare(args: argparse.Namespace) -> None:
    """_prepare: start a local Ray, then time prepare() of the corpus; print one JSON line."""
    from pipeline.config import Config
    from pipeline.data.pack import prepare_dataset
    from pipeline.ray_runtime import ensure_ray

    cfg = Config().replace({"data.source": "files", "data.path": args.path, "data.dedup": args.dedup,
                            "data.tokenizer": args.tokenizer, "data.seq_len": args.seq_len,
                            "data.dataset_dir": str(Path(args.work) / f"ds-{args.dedup}-{os.getpid()}"),
                            "run.root": str(Path(args.work) / "runs"), "model.tier": "B"})
    import psutil

    me, peak, done = psutil.Process(), [0], threading.Event()

    def sample() -> None:  # this process's own peak (ru_maxrss would count the parent's pages at the fork)
        while not done.is_set():
            peak[0] = max(peak[0], me.memory_info().rss)
            done.wait(0.05)

    threading.Thread(target=sample, daemon=True).start()
    t0 = time.perf_counter()
    ensure_ray(None, cfg)
    t1 = time.perf_counter()
    rss_ray_up = me.memory_info().rss
    _, m = prepare_dataset(cfg)
    t2 = time.perf_counter()
    done.set()
    print(json.dumps({"mode": args.dedup, "ray_start_s": round(t1 - t0, 2), "prepare_s": round(t2 - t1, 2),
                      "driver_rss_after_ray_start_mb": round(rss_ray_up / 2**20, 1),
                      "driver_peak_rss_mb_sampled_50ms": round(peak[0] / 2**20, 1),
                      "documents": m.counts.get("documents"), "tokens": m.counts.get("tokens_total"),
                      "dedup": m.dedup, "extra": {k: v for k, v in m.extra.items() if k.endswith("_s")}}))


# ----------------------------------------------------------------------------------------------- quality
def positions(files: list[Path]) -> dict[tuple[int, int], int]:
    """(file index, line) -> the document's position in the corpus."""
    out, pos = {}, 0
    for i, f in enumerate(files):
        for line_no, _ in enumerate(open(f)):
            out[(i, line_no)] = pos
            pos += 1
    return out


def ours(files: list[Path], corpus_dir: Path, runs: int = 2) -> tuple[list[dict], set[int]]:
    import numpy as np
    import ray

    from pipeline.config import Config
    from pipeline.data.corpus import DOC_ID_BITS
    from pipeline.data.dedup import GroupSource, dedup_spec, deduplicate
    from pipeline.ray_runtime import ensure_ray

    cfg = Config().replace({"data.source": "files", "data.path": str(corpus_dir), "data.dedup": "near",
                            "run.root": str(corpus_dir.parent / "runs")})
    ensure_ray(None, cfg)
    timings, removed = [], set()
    for _ in range(runs):
        t0 = time.perf_counter()
        r = deduplicate([GroupSource("", cfg.data, 0)], dedup_spec(cfg.data))
        timings.append({"seconds": round(time.perf_counter() - t0, 2), **r.stage_seconds})
        nodes = np.concatenate([ray.get(ref).column("node").to_numpy() for ref in r.removal(0).refs] or [[]])
        mask = (1 << DOC_ID_BITS) - 1
        where = positions(files)
        removed = {where[(int(n & mask) >> 32, int(n & mask) & 0xFFFFFFFF)] for n in nodes}
    return timings, removed


def datatrove(python: str, files: list[Path], work: Path, workers: int, words: str = "spacy"
              ) -> tuple[dict, set[int]]:
    """datatrove's stages on `files` in its own virtualenv (bench/dedup_datatrove.py): (seconds per stage, the removed
    documents' corpus positions). `words`: spacy (its stock splitting) or matched (longtrain's)."""
    out = subprocess.run([python, str(Path(__file__).with_name("dedup_datatrove.py")), "--work", str(work),
                          "--workers", str(workers), "--words", words, *map(str, files)], capture_output=True,
                         text=True)
    if out.returncode != 0:
        raise SystemExit(f"datatrove failed:\n{out.stderr[-3000:]}")
    got = last_json(out.stdout)
    where = positions(files)
    return got["seconds"], {where[(f, i)] for f, i in got["removed"]}


def score(pairs: list[dict], documents: int, sides: dict[str, set[int]]) -> dict:
    """Per side (its removed corpus positions) against the planted pairs (each with its true `jaccard`): recall of
    pairs at >= 0.85, false merges of pairs below 0.6, distinct documents removed, merges per Jaccard bin and per
    share of words changed. A pair counts as merged when either of its documents was removed."""
    copies = {p["copy"] for p in pairs} | {p["original"] for p in pairs}
    bins = [(0.0, 0.6), (0.6, 0.75), (0.75, 0.85), (0.85, 1.01)]
    out: dict = {}
    for name, removed in sides.items():
        merged = [p["original"] in removed or p["copy"] in removed for p in pairs]
        per_bin = {}
        for lo, hi in bins:
            sel = [m for m, p in zip(merged, pairs) if lo <= p["jaccard"] < hi]
            per_bin[f"{lo:g}-{min(hi, 1):g}"] = {"pairs": len(sel), "merged": sum(sel),
                                                 "share": round(sum(sel) / len(sel), 4) if sel else None}
        by_change = {}
        for share in sorted({p["changed"] for p in pairs}):
            sel = [(m, p["jaccard"]) for m, p in zip(merged, pairs) if p["changed"] == share]
            by_change[f"{share:g}"] = {"pairs": len(sel), "merged": sum(m for m, _ in sel),
                                       "mean_jaccard": round(sum(j for _, j in sel) / len(sel), 4)}
        above = [m for m, p in zip(merged, pairs) if p["jaccard"] >= 0.85]
        below = [m for m, p in zip(merged, pairs) if p["jaccard"] < 0.6]
        out[name] = {"recall_above_0.85": round(sum(above) / max(1, len(above)), 4),
                     "false_merges_below_0.6": round(sum(below) / max(1, len(below)), 4),
                     "distinct_documents_removed": len(removed - copies), "by_jaccard": per_bin,
                     "by_words_changed": by_change, "removed": len(removed), "documents": documents}
    return out


def planted_quality(files: list[Path], work: Path, seed: int, mb: float, sides: dict[str, set[int]]) -> dict:
    """score() of each side on the corpus corpus_for(mb, work, seed) wrote (its truth kept beside it)."""
    truth = json.loads((work / f"corpus-{mb:g}mb.truth.json").read_text())
    return score(truth["pairs"], truth["documents"], sides)


def quality(args: argparse.Namespace) -> None:
    from pipeline.data.dedup_signatures import jaccard

    if args.work:
        Path(args.work).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="dedup-quality-", dir=args.work or None)).resolve()
    corpus_dir = work / "corpus"
    planted = write_planted(corpus_dir, args.mb[0], seed=args.seed)
    mb = corpus_bytes(planted.files) / 1e6
    texts = [json.loads(line)["text"] for f in planted.files for line in open(f)]
    for p in planted.pairs:
        p["jaccard"] = jaccard(texts[p["original"]], texts[p["copy"]], 5)
    load0 = os.getloadavg()[0]
    our_times, our_removed = ours(planted.files, corpus_dir)
    sides = {"longtrain": our_removed}
    result: dict = {"corpus_mb": round(mb, 1), "documents": planted.documents, "planted_pairs": len(planted.pairs),
                    "cores": os.cpu_count(), "longtrain_runs": our_times,
                    "longtrain_mb_per_s": {"cold": round(mb / our_times[0]["seconds"], 2),
                                           "warm": round(mb / our_times[-1]["seconds"], 2)}}
    if args.datatrove:
        dt_seconds, dt_removed = datatrove(args.datatrove, planted.files, work / "datatrove", os.cpu_count() or 2,
                                           args.words)
        sides["datatrove"] = dt_removed
        s13 = sum(dt_seconds[k] for k in ("signatures", "buckets", "clusters"))
        result["datatrove_seconds"] = {k: round(v, 2) for k, v in dt_seconds.items()}
        result["datatrove_mb_per_s"] = {"stages_1_3": round(mb / s13, 2),
                                        "stages_1_4": round(mb / sum(dt_seconds.values()), 2)}
        everyone = set(range(planted.documents))
        kept_a, kept_b = everyone - our_removed, everyone - dt_removed
        result["agreement"] = {"same_decision": round(1 - len(our_removed ^ dt_removed) / planted.documents, 5),
                               "kept_jaccard": round(len(kept_a & kept_b) / len(kept_a | kept_b), 5),
                               "removed_by_longtrain_only": len(our_removed - dt_removed),
                               "removed_by_datatrove_only": len(dt_removed - our_removed)}
    result["load_1min"] = [load0, os.getloadavg()[0]]
    result.update(score(planted.pairs, planted.documents, sides))
    path = write_result("dedup_quality", {"args": vars(args), **result})
    print(json.dumps(result, indent=1))
    print(f"wrote {path}")


# ----------------------------------------------------------------------------------------------- memory and cost
def corpus_for(mb: float, work: Path, seed: int) -> Path:
    """The planted corpus of about `mb` MB under `work` (written once), its truth beside it in
    corpus-<mb>mb.truth.json: the pairs (original, copy, share of words changed, true Jaccard similarity of their
    5-gram sets)."""
    from pipeline.data.dedup_signatures import jaccard

    d = work / f"corpus-{mb:g}mb"
    truth = work / f"corpus-{mb:g}mb.truth.json"
    if not (d / "done").exists() or not truth.exists():
        planted = write_planted(d, mb, seed=seed)
        wanted = {i for p in planted.pairs for i in (p["original"], p["copy"])}
        texts = {i: json.loads(line)["text"] for i, line in enumerate(line for f in planted.files for line in open(f))
                 if i in wanted}
        for p in planted.pairs:
            p["jaccard"] = jaccard(texts[p["original"]], texts[p["copy"]], 5)
        truth.write_text(json.dumps({"documents": planted.documents, "pairs": planted.pairs}))
        (d / "done").write_text("")
    return d


def memory(args: argparse.Namespace) -> None:
    work = Path(args.work or tempfile.mkdtemp(prefix="dedup-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    tokenizer = None
    for mb in args.mb:
        corpus = corpus_for(mb, work, args.seed)
        files = sorted(corpus.glob("*.jsonl"))
        tokenizer = tokenizer or train_tokenizer_once(files, work)
        row = {"corpus_mb": round(corpus_bytes(files) / 1e6, 1), **run_prepare_child(corpus, "near", tokenizer, work)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        path = write_result(f"dedup_memory_{'_'.join(f'{m:g}' for m in args.mb)}mb",
                            {"args": vars(args), "mode": "near", "cores": os.cpu_count(), "rows": rows})
    print(f"wrote {path}")


def child_warm(args: argparse.Namespace) -> None:
    """_warm: one local Ray, then prepares of the corpus with each of --modes in turn, --repeat rounds (the first
    prepare also warms Ray's workers up: it is recorded apart); one JSON line."""
    from pipeline.config import Config
    from pipeline.data.pack import prepare_dataset
    from pipeline.ray_runtime import ensure_ray

    base = {"data.source": "files", "data.path": args.path, "data.tokenizer": args.tokenizer,
            "data.seq_len": args.seq_len, "run.root": str(Path(args.work) / "runs"), "model.tier": "B"}
    ensure_ray(None, Config().replace(base))
    runs = []
    for i in range(args.repeat + 1):
        for mode in args.modes:
            cfg = Config().replace({**base, "data.dedup": mode,
                                    "data.dataset_dir": str(Path(args.work) / f"warm-{mode}-{os.getpid()}-{i}")})
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            _, m = prepare_dataset(cfg)
            runs.append({"round": i, "mode": mode, "prepare_s": round(time.perf_counter() - t0, 2),
                         "dedup_s": (m.dedup or {}).get("seconds", 0.0), "dedup_stages": (m.dedup or {}).get(
                             "stage_seconds", {}), "tokenize_s": m.extra.get("tokenize_s"), "load_1min": load})
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"runs": runs}))


def cost_warm(args: argparse.Namespace) -> None:
    """cost --warm: the prepares in one process and one Ray, alternated (round 0 warms up and is left out)."""
    work = Path(args.work or tempfile.mkdtemp(prefix="dedup-cost-"))
    work.mkdir(parents=True, exist_ok=True)
    corpus = corpus_for(args.mb[0], work, args.seed)
    files = sorted(corpus.glob("*.jsonl"))
    tokenizer = train_tokenizer_once(files, work)
    cmd = [sys.executable, str(Path(__file__).resolve()), "_warm", "--path", str(corpus), "--tokenizer",
           str(tokenizer), "--work", str(work), "--repeat", str(args.repeat), "--modes", *args.modes]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "RAY_worker_niceness": "0"})
    if out.returncode != 0:
        raise SystemExit(f"warm child failed ({out.returncode})")
    runs = last_json(out.stdout)["runs"]
    measured = [r for r in runs if r["round"] > 0]
    best = {m: min(r["prepare_s"] for r in measured if r["mode"] == m) for m in args.modes}
    share = {m: round(min(r["dedup_s"] / r["prepare_s"] for r in measured if r["mode"] == m), 4)
             for m in args.modes if m != "none"}
    result = {"corpus_mb": round(corpus_bytes(files) / 1e6, 1), "cores": os.cpu_count(), "warm_ray": True,
              "best_prepare_s": best,
              "extra_share_over_none": {m: round(best[m] / best["none"] - 1, 4) for m in best if m != "none"},
              "dedup_share_of_its_prepare": share, "runs": runs}
    path = write_result(f"dedup_cost_warm_{args.mb[0]:g}mb", {"args": vars(args), **result})
    print(json.dumps({k: result[k] for k in ("best_prepare_s", "extra_share_over_none", "dedup_share_of_its_prepare")},
                     indent=1))
    print(f"wrote {path}")


def cost(args: argparse.Namespace) -> None:
    work = Path(args.work or tempfile.mkdtemp(prefix="dedup-cost-"))
    work.mkdir(parents=True, exist_ok=True)
    corpus = corpus_for(args.mb[0], work, args.seed)
    files = sorted(corpus.glob("*.jsonl"))
    tokenizer = train_tokenizer_once(files, work)
    runs: dict[str, list] = {m: [] for m in args.modes}
    for _ in range(args.repeat):
        for mode in args.modes:
            r = run_prepare_child(corpus, mode, tokenizer, work)
            runs[mode].append(r)
            print(json.dumps({k: r[k] for k in ("mode", "prepare_s", "load_1min")}), flush=True)
    best = {m: min(r["prepare_s"] for r in rs) for m, rs in runs.items()}
    result = {"corpus_mb": round(corpus_bytes(files) / 1e6, 1), "cores": os.cpu_count(), "best_prepare_s": best,
              "extra_share_over_none": {m: round(best[m] / best["none"] - 1, 4) for m in best if m != "none"},
              "runs": runs}
    path = write_result(f"dedup_cost_{args.mb[0]:g}mb", {"args": vars(args), **result})
    print(json.dumps({k: result[k] for k in ("best_prepare_s", "extra_share_over_none")}, indent=1))
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["quality", "memory", "cost", "_prepare", "_warm"])
    ap.add_argument("--warm", action="store_true", help="cost: every prepare in one process and one Ray")
    ap.add_argument("--mb", type=float, action="append")
    ap.add_argument("--datatrove", default="", help="the Python of a virtualenv with datatrove (quality)")
    ap.add_argument("--words", choices=("spacy", "matched"), default="spacy",
                    help="quality: datatrove's word splitting, its stock spaCy or longtrain's (bench/dedup_datatrove.py)")
    ap.add_argument("--work", default="", help="where corpora and datasets go (default: a temporary directory)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--modes", nargs="+", default=["none", "exact", "near"])
    # _prepare (the child)
    ap.add_argument("--path")
    ap.add_argument("--dedup")
    ap.add_argument("--tokenizer")
    ap.add_argument("--seq-len", type=int, default=2048)
    args = ap.parse_args()
    if args.what in ("_prepare", "_warm"):
        (child_prepare if args.what == "_prepare" else child_warm)(args)
        return
    args.mb = args.mb or ([30.0] if args.what == "quality" else [100.0])
    if args.what == "cost" and args.warm:
        cost_warm(args)
        return
    {"quality": quality, "memory": memory, "cost": cost}[args.what](args)


if __name__ == "__main__":
    main()
