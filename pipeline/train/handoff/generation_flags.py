"""The generate stage's flags and prompts, checked before anything loads (no torch here): a bad sampling value or an
unreadable --prompts-file is one line naming the flag or the file and what it takes, not a traceback after the
model has loaded, and never a diagnosis of the checkpoint.

    python pipeline/run.py generate --resume runs/<run> --top-p 0.9 --temperature 0.7 --prompts-file prompts.txt

    prompts = generate_prompts(args)     # args: run.py's namespace; GenerateOptionError (a ConfigError) when bad

The ranges are cuda_ops/sampling.py's (the Sampler checks them again, later, for callers of the library).
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from pipeline.config import ConfigError

DEFAULT_PROMPTS = ["The ", "def ", "In this module"]


class GenerateOptionError(ConfigError):
    """A generate flag out of range, or a --prompts-file that cannot be read as text; names it and the fix."""


def check_sampling(max_new_tokens: int, temperature: float, top_k: int, top_p: float, min_p: float) -> None:
    """GenerateOptionError for the first flag out of its range."""
    if max_new_tokens < 1:
        raise GenerateOptionError(f"--max-new-tokens {max_new_tokens}: give the number of tokens to generate per "
                                  f"prompt, at least 1 (default 64)")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise GenerateOptionError(f"--temperature {temperature:g}: give a finite number >= 0 (0 = greedy, 1 = the "
                                  f"model's own distribution; default 0.8)")
    if top_k < 0:
        raise GenerateOptionError(f"--top-k {top_k}: give the number of likeliest tokens to sample from, >= 0 "
                                  f"(0 = all; default 0)")
    if not (0 < top_p <= 1):  # NaN fails too
        hint = f", e.g. {top_p / 100:g} for {top_p:g}%" if 1 < top_p <= 100 else ""
        raise GenerateOptionError(f"--top-p {top_p:g}: give the nucleus probability mass as a fraction in (0, 1]"
                                  f"{hint} (1 = off; default 0.95)")
    if not (0 <= min_p <= 1):
        hint = f", e.g. {min_p / 100:g} for {min_p:g}%" if 1 < min_p <= 100 else ""
        raise GenerateOptionError(f"--min-p {min_p:g}: give a fraction in [0, 1] of the likeliest token's "
                                  f"probability{hint} (0 = off; default 0)")


def read_prompts(path: str) -> list[str]:
    """The non-blank lines of a UTF-8 text file; GenerateOptionError naming the file and what it must be."""
    what = "a UTF-8 text file with one prompt per line"
    p = Path(path)
    if not p.exists():
        raise GenerateOptionError(f"--prompts-file {path} does not exist; give {what}")
    if p.is_dir():
        raise GenerateOptionError(f"--prompts-file {path} is a directory; give {what}")
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise GenerateOptionError(f"--prompts-file {path} could not be read ({exc.strerror or exc}); give {what}") \
            from None
    if data[:2] == b"\x1f\x8b":
        raise GenerateOptionError(f"--prompts-file {path} is gzip-compressed; it must be {what}: decompress it "
                                  f"first (gunzip -k {path})")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise GenerateOptionError(f"--prompts-file {path} is not UTF-8 text (byte {exc.start} is "
                                  f"0x{data[exc.start]:02x}); it must be {what}") from None
    prompts = [ln for ln in text.splitlines() if ln.strip()]
    if not prompts:
        raise GenerateOptionError(f"--prompts-file {path} holds no prompt (every line is blank); give {what}")
    return prompts


def generate_prompts(args: argparse.Namespace) -> list[str]:
    """The prompts a generate command asks for (--prompt, then --prompts-file's lines; DEFAULT_PROMPTS when
    neither), after checking every sampling flag."""
    check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.min_p)
    prompts = list(args.prompt or [])
    if args.prompts_file:
        prompts += read_prompts(args.prompts_file)
    return prompts or list(DEFAULT_PROMPTS)
