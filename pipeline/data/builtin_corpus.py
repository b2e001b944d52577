"""The built-in corpus (data.source=builtin): text that ships with Python, so the default run needs no download.
pydoc_data's help topics and the docstrings of the standard library, one document per topic and per module, parsed
with `ast` from the .py files (never imported); about 2 MB.

    from pipeline.data.builtin_corpus import builtin_document, builtin_items
    docs = [d for d in map(builtin_document, builtin_items()) if d]   # what read_builtin() yields, without Ray
"""
from __future__ import annotations

import ast
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import ray.data

BUILTIN_BLOCKS = 32  # blocks of the built-in corpus's item list


def builtin_module_files() -> list[Path]:
    """The standard library's .py files (no tests, no site-packages), sorted."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "__pycache__"}
    return sorted(p for p in stdlib.rglob("*.py") if not skip.intersection(p.relative_to(stdlib).parts))


def module_document(path: Path) -> str:
    """The docstrings of one module as one document: module docstring, then each class and function with its
    signature and docstring, in source order. Empty when the module has none or does not parse."""
    try:
        tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError, OSError):
        return ""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    name = ".".join(path.relative_to(stdlib).with_suffix("").parts).removesuffix(".__init__")
    parts: list[str] = []
    doc = ast.get_docstring(tree)
    if doc:
        parts.append(f"Module {name}\n\n{doc}")

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qual = f"{prefix}{child.name}"
                d = ast.get_docstring(child)
                if d:
                    if isinstance(child, ast.ClassDef):
                        head = f"class {name}.{qual}"
                    else:
                        head = f"def {name}.{qual}({ast.unparse(child.args)})"
                    parts.append(f"{head}\n{d}")
                visit(child, f"{qual}.")

    visit(tree, "")
    return "\n\n".join(parts)


def builtin_items() -> list[dict[str, str]]:
    """One item per document of the built-in corpus: pydoc topics first, then modules."""
    import pydoc_data.topics

    items = [{"kind": "topic", "key": k} for k in sorted(pydoc_data.topics.topics)]
    return items + [{"kind": "module", "key": str(p)} for p in builtin_module_files()]


def builtin_document(item: dict[str, str]) -> str:
    if item["kind"] == "topic":
        import pydoc_data.topics

        return pydoc_data.topics.topics[item["key"]]
    return module_document(Path(item["key"]))


def _builtin_rows(row: dict[str, Any]) -> list[dict[str, Any]]:
    text = builtin_document(row)
    return [{"text": text, "doc": row["doc"]}] if text else []  # modules without docstrings are not documents


def read_builtin() -> "ray.data.Dataset":
    """The built-in corpus as a Ray Dataset with a `text` column and a `doc` column (the item's index: what
    deduplication names it by): one row per document, in item order."""
    import ray.data

    items = [{**item, "doc": i} for i, item in enumerate(builtin_items())]
    return ray.data.from_items(items, override_num_blocks=min(BUILTIN_BLOCKS, len(items))).flat_map(_builtin_rows)
