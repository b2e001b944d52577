"""The tasks every run has data for: made from its dataset's held-out documents (the validation split), in the
harness's own YAML format (eval_tasks/builtin_cloze.yaml, eval_tasks/builtin_docs.yaml in the repository), so the
default run on the built-in corpus shows a benchmark curve without a download.

    config = builtin_task_config("builtin_cloze", dataset_dir, manifest, tokenizer)   # a harness task config (dict)

builtin_cloze: which of four orders of the CLOZE_WORDS words that follow a passage of a held-out document is the real
one (the others are the same words shuffled; chance 0.25; acc, acc_norm).
builtin_docs: each held-out document's log-likelihood in rolling windows (word and byte perplexity, bits per byte).

The documents are the validation rows' tokens split at EOS and decoded with the dataset's tokenizer (a document cut
by a row's edge is kept as the part the row holds). The data file is written once per dataset into a local cache
folder (LONGTRAIN_EVAL_TASKS_DIR, else <tmp>/longtrain-eval-tasks; then <settings hash>-v<DATA_VERSION>/),
atomically: the same bytes for every process that writes it, so concurrent scorers agree.
"""
from __future__ import annotations

import json
import os
import random
import re
import tempfile
from pathlib import Path
from typing import Any

import yaml

TASKS_DIR = Path(__file__).resolve().parents[2] / "eval_tasks"  # the repository's task YAMLs
BUILTIN_TASKS = ("builtin_cloze", "builtin_docs")
CACHE_ENV = "LONGTRAIN_EVAL_TASKS_DIR"
CLOZE_WORDS = 6  # words per answer span
CLOZE_CONTEXT_WORDS = (24, 64)  # words of passage before the answer (the shortest and longest)
MAX_ITEMS = 200  # items per task at most (eval.limit takes fewer)
SEED = 0
DATA_VERSION = 2  # in the cache's folder name: a change to how the items are made writes them anew


def held_out_documents(dataset_dir: str | Path, manifest, tokenizer, min_words: int = 8) -> list[str]:
    """The validation split's documents as text, in row order: each row's tokens split at EOS, decoded; pieces
    shorter than `min_words` words are left out."""
    import numpy as np

    from pipeline.data.shards import ShardReader

    reader = ShardReader(dataset_dir, "val", 1, drop_last=False, manifest=manifest)
    if not len(reader):
        return []
    tokens = reader.read_rows(np.arange(manifest.rows("val")))["tokens"]
    special = {manifest.pad_id, manifest.unk_id, manifest.bos_id}
    docs = []
    for row in tokens.tolist():
        piece: list[int] = []
        for t in row + [manifest.eos_id]:
            if t == manifest.eos_id:
                text = tokenizer.decode(piece).strip() if piece else ""
                if len(text.split()) >= min_words:
                    docs.append(text)
                piece = []
            elif t not in special:
                piece.append(t)
    return docs


def cloze_items(docs: list[str], n: int = MAX_ITEMS, seed: int = SEED) -> list[dict[str, Any]]:
    """Up to `n` items {context, choices (4), label}: a passage of each document long enough, then its next CLOZE_WORDS
    words in their own order and in three other orders. The choices hold the same words, so only a model that has
    learnt how words follow one another tells the real order from the others (how often a word occurs does not
    help, and acc_norm, which divides by the bytes, equals acc). Deterministic for a seed."""
    rng = random.Random(seed)
    lo, hi = CLOZE_CONTEXT_WORDS
    items = []
    for doc in docs:
        if len(items) >= n:
            break
        w = re.split(r"\s+", doc.strip())
        if len(w) < lo + CLOZE_WORDS:
            continue
        cut = rng.randint(lo, min(hi, len(w) - CLOZE_WORDS))
        words = w[cut:cut + CLOZE_WORDS]
        answer = " ".join(words)
        choices = [answer]
        for _ in range(100):  # a span with few distinct words has fewer than four orders: left out
            if len(choices) == 4:
                break
            order = words[:]
            rng.shuffle(order)
            if " ".join(order) not in choices:
                choices.append(" ".join(order))
        if len(choices) < 4:
            continue
        rng.shuffle(choices)
        items.append({"context": " ".join(w[:cut]), "choices": choices, "label": choices.index(answer)})
    return items


def docs_items(docs: list[str], n: int = MAX_ITEMS) -> list[dict[str, Any]]:
    return [{"text": d} for d in docs[:n]]


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path(tempfile.gettempdir()) / "longtrain-eval-tasks")


def write_items(path: Path, items: list[dict[str, Any]]) -> Path:
    """`items` as JSON lines at `path`, atomically (a temporary file in the same folder, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        for item in items:
            f.write(json.dumps(item, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


def task_data(name: str, dataset_dir: str | Path, manifest, tokenizer) -> Path:
    """The data file of builtin task `name` for this dataset, written when not there yet."""
    path = cache_dir() / f"{manifest.settings_hash}-v{DATA_VERSION}" / f"{name}.jsonl"
    if path.is_file():
        return path
    docs = held_out_documents(dataset_dir, manifest, tokenizer)
    items = cloze_items(docs) if name == "builtin_cloze" else docs_items(docs)
    if not items:
        raise ValueError(f"{name}: the validation split of {dataset_dir} holds too little text for the task (no "
                         f"document of {CLOZE_CONTEXT_WORDS[0] + CLOZE_WORDS} words or more); raise data.val_fraction")
    return write_items(path, items)


def builtin_task_config(name: str, dataset_dir: str | Path, manifest, tokenizer) -> dict[str, Any]:
    """The harness task config of builtin task `name` (its YAML from eval_tasks/, data_files pointed at the data
    written for this dataset)."""
    config = yaml.safe_load((TASKS_DIR / f"{name}.yaml").read_text())
    config["dataset_kwargs"] = {"data_files": {"test": str(task_data(name, dataset_dir, manifest, tokenizer))}}
    return config
