"""The layout's import rules (docs/design.md, "Layout"), checked on the source with ast.

Every import counts, the lazy ones inside functions too: a rule broken only at call time is still broken.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("model", "cuda_ops", "pipeline")

# room prefix -> module prefixes it must not import
FORBIDDEN = {
    "model": ("ray", "mlflow", "pipeline"),
    "cuda_ops": ("ray", "mlflow", "model", "pipeline"),
    "pipeline.data": ("pipeline.train", "pipeline.sweep", "pipeline.tracking", "pipeline.run", "pipeline.cli"),
    "pipeline.tracking": ("pipeline.data", "pipeline.train", "pipeline.sweep", "pipeline.run", "pipeline.cli", "ray"),
    # the measures beyond the mean loss: handed an engine, a model or a manifest by the eval command (pipeline/cli/);
    # the decode loop they use is model/decode_loop.py's
    "pipeline.eval": ("pipeline.train", "pipeline.sweep", "pipeline.run", "pipeline.cli", "ray"),
    "pipeline.train": ("pipeline.sweep", "pipeline.run", "pipeline.cli"),
    "pipeline.sweep": ("pipeline.run", "pipeline.cli"),
    # the Ray-free engine: a plain process with torch, pyarrow and sentencepiece runs it
    "pipeline.train.engine": ("ray", "mlflow", "pipeline.tracking.tracker"),
    "pipeline.train.loop": ("ray", "mlflow", "pipeline.tracking.tracker"),
    "pipeline.train.stop_request": ("ray", "mlflow", "pipeline.tracking.tracker"),
    "pipeline.train.audit_log": ("ray", "mlflow", "pipeline.tracking.tracker"),
    "pipeline.train.checkpoints.local_dir": ("ray", "mlflow", "pipeline.tracking.tracker"),
    "pipeline.train.spike_detector": ("ray", "mlflow", "pipeline.tracking.tracker"),
    "pipeline.train.spike_guard": ("ray", "mlflow", "pipeline.tracking.tracker"),
    "pipeline.train.spike_rewind": ("ray", "mlflow", "pipeline.tracking.tracker"),
    # read by the driver, `validate` and the workers alike: no torch
    "pipeline.train.spike_record": ("ray", "mlflow", "torch", "pipeline.tracking.tracker"),
    # the config sits below every stage; the mixture spec beside it and the stable tracking names import nothing of
    # the project (the engine, the workers and the config read them without MLflow, Ray or the data room)
    "pipeline.config": ("pipeline.data", "pipeline.eval", "pipeline.train", "pipeline.sweep", "pipeline.tracking",
                        "pipeline.cli"),
    "pipeline.mixture_spec": ("pipeline", "model", "ray", "mlflow", "torch"),
    # a full disk's one line: below every stage (the engine's checkpoints, prepare, export and tracking all use it)
    "pipeline.disk_space": ("pipeline.data", "pipeline.eval", "pipeline.train", "pipeline.sweep", "pipeline.tracking",
                            "pipeline.cli", "ray", "mlflow", "torch", "model"),
    "pipeline.tracking.names": ("pipeline", "model", "ray", "mlflow", "torch"),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def all_modules() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_rooms_import_only_what_they_may():
    broken = []
    for mod, imports in all_modules().items():
        for room, banned in FORBIDDEN.items():
            if _within(mod, room):
                broken += [f"{mod} imports {i}" for i in sorted(imports) if any(_within(i, b) for b in banned)]
    assert not broken, "\n".join(broken)


def test_nothing_imports_the_command_line_module():
    users = [m for m, imports in all_modules().items() if m != "pipeline.run" and "pipeline.run" in imports]
    assert not users, users


def test_the_command_line_room_is_the_top():
    # pipeline/cli/ holds one module per subcommand; only pipeline/run.py (and cli/ itself) stands above it
    users = [f"{m} imports {i}" for m, imports in all_modules().items()
             if m != "pipeline.run" and not _within(m, "pipeline.cli") for i in sorted(imports)
             if _within(i, "pipeline.cli")]
    assert not users, "\n".join(users)


def test_no_import_circles():
    mods = all_modules()
    graph = {m: {i for i in imports if i in mods and i != m} for m, imports in mods.items()}
    # an import of a package's __init__ is not an edge into its submodules; `from a.b import c` where c is a
    # module was recorded as a.b.c above, so the edge goes to the module actually imported
    circles, state = [], {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                circles.append(" -> ".join(stack[stack.index(n):] + [n]))
            elif n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not circles, "\n".join(circles)


@pytest.mark.parametrize("old", ["corpus", "tokenizer", "pack", "shards", "dataset_check", "data_cli", "synthetic",
                                 "engine", "loop", "local", "train", "session", "evaluate", "generate", "max_batch",
                                 "memory_limit", "hardware", "tune", "tune_space", "sweep_report", "tracking",
                                 "curves"])
def test_no_flat_module_left_behind(old):
    # pipeline/train and pipeline/tracking are packages now; the flat modules must be gone, not shimmed
    assert not (ROOT / "pipeline" / f"{old}.py").exists()
