"""Shared test fixtures.

`ray_session`: ONE Ray instance for the whole test session (starting Ray takes ~10 s on 2 cores). It
advertises 8 logical CPUs on purpose: with num_cpus=2, tokenizer actors or training workers take every
CPU and Ray Data's read tasks would wait forever. Tests that need Ray depend on this fixture and never call
ray.init/ray.shutdown themselves.
"""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_session():
    import ray

    started = False
    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, logging_level="WARNING")
        started = True
    yield ray
    if started:
        ray.shutdown()
