"""model.layers.eager_only: torch.compiler.disable's effect under torch.compile, without loading torch._dynamo
when the model is imported (that import costs ~2 CPU-s in every process that builds a model)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model.layers import eager_only

ROOT = Path(__file__).resolve().parents[2]


def test_importing_the_model_and_the_engine_does_not_load_dynamo():
    code = ("import sys, model.decoder, model.resonance, pipeline.train.engine; "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_an_eager_only_function_is_not_traced_by_torch_compile():
    calls = []

    @eager_only
    def host_side(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape)  # runs in Python every call: it was not traced into a graph
        return x * 2

    def f(x):
        return host_side(x + 1) - 1

    x = torch.arange(4.0)
    with pytest.raises(Exception, match="(?i)disable"):  # fullgraph: the call is a forced graph break
        torch.compile(f, backend="eager", fullgraph=True)(x)
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="eager")
    calls.clear()
    for _ in range(3):
        assert torch.equal(compiled(x), (x + 1) * 2 - 1)
    assert len(calls) == 3
    explained = torch._dynamo.explain(f)(x)
    assert explained.graph_break_count >= 1


def test_eager_only_keeps_the_function_name_and_result():
    @eager_only
    def double(x):
        return 2 * x

    assert double.__name__ == "double" and double(torch.tensor(3.0)).item() == 6.0
