"""Shared fixtures: the real SmolLM2 model, loaded once per test session."""

from __future__ import annotations

import os
from collections.abc import Iterator

from servefleet.engine.cpu_isa import ensure_safe_cpu_isa

# Before anything imports torch: keep oneDNN off AMX where the CPU only pretends to have it.
ensure_safe_cpu_isa()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402

from tests.support.redis_server import redis_port  # noqa: E402, F401  (a fixture)

BUILTIN = "smollm2-135m-instruct"


@pytest.fixture
def require_compiler() -> None:
    """The CPU kernels are part of the product: a machine that runs the tests needs `cc`."""
    from servefleet.engine.kernels.cbuild import find_compiler

    if find_compiler() is None:
        pytest.fail("the CPU kernels need a C compiler (cc or gcc); install one")


@pytest.fixture(scope="session")
def smollm2():  # type: ignore[no-untyped-def]
    """The built-in model, loaded by our loader (float32, CPU)."""
    from servefleet.engine.config import EngineConfig
    from servefleet.engine.process import load_for

    return load_for(EngineConfig(model=BUILTIN, device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread for a module's small models: on a shared 2-core machine OpenMP
    threads spin-wait on each other's time slices. Modules opt in with
    `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
