"""Generation from a checkpoint: load it (full or sharded, local or on object storage) with its dataset's tokenizer,
and text in, text out through the decode loop over the model (model/generate.py).

    python pipeline/run.py generate --checkpoint runs/<run>/checkpoints/phase0/step_000200 \
        --prompt "Once upon a time" --prompt "def main" --max-new-tokens 64 --top-p 0.95
    python pipeline/run.py generate --resume runs/<run> --prompts-file prompts.txt
    python bench/generate.py                          # decode tokens/s at batch 1, 8, 64

On CUDA a checkpoint is loaded in bf16 (prepare_for_generation); an fp32 model (the eval-time samples of
eval_samples_hook) generates under bf16 autocast.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from model.generate import GenerationOutput, generate_ids_timed, generation_autocast


def _trim(ids: list[int], eos_id: int | None) -> list[int]:
    if eos_id is not None and eos_id in ids:
        return ids[: ids.index(eos_id) + 1]
    return ids


def prepare_for_generation(decoder, device: torch.device):
    """The model on `device` in eval mode; an attention Decoder on CUDA also in bf16 (weights, residual stream
    and KV cache: a decode step reads every weight once per token, so half the bytes is up to twice the speed;
    norms and softmax still compute in fp32). Other models keep their dtype and decode under bf16 autocast."""
    from model.decoder import Decoder

    decoder = decoder.to(device).eval()
    return decoder.to(torch.bfloat16) if device.type == "cuda" and isinstance(decoder, Decoder) else decoder


def generate_texts(decoder, tokenizer, prompts: list[str], *, max_new_tokens: int = 64, temperature: float = 0.8,
                   top_k: int = 0, top_p: float = 0.95, min_p: float = 0.0, seed: int = 0,
                   compile_step: bool | None = None) -> GenerationOutput:
    """Text in, text out, with the tokenizer's BOS before each prompt and generation stopping at EOS."""
    ids = [[tokenizer.bos_id] + row for row in tokenizer.encode_batch(prompts)]
    was_training = decoder.training
    decoder.eval()
    t0 = time.perf_counter()
    with generation_autocast(decoder):
        new, timings = generate_ids_timed(decoder, ids, max_new_tokens=max_new_tokens, temperature=temperature,
                                          top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                                          eos_id=tokenizer.eos_id,
                                          pad_id=tokenizer.pad_id, compile_step=compile_step)
    rows = [_trim(r, tokenizer.eos_id) for r in new.tolist()]  # the one host sync, at the end
    seconds = time.perf_counter() - t0
    decoder.train(was_training)
    n_new = sum(len(r) for r in rows)
    texts = [tokenizer.decode([t for t in r if t != tokenizer.eos_id]) for r in rows]
    return GenerationOutput(rows, texts, n_new, seconds, n_new / max(seconds, 1e-9), timings)


def load_for_generation(checkpoint: str | Path, device: torch.device | None = None):
    """(decoder in eval mode, Tokenizer) from a checkpoint, full or sharded (a directory, or a URI on object
    storage: read through a temporary local copy), and its dataset's tokenizer."""
    from model.decoder import build_model
    from pipeline.config import from_dict
    from pipeline.storage import local_copy
    from pipeline.train.checkpoints.broken import dataset_tokenizer_of
    from pipeline.train.checkpoints.state import load_decoder_weights, read_checkpoint_meta
    from pipeline.train.engine import model_rope
    from pipeline.train.memory.hardware import default_device

    with local_copy(checkpoint) as local:
        meta = read_checkpoint_meta(local, weights_only=True)
        cfg = from_dict(meta["config"])
        tokenizer = dataset_tokenizer_of(meta, checkpoint)  # or one line naming its file and what is wrong
        device = device or default_device()
        decoder = build_model(cfg.model.tier, meta["vocab_size"], mixer=cfg.model.mixer, rope=model_rope(cfg),
                              tie_embeddings=cfg.model.tie_embeddings)  # the RoPE tables the checkpoint trained with
        load_decoder_weights(decoder, local, meta)  # either layout: a sharded checkpoint is consolidated here
    return prepare_for_generation(decoder, device), tokenizer


def dataset_tokenizer(dataset_dir: str | Path):
    """The Tokenizer a dataset was built with (its manifest names the file; local or on object storage)."""
    from pipeline.data.shards import tokenizer_location
    from pipeline.data.tokenizer import Tokenizer

    return Tokenizer(tokenizer_location(dataset_dir))


def generate_from_checkpoint(checkpoint: str | Path, prompts: list[str], **kw) -> GenerationOutput:
    decoder, tokenizer = load_for_generation(checkpoint)
    return generate_texts(decoder, tokenizer, prompts, **kw)


SAMPLE_PROMPTS = ("The ", "def ", "In this module")


def eval_samples_hook(dataset_dir: str | Path, tracker, max_new_tokens: int, defer: bool = False):
    """An on-eval hook for rank 0 that logs text generated by the current model to the tracker as
    samples/step_<step>.txt; None when there is nothing to do (no tracker, a dataset without a tokenizer,
    sampling off). defer=True: logged from the tracker's background thread (Tracker.log_later), so an object store
    that is away does not hold up training; the run's end waits for them."""
    from pipeline.data.shards import load_manifest

    if tracker is None or max_new_tokens <= 0 or not load_manifest(dataset_dir).tokenizer_file:
        return None
    tokenizer = dataset_tokenizer(dataset_dir)  # local or on object storage, never a driver-only path

    def hook(engine, metrics, decoder=None) -> None:
        """decoder: what to generate with (under FSDP the whole-weight twin of Engine.full_model); default the
        engine's own unsharded decoder."""
        out = generate_texts(decoder if decoder is not None else engine.module.decoder, tokenizer, list(SAMPLE_PROMPTS), max_new_tokens=max_new_tokens,
                             seed=engine.step, compile_step=False)  # a few tokens per eval: never worth a compile
        body = "\n\n".join(f"### prompt {p!r} (step {engine.step}, val/loss {metrics.get('val/loss', float('nan')):.4f})"
                           f"\n{p}{t}" for p, t in zip(SAMPLE_PROMPTS, out.texts))
        if defer:
            tracker.log_later(f"samples/step_{engine.step:06d}.txt", text=body + "\n")
        else:
            tracker.log_text(body + "\n", f"samples/step_{engine.step:06d}.txt")

    return hook
