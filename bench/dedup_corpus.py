"""The planted-duplicates corpus of bench/dedup.py: distinct documents and copies of some of them at known Jaccard
similarities, written as .jsonl files, with the ground truth beside them (which document copies which, and the
pair's true Jaccard similarity of word 5-gram sets).

    write_planted(out_dir, megabytes=30, seed=0)   # -> Planted(files, pairs, documents)

Distinct documents are 200 to 1,200 words drawn from the word frequencies of the built-in corpus (pydoc topics and
stdlib docstrings: English prose about Python), so two distinct documents share almost no 5-gram. Each planted copy
takes one distinct document and changes a given share of its words (an exact copy: none, with its spacing changed);
copies land anywhere in the corpus, before or after their original. Imports nothing of datatrove (its side reads the
same .jsonl files in its own process).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# share of the corpus's documents that are copies of another, by the share of words changed (0 = an exact copy)
PLANTED = {0.0: 0.05, 0.01: 0.05, 0.02: 0.05, 0.05: 0.05, 0.10: 0.05, 0.30: 0.05}
FILE_MB = 8


@dataclass
class Planted:
    files: list[Path]
    documents: int
    pairs: list[dict] = field(default_factory=list)  # {"original": i, "copy": j, "changed": share} by corpus position


def vocabulary(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(words, probabilities) of the built-in corpus's lowercase words (those seen at least twice)."""
    from pipeline.data.builtin_corpus import builtin_document, builtin_items

    counts: dict[str, int] = {}
    for item in builtin_items():
        for w in re.findall(r"[A-Za-z]+", builtin_document(item)):
            w = w.lower()
            counts[w] = counts.get(w, 0) + 1
    words = sorted(w for w, c in counts.items() if c >= 2)
    freq = np.array([counts[w] for w in words], np.float64)
    return np.array(words, dtype=object), freq / freq.sum()


def write_planted(out: Path, megabytes: float, seed: int = 0, planted: dict[float, float] | None = None) -> Planted:
    """Write corpus-NN.jsonl files of about `megabytes` MB into `out`; returns what was planted where. Document i is
    the i-th line over the files in name order (the order both pipelines read)."""
    planted = PLANTED if planted is None else planted
    rng = np.random.default_rng(seed)
    words, prob = vocabulary()
    out.mkdir(parents=True, exist_ok=True)
    avg_bytes = 700 * 6.2  # ~700 words of ~5.2 letters and a space
    n = max(10, int(megabytes * 1e6 / avg_bytes))
    n_copies = {share: int(n * frac) for share, frac in planted.items()}
    n_distinct = n - sum(n_copies.values())
    lengths = rng.integers(200, 1200, n_distinct)
    ids = rng.choice(len(words), size=int(lengths.sum()), p=prob)
    cuts = np.concatenate([[0], np.cumsum(lengths)])
    distinct = [ids[cuts[i]:cuts[i + 1]] for i in range(n_distinct)]
    # copies: (original distinct index, share); the originals are distinct documents, each copied at most once
    originals = rng.permutation(n_distinct)
    copies, k = [], 0
    for share, m in n_copies.items():
        for _ in range(m):
            copies.append((int(originals[k % n_distinct]), share))
            k += 1
    order = rng.permutation(n_distinct + len(copies))  # position in the corpus of each document
    texts: list[str | None] = [None] * len(order)
    pos_of_distinct = {}
    for slot, item in enumerate(order):
        if item < n_distinct:
            texts[slot] = " ".join(words[distinct[item]])
            pos_of_distinct[int(item)] = slot
    pairs = []
    for slot, item in enumerate(order):
        if item >= n_distinct:
            orig, share = copies[item - n_distinct]
            w = distinct[orig].copy()
            if share == 0.0:
                text = " ".join(words[w]).replace(" ", "\n", 3) + "\n"  # an exact copy but for its spacing
            else:
                change = rng.choice(len(w), size=max(1, int(round(share * len(w)))), replace=False)
                w[change] = rng.choice(len(words), size=len(change), p=prob)
                text = " ".join(words[w])
            texts[slot] = text
            pairs.append({"original": pos_of_distinct[orig], "copy": slot, "changed": share})
    files, f, written = [], None, 0
    for text in texts:
        if f is None or f.tell() >= FILE_MB * 1e6:
            if f is not None:
                f.close()
            files.append(out / f"corpus-{len(files):03d}.jsonl")
            f = open(files[-1], "w")
        line = json.dumps({"text": text}) + "\n"
        f.write(line)
        written += len(line)
    f.close()
    return Planted(files, len(texts), pairs)


def corpus_bytes(files: list[Path]) -> int:
    return sum(p.stat().st_size for p in files)
