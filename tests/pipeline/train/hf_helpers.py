"""A small real-text dataset that `prepare` reuses as is (so training runs without Ray Data), a SentencePiece
tokenizer trained the project's way, the texts the tokenizer conversion is checked on, and the check that an
exported directory is the same model as its checkpoint in transformers (logits and greedy generation).

The dataset is what `python pipeline/run.py prepare` would build for the returned config (same settings hash,
same manifest fields), packed here with numpy instead of Ray Data to keep tests fast.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

from pipeline.config import Config, load_config
from pipeline.data.pack import dataset_settings, settings_hash
from pipeline.data.shards import SCHEMA_VERSION, Manifest, shard_schema, windows_table, write_manifest, write_shard
from pipeline.data.tokenizer import Tokenizer, file_sha256, train_tokenizer
from pipeline.train.handoff.text_generation import generate_from_checkpoint, load_for_generation

# ASCII, code, CJK, emoji (incl. ZWJ sequences), control characters, text with invalid UTF-8 replaced (U+FFFD),
# and the special pieces' spellings, which SentencePiece encodes as plain characters.
TOKENIZER_CHECK_TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x ** 2  # square\n\n\tindented with a tab",
    "  two leading spaces, three   inside, trailing  ",
    "日本語のテキストです。中文文本，汉字与标点。한국어 문장도 있습니다.",
    "emoji 😀🎉🦄 and a family 👩‍👩‍👧‍👦 and flags 🇯🇵🇫🇷",
    "control \x00\x01\x07\x08\x0b\x0c\x1b[31mred\x1b[0m\x7f \u200b\u200d\ufeff end",
    b"invalid \xff\xfe utf-8 \xc3( here \xe2\x82".decode("utf-8", "replace"),
    "\ufffd\ufffd replacement characters \ufffd",
    "<s> </s> <pad> <unk> <0x41> look like special pieces",
    "", " ", "\n", "a", "1234567890 3.14159 -42",
    "Ünïcödé cafés naïve façade — “quotes” and ‘more’ … ½ ℃ ∑ √",
]


def corpus_texts() -> list[str]:
    """~150 kB of English prose and code (the standard library's pydoc topics) plus some multilingual lines."""
    import pydoc_data.topics as topics

    texts = [topics.topics[k] for k in sorted(topics.topics)][:60]
    texts += ["日本語の文章です。東京は日本の首都です。" * 5, "中文文本，汉字。北京是中国的首都。" * 5,
              "emoji 😀 🎉 ok 👍 " * 5]
    return texts


def build_dataset(root: Path, *, vocab_size: int = 400, seq_len: int = 64, overrides: dict | None = None,
                  tokenizer: Path | None = None) -> tuple[Config, Path]:
    """(config, dataset dir): a files-source config whose prepared dataset already exists in data.dataset_dir.
    `tokenizer`: an existing SentencePiece model to use (another build's), instead of training one."""
    root.mkdir(parents=True, exist_ok=True)
    texts = corpus_texts()
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok_path = tokenizer or train_tokenizer(texts, vocab_size, root / "source_tokenizer.model", num_threads=1)
    ds = root / "dataset"
    cfg = load_config("test", {"data.source": "files", "data.path": str(corpus), "data.tokenizer": str(tok_path),
                               "data.vocab_size": vocab_size, "data.seq_len": seq_len, "data.dataset_dir": str(ds),
                               "run.root": str(root / "runs"), "model.compile": "off", "train.sample_tokens": 0,
                               **(overrides or {})})
    settings = dataset_settings(cfg)
    tok = Tokenizer(tok_path)
    stream = np.concatenate([np.asarray(ids + [tok.eos_id], dtype=np.int64) for ids in tok.encode_batch(texts)])
    width = seq_len + 1
    windows = stream[: len(stream) // width * width].reshape(-1, width)
    n_val = max(cfg.train.batch_size * 2, int(len(windows) * 0.05))
    ds.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(tok_path, ds / "tokenizer.model")
    schema = shard_schema(seq_len, tok.vocab_size)
    shards = {}
    for split, rows, first in (("train", windows[:-n_val], 0), ("val", windows[-n_val:], len(windows) - n_val)):
        ids = np.arange(first, first + len(rows))
        shards[split] = [write_shard(ds / f"{split}-00000.parquet",
                                     [windows_table(rows, ids, tok.eos_id, tok.vocab_size)], schema)]
    kept = int(windows.size)
    manifest = Manifest(
        schema_version=SCHEMA_VERSION, seq_len=seq_len, vocab_size=tok.vocab_size, pad_id=tok.pad_id,
        unk_id=tok.unk_id, bos_id=tok.bos_id, eos_id=tok.eos_id, token_type="uint16",
        tokenizer_file="tokenizer.model", tokenizer_sha256=file_sha256(tok_path),
        settings_hash=settings_hash(settings), source=settings["source"], settings=settings,
        counts={"documents": len(texts), "sequences": len(windows), "tokens_total": int(stream.size),
                "tokens_kept": kept, "dropped_empty": 0, "replaced_invalid_utf8": 0},
        packing_efficiency=kept / stream.size, remainder_policy="final partial window dropped", doc_length={},
        shards=shards)
    write_manifest(ds, manifest)
    return cfg, ds


PROMPTS = ["The ", "In this module"]


def load_hf(hf_dir: Path):
    import transformers  # the dev extra installs it (pip install -e '.[dev]')

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    return model, tok


def hf_greedy(model, tok, prompt: str, n: int) -> list[int]:
    enc = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=n, do_sample=False)
    return out[0, enc["input_ids"].shape[1]:].tolist()  # stops after EOS, as generate_texts trims


def assert_same_model(ckpt: Path, hf_dir: Path) -> None:
    """transformers' logits and greedy generation from `hf_dir` equal those of the checkpoint it was exported from
    (loaded the way `generate` loads it: a sharded checkpoint consolidated)."""
    model, tok = load_hf(hf_dir)
    decoder, sp = load_for_generation(ckpt, torch.device("cpu"))
    ids = torch.tensor([[sp.bos_id] + sp.encode(" ".join(TOKENIZER_CHECK_TEXTS[:5]))])  # CJK and emoji too
    with torch.no_grad():
        ours, theirs = decoder.logits(decoder(ids)), model(ids).logits.float()
    assert ours.shape == theirs.shape
    rel = float((ours - theirs).abs().max() / ours.abs().max())
    assert rel <= 1e-4, f"logits differ: max relative error {rel:.2e}"
    for prompt in PROMPTS:
        want = generate_from_checkpoint(ckpt, [prompt], max_new_tokens=32, temperature=0.0).token_ids[0]
        assert hf_greedy(model, tok, prompt, 32) == want, prompt
