"""Passkey retrieval: can the model find a 5-digit key hidden at any depth of a long text? (`eval --passkey`)

    python pipeline/run.py eval --resume runs/<run> --passkey                   # lengths up to 2x the trained one
    python pipeline/run.py eval --checkpoint DIR --passkey --passkey-lengths 1024,4096 --passkey-trials 10

    grid = passkey_grid(decoder, tokenizer, haystack_tokens(dataset_dir), lengths=[256, 512], trials=5)
    grid.accuracy            # (len(lengths), len(depths)) exact-key accuracy, 0..1

The prompt (the key sentence and question of Mohtashami & Jaggi's landmark-attention paper, which LongLoRA, YaRN
and ProLong reuse, under shorter instructions, so that a CPU model's short rows still hold a haystack):

    <bos>There is a pass key hidden in this text. Find it and remember it.
    ... haystack ... The pass key is 48213. Remember it. 48213 is the pass key. ... haystack ...
    What is the pass key? The pass key is

The haystack is the validation split's own text (its tokens, special ids removed, from a random offset; no
download), cut so that the whole prompt is exactly `length` tokens, with the key sentence after `depth` of it
(0 = right after the instructions, 1 = right before the question). The model decodes greedily (KV cache,
model/decode_loop.py); a trial is right when the continuation, leading spaces stripped, starts with the key.
Chance is 1e-5 for the exact key; `digit_accuracy` (the share of the 5 digits right in place, chance 0.1 for a
model that answers digits) says how close a wrong answer came. Lengths shorter than the instructions, key
sentence and question plus MIN_HAYSTACK tokens are left out (`skipped`).

Default lengths (`default_lengths`): doubling from 1,024 (or a quarter of the trained length, when that is
shorter: a CPU model) up to the trained length, then twice the trained length, which tells whether retrieval
holds past the positions training used. Depths: 0, 25, 50, 75, 100 %.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from pipeline.tracking.names import ACCURACY, DIGIT_ACCURACY, PASSKEY, accuracy_at_length, split_metric

INTRO = "There is a pass key hidden in this text. Find it and remember it.\n"
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
MIN_HAYSTACK = 16  # a length must leave at least this many haystack tokens
FIRST_LENGTH = 1024
BATCH_TOKENS = 1 << 16  # prompt tokens per generation batch (batch = this // length, at least 1)


class PasskeyError(ValueError):
    """The passkey grid cannot be made (no length fits, no haystack text); the message names the fix."""


def default_lengths(trained_len: int) -> list[int]:
    """Doubling from min(1024, trained_len // 4) up to trained_len, then 2 x trained_len."""
    length, out = max(1, min(FIRST_LENGTH, trained_len // 4)), []
    while length < trained_len:
        out.append(length)
        length *= 2
    return out + [trained_len, 2 * trained_len]


def haystack_tokens(dataset_dir: str | Path, max_tokens: int = 1 << 22, split: str = "val") -> np.ndarray:
    """The split's tokens in stream order, special ids (pad, unk, bos, eos) removed, at most `max_tokens` of them:
    the text haystacks are cut from (the validation split's, unless told otherwise)."""
    from pipeline.data.shards import ShardReader, load_manifest
    from pipeline.eval.long_rows import seq_ids_of

    manifest = load_manifest(dataset_dir)
    reader = ShardReader(dataset_dir, split, 1, drop_last=False)
    order = np.argsort(seq_ids_of(dataset_dir, split), kind="stable")
    need = -(-max_tokens // manifest.window)
    tokens = reader.read_rows(order[:need])["tokens"].reshape(-1)
    special = np.isin(tokens, [manifest.pad_id, manifest.unk_id, manifest.bos_id, manifest.eos_id])
    return tokens[~special][:max_tokens]


@dataclass
class PasskeyGrid:
    lengths: list[int]  # prompt lengths in tokens (rows of the grid)
    depths: list[float]  # where the key sits, 0..1 (columns)
    trials: int  # keys per cell
    accuracy: np.ndarray  # (len(lengths), len(depths)) exact key, 0..1
    digit_accuracy: np.ndarray  # (len(lengths), len(depths)) share of digits right in place
    skipped: list[int] = field(default_factory=list)  # lengths too short for the prompt's fixed text
    examples: list[dict] = field(default_factory=list)  # one answer per cell: length, depth, key, answer

    @property
    def mean_accuracy(self) -> float:
        return float(self.accuracy.mean()) if self.accuracy.size else float("nan")

    def metrics(self, prefix: str = PASSKEY) -> dict[str, float]:
        """passkey/accuracy (every cell), passkey/digit_accuracy, passkey/accuracy/<length> (over the depths)."""
        out = {split_metric(prefix, ACCURACY): self.mean_accuracy,
               split_metric(prefix, DIGIT_ACCURACY): float(self.digit_accuracy.mean())}
        for i, length in enumerate(self.lengths):
            out[accuracy_at_length(prefix, length)] = float(self.accuracy[i].mean())
        return out

    def to_dict(self) -> dict:
        return {"lengths": self.lengths, "depths": self.depths, "trials": self.trials,
                "accuracy": self.accuracy.tolist(), "digit_accuracy": self.digit_accuracy.tolist(),
                "skipped_lengths": self.skipped, "examples": self.examples}

    def table(self) -> str:
        """Accuracy as text: one line per length, one column per depth (what the eval stage prints)."""
        head = f"{'length':>8} " + " ".join(f"{f'{d:.0%}':>6}" for d in self.depths)
        return "\n".join([head] + [f"{length:>8} " + " ".join(f"{a:6.2f}" for a in row)
                                   for length, row in zip(self.lengths, self.accuracy)])


def prompt_parts(tokenizer) -> tuple[list[int], list[int]]:
    """(instructions with BOS first, question) token ids: the fixed text around the haystack."""
    return [tokenizer.bos_id] + tokenizer.encode(INTRO), tokenizer.encode(QUESTION)


def build_prompt(tokenizer, haystack: np.ndarray, key: str, length: int, depth: float, offset: int) -> list[int]:
    """Token ids of one passkey prompt of exactly `length` tokens: instructions, haystack from `offset` (cycling
    through `haystack`) with the key sentence after `depth` of it, question. PasskeyError when it cannot fit."""
    head, question = prompt_parts(tokenizer)
    needle = tokenizer.encode(NEEDLE.format(key=key))
    n_hay = length - len(head) - len(needle) - len(question)
    if n_hay < MIN_HAYSTACK:
        raise PasskeyError(f"a {length}-token passkey prompt leaves {n_hay} haystack tokens (fewer than "
                           f"{MIN_HAYSTACK}); use lengths of at least {length - n_hay + MIN_HAYSTACK}")
    if len(haystack) == 0:
        raise PasskeyError("the haystack is empty: the validation split holds no text tokens")
    hay = np.take(haystack, np.arange(offset, offset + n_hay), mode="wrap").tolist()
    cut = int(round(depth * n_hay))
    return head + hay[:cut] + needle + hay[cut:] + question


def score_answer(text: str, key: str) -> tuple[bool, float]:
    """(exact, share of the key's digits right in place) for a decoded continuation."""
    answer = text.lstrip()
    digits = answer[:len(key)]
    return answer.startswith(key), sum(a == b for a, b in zip(digits, key)) / len(key)


def _keys(rng: np.random.Generator, n: int) -> list[str]:
    return [str(k) for k in rng.integers(10_000, 100_000, size=n)]  # 5 digits, no leading zero


@torch.no_grad()
def passkey_grid(decoder, tokenizer, haystack: np.ndarray, lengths: list[int], depths=DEPTHS, trials: int = 5,
                 seed: int = 0, batch_tokens: int = BATCH_TOKENS, progress=None) -> PasskeyGrid:
    """Greedy passkey retrieval by `decoder` (a model with the KV-cache protocol: model/decoder.py or
    model/resonance.py, in eval mode, on its device) for every (length, depth) cell, `trials` random keys each.
    The keys and offsets are drawn from `seed`, so two models face the same prompts. `progress`: None, or
    progress(total) -> a bar (update(n), close()) counting the generation batches (pipeline/console.py progress)."""
    from model.decode_loop import generate_ids, generation_autocast

    head, question = prompt_parts(tokenizer)
    fixed = len(head) + len(question) + len(tokenizer.encode(NEEDLE.format(key="12345")))
    usable = [n for n in lengths if n - fixed >= MIN_HAYSTACK]
    skipped = [n for n in lengths if n not in usable]
    if not usable:
        raise PasskeyError(f"every passkey length ({', '.join(map(str, lengths))}) is shorter than the prompt's "
                           f"fixed text ({fixed} tokens) plus {MIN_HAYSTACK}; use --passkey-lengths of at least "
                           f"{fixed + MIN_HAYSTACK}")
    depths = list(depths)
    rng = np.random.default_rng(seed)
    acc = np.zeros((len(usable), len(depths)))
    digits = np.zeros_like(acc)
    examples = []
    was_training = decoder.training
    decoder.eval()
    n_cells = len(depths) * trials
    bar = progress(sum(-(-n_cells // max(1, batch_tokens // n)) for n in usable)) if progress else None
    for i, length in enumerate(usable):
        cells = [(j, key, int(rng.integers(0, max(1, len(haystack)))))
                 for j in range(len(depths)) for key in _keys(rng, trials)]
        prompts = [build_prompt(tokenizer, haystack, key, length, depths[j], off) for j, key, off in cells]
        n_new = max(len(tokenizer.encode(" " + key)) for _, key, _ in cells) + 2
        per_batch = max(1, batch_tokens // length)
        for lo in range(0, len(prompts), per_batch):
            with generation_autocast(decoder):
                out = generate_ids(decoder, prompts[lo:lo + per_batch], max_new_tokens=n_new, temperature=0.0,
                                   eos_id=tokenizer.eos_id, cuda_graph=False, compile_step=False)
            for (j, key, _), ids in zip(cells[lo:lo + per_batch], out.tolist()):
                text = tokenizer.decode([t for t in ids if t != tokenizer.eos_id])
                exact, share = score_answer(text, key)
                acc[i, j] += exact / trials
                digits[i, j] += share / trials
                if len(examples) < (i + 1) * len(depths) and all(e["depth"] != depths[j] or e["length"] != length
                                                                  for e in examples):
                    examples.append({"length": length, "depth": depths[j], "key": key, "answer": text})
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    decoder.train(was_training)
    return PasskeyGrid(usable, depths, trials, acc, digits, skipped, examples)


def parse_lengths(text: str) -> list[int]:
    """'1024,4096' -> [1024, 4096]; PasskeyError naming the value otherwise."""
    try:
        out = [int(x) for x in re.split(r"[,\s]+", text.strip()) if x]
    except ValueError:
        out = []
    if not out or any(n < 1 for n in out):
        raise PasskeyError(f"--passkey-lengths {text!r}: give positive token counts separated by commas, "
                           "e.g. 1024,4096")
    return out
