"""KV-cached batched generation from a checkpoint, with the cuda_ops sampling op.

    python pipeline/run.py generate --checkpoint runs/<run>/checkpoints/phase0/step_000200 \
        --prompt "Once upon a time" --prompt "def main" --max-new-tokens 64 --top-p 0.95
    python pipeline/run.py generate --resume runs/<run> --prompts-file prompts.txt

Prompts of different lengths are left-padded into one batch; the KV cache masks the pads and starts
each row's RoPE positions at its first real token. One forward per new token for the whole batch,
and one sampling kernel launch per step (no host sync inside the loop on CUDA).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from cuda_ops.sampling import sample


@dataclass
class GenerationOutput:
    token_ids: list[list[int]]  # new tokens per prompt (up to and including EOS when it came)
    texts: list[str]  # decoded new text per prompt
    new_tokens: int  # total new tokens across the batch
    seconds: float
    tokens_per_s: float


@torch.no_grad()
def generate_ids(decoder, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int = 0,
                 eos_id: int | None = None, pad_id: int = 0) -> torch.Tensor:
    """(B, max_new_tokens) int64 new tokens for token-id prompts (rows finished at EOS are padded with eos_id).

    temperature 0 is greedy. Prompts are left-padded to the longest; the cache hides the pads.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    device = decoder.output_weight.device
    B, longest = len(prompts), max(len(p) for p in prompts)
    left_pad = torch.tensor([longest - len(p) for p in prompts], dtype=torch.int64, device=device)
    idx = torch.full((B, longest), pad_id, dtype=torch.int64, device=device)
    for i, p in enumerate(prompts):
        idx[i, longest - len(p):] = torch.tensor(p, dtype=torch.int64)
    cache = decoder.new_kv_cache(B, longest + max_new_tokens,
                                 left_pad=left_pad if int(left_pad.max()) > 0 else None)
    out = torch.empty(B, max_new_tokens, dtype=torch.int64, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    seeds = torch.arange(B, dtype=torch.int64, device=device) + seed  # an independent stream per row
    hidden = decoder(idx, kv_cache=cache)[:, -1]  # (B, D): prefill, last position of each row
    for t in range(max_new_tokens):
        logits = decoder.logits(hidden)  # (B, V) fp32, only the last position
        nxt = sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seeds, step=t)
        if eos_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
            done |= nxt == eos_id
        out[:, t] = nxt
        if t + 1 < max_new_tokens:
            hidden = decoder(nxt[:, None], kv_cache=cache)[:, -1]
    return out


def _trim(ids: list[int], eos_id: int | None) -> list[int]:
    if eos_id is not None and eos_id in ids:
        return ids[: ids.index(eos_id) + 1]
    return ids


def generate_texts(decoder, tokenizer, prompts: list[str], *, max_new_tokens: int = 64, temperature: float = 0.8,
                   top_k: int = 0, top_p: float = 0.95, seed: int = 0) -> GenerationOutput:
    """Text in, text out, with the tokenizer's BOS before each prompt and generation stopping at EOS."""
    ids = [[tokenizer.bos_id] + row for row in tokenizer.encode_batch(prompts)]
    was_training = decoder.training
    decoder.eval()
    device = decoder.output_weight.device
    t0 = time.perf_counter()
    new = generate_ids(decoder, ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                       top_p=top_p, seed=seed, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
    rows = [_trim(r, tokenizer.eos_id) for r in new.tolist()]  # the one host sync, at the end
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    decoder.train(was_training)
    n_new = sum(len(r) for r in rows)
    texts = [tokenizer.decode([t for t in r if t != tokenizer.eos_id]) for r in rows]
    return GenerationOutput(rows, texts, n_new, seconds, n_new / max(seconds, 1e-9))


def load_for_generation(checkpoint: str | Path, device: torch.device | None = None):
    """(decoder in eval mode, Tokenizer) from a checkpoint directory and its dataset's tokenizer."""
    from model.decoder import build_model
    from pipeline.config import from_dict
    from pipeline.train.engine import CheckpointError, read_checkpoint_meta
    from pipeline.train.hardware import default_device
    from pipeline.data.tokenizer import Tokenizer
    from safetensors.torch import load_model

    meta = read_checkpoint_meta(checkpoint)
    cfg = from_dict(meta["config"])
    tok_path = Path(meta.get("dataset_dir", "")) / "tokenizer.model"
    if not tok_path.is_file():
        raise CheckpointError(f"tokenizer for checkpoint {checkpoint} not found at {tok_path}; the checkpoint "
                              "names its dataset directory, which must still exist")
    tokenizer = Tokenizer(tok_path)
    device = device or default_device()
    decoder = build_model(cfg.model.tier, meta["vocab_size"], mixer=cfg.model.mixer,
                          tie_embeddings=cfg.model.tie_embeddings)
    load_model(decoder, str(Path(checkpoint) / "model.safetensors"))
    return decoder.to(device).eval(), tokenizer


def generate_from_checkpoint(checkpoint: str | Path, prompts: list[str], **kw) -> GenerationOutput:
    decoder, tokenizer = load_for_generation(checkpoint)
    return generate_texts(decoder, tokenizer, prompts, **kw)


SAMPLE_PROMPTS = ("The ", "def ", "In this module")


def eval_samples_hook(dataset_dir: str | Path, tracker, max_new_tokens: int):
    """An on-eval hook for rank 0 that logs text generated by the current model to the tracker as
    samples/step_<step>.txt; None when there is nothing to do (no tracker, no tokenizer, sampling off)."""
    from pipeline.data.tokenizer import Tokenizer

    tok_path = Path(dataset_dir) / "tokenizer.model"
    if tracker is None or max_new_tokens <= 0 or not tok_path.is_file():
        return None
    tokenizer = Tokenizer(tok_path)

    def hook(engine, metrics) -> None:
        out = generate_texts(engine.module.decoder, tokenizer, list(SAMPLE_PROMPTS), max_new_tokens=max_new_tokens,
                             seed=engine.step)
        body = "\n\n".join(f"### prompt {p!r} (step {engine.step}, val/loss {metrics.get('val/loss', float('nan')):.4f})"
                           f"\n{p}{t}" for p, t in zip(SAMPLE_PROMPTS, out.texts))
        tracker.log_text(body + "\n", f"samples/step_{engine.step:06d}.txt")

    return hook
