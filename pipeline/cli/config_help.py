"""The config fields as `python pipeline/run.py --help` shows them: each field's path, type, default and one-line
meaning, grouped by section, generated from pipeline/config.py itself so that it cannot drift.

    python pipeline/run.py --help                  # every field, with the base config's defaults; then the tiers
    python pipeline/run.py --preset gpu --help     # the same, with the gpu preset's values as defaults

A field's meaning is the trailing `# comment` on its line in pipeline/config.py (read with inspect, ast and
tokenize): whoever adds a field with a comment gets its help line for free, and tests/test_config_help.py fails
for a field without one.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import textwrap
import tokenize
import typing
from typing import Any

from pipeline.config import Config, field_types

WIDTH = 136  # characters per help line; a longer meaning wraps under its own column


def sections() -> dict[str, type]:
    """{"model": ModelConfig, ...} in the order Config declares them."""
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


@functools.lru_cache(maxsize=None)
def field_meanings() -> dict[str, str]:
    """{"train.batch_size": "micro-batch, sequences per worker per forward", ...}: the trailing comment of each
    field's declaration ("" for a field without one)."""
    out: dict[str, str] = {}
    for name, cls in sections().items():
        source = textwrap.dedent(inspect.getsource(cls))
        comments = {tok.start[0]: tok.string.lstrip("#").strip()
                    for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
        (klass,) = ast.parse(source).body
        for node in klass.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                # the comment after the declaration's last line (a default may span lines), else after its first
                out[f"{name}.{node.target.id}"] = comments.get(node.end_lineno) or comments.get(node.lineno, "")
    return out


def _shown(value: Any) -> str:
    if isinstance(value, str):
        return '""' if value == "" else value
    if isinstance(value, bool):
        return str(value).lower()
    return f"{value:g}" if isinstance(value, float) else str(value)


def fields_help(cfg: Config | None = None, preset: str | None = None) -> str:
    """The field list, section by section; defaults are `cfg`'s values (the base config when None)."""
    cfg = cfg or Config()
    values, types, meanings = cfg.flat(), field_types(), field_meanings()
    rows = [(path, types[path].__name__, _shown(values[path]), meanings[path]) for path in values]
    w_path = max(len(r[0]) for r in rows)
    w_type = max(len(r[1]) for r in rows)
    w_default = min(12, max(len(r[2]) for r in rows))
    indent = 2 + w_path + 1 + w_type + 2 + w_default + 2
    whose = (f"the {preset} preset's values" if preset else
             "the base config's; presets change some: `--preset cpu --help` shows the cpu preset's")
    lines = ["config fields: set any with --FIELD=VALUE, e.g. --train.batch_size=8 (columns: field, type, default, "
             f"meaning;\ndefaults: {whose})"]
    section = None
    for (path, typ, default, meaning) in rows:
        sec = path.split(".")[0]
        if sec != section:
            section = sec
            lines.append(f"\n{sec}:")
        head = f"  {path:<{w_path}} {typ:<{w_type}}  {default:<{w_default}}  "
        if len(head) > indent:  # a long default: the meaning goes on the next line, in its column
            lines.append(head.rstrip())
            head = " " * indent
        lines.append(textwrap.fill(meaning, WIDTH, initial_indent=head, subsequent_indent=" " * indent,
                                   break_on_hyphens=False))
    return "\n".join(lines)


def section_help(section: str, cfg: Config | None = None, preset: str | None = None) -> str:
    """One section of fields_help: its `section:` line and its fields (docs/configuration.md shows `train`)."""
    blocks = fields_help(cfg, preset).split("\n\n")
    found = [b for b in blocks if b.startswith(f"{section}:")]
    if not found:
        raise KeyError(f"no config section {section!r}; sections: {', '.join(sections())}")
    return found[0]


def tiers_help(vocab_size: int = 32000) -> str:
    """The model tiers of both families for --help: each name with its total parameters and, for a mixture of
    experts, the parameters one token uses (model/flops.py; at `vocab_size`, tied embeddings)."""
    from model.flops import active_param_count, param_count
    from model.tiers import MIXERS, tiers_for

    lines = [textwrap.fill(f"model tiers (--model.tier; parameters at a {vocab_size:,}-piece vocabulary, tied "
                           f"embeddings; a MoE tier also what one token uses, its active parameters; `python -m model` "
                           f"has the shapes):", WIDTH)]
    for mixer in MIXERS:
        cells = []
        for name, tier in tiers_for(mixer).items():
            total = param_count(tier, vocab_size)
            if tier.moe is None:
                cells.append(f"{name} {total / 1e6:,.1f}M")
            else:
                spec = tier.moe
                cells.append(f"{name} {total / 1e6:,.1f}M total, {active_param_count(tier, vocab_size) / 1e6:,.1f}M "
                             f"active ({spec.num_experts} experts, {spec.experts_per_token} per token)")
        lines.append(textwrap.fill(f"{mixer}: " + "; ".join(cells), WIDTH, initial_indent="  ",
                                   subsequent_indent="    "))
    return "\n".join(lines)
