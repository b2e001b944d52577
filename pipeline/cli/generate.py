"""`python pipeline/run.py generate`: text from a checkpoint (pipeline/train/handoff/text_generation.py), with the prefill and
decode speeds.

    python pipeline/run.py generate --checkpoint runs/<run> --prompt "Once upon a time"
    python pipeline/run.py generate --resume <run> --prompts-file prompts.txt --temperature 0 --max-new-tokens 128
"""
from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.console import stage


def stage_generate(checkpoint: Path | str, args: argparse.Namespace, prompts: list[str]) -> list[str]:
    """`prompts`: pipeline/train/handoff/generation_flags.py generate_prompts (the flags checked before anything loads)."""
    from pipeline.train.checkpoints.broken import diagnosed
    from pipeline.train.handoff.text_generation import generate_texts, load_for_generation

    stage("generate", f"{len(prompts)} prompt(s), {args.max_new_tokens} new tokens, top-p {args.top_p}")
    with diagnosed(checkpoint):  # the checkpoint's own files only: a file that does not load, the previous offered
        decoder, tokenizer = load_for_generation(checkpoint)
    out = generate_texts(decoder, tokenizer, prompts, max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    for p, text in zip(prompts, out.texts):
        print(f"--- {p!r}\n{text}")
    t = out.timings
    print(f"generate: batch {len(prompts)}, {out.new_tokens} new tokens; prefill {t.prefill_tokens_per_s:,.0f} "
          f"tokens/s ({t.prefill_tokens} prompt tokens), decode {t.decode_tokens_per_s:,.0f} tokens/s "
          f"({t.decode_tokens} tokens{', CUDA graph' if t.cuda_graph else ''}); first-step warm-up "
          f"{t.warmup_s:.2f} s apart ({t.warmup_tokens} tokens: sampler compile, warm-up steps, graph capture)")
    return out.texts


def generate_command(cfg, args: argparse.Namespace, prompts: list[str]) -> int:
    from pipeline.cli.checkpoint_arg import checkpoint_of_args

    stage_generate(checkpoint_of_args(cfg, args), args, prompts)
    return 0
