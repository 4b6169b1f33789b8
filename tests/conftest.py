"""Shared test configuration."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable, Iterator, Mapping

import pytest
from fake_cuda import fake_cuda as fake_cuda  # the fixture: a fake CUDA runtime

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a Linux/macOS dependency
    uvloop = None

# The Ctrl-C tests need Python's own SIGINT handler. A shell starts a command run in the
# background (``make test &``) with SIGINT ignored, and Python then installs none.
if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Run the residency pool's async tests on both asyncio and uvloop."""
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
        "asyncio": asyncio.new_event_loop
    }
    if uvloop is not None and "residency" in item.nodeid:
        factories["uvloop"] = uvloop.new_event_loop
    return factories


@pytest.fixture(autouse=True)
def _grouped_as_marked(request: pytest.FixtureRequest) -> None:
    """Under ``--dist loadgroup``, the tests of an ``xdist_group`` carry the group in their
    ids, which is how pytest-xdist sends them to one worker (their module fixtures built
    once): fail if a pytest and pytest-xdist pair drops it (pytest-dev/pytest-xdist#1386)."""
    item = request.node
    grouped = getattr(request.config.option, "loadgroup", False)
    if grouped and item.get_closest_marker("xdist_group") and "@" not in item.nodeid:
        pytest.fail(
            "--dist loadgroup did not group this test: install the pytest and "
            "pytest-xdist versions pyproject.toml allows"
        )


@pytest.fixture
def buffered_reads() -> Iterator[None]:
    """CPU loads read into buffers (reused by the pool) instead of mapping the file."""
    from torch_to_nnef.tensor import storage

    previous = storage.set_mapped_reads(False)
    yield
    storage.set_mapped_reads(previous)


@pytest.fixture(autouse=True)
def _grad_mode_left_as_found() -> Iterator[None]:
    """Autograd's mode is per thread: a test that leaves it off on the main thread (e.g. a
    ``torch.no_grad()`` block across awaits of interleaved tasks) changes the tests after it."""
    import torch

    enabled = torch.is_grad_enabled()
    yield
    assert torch.is_grad_enabled() == enabled, "the test left autograd's mode changed"


@pytest.fixture
def young_collections() -> Iterator[None]:
    """Garbage collections during the test walk only the objects made from its start.

    The objects alive before it (torch's modules, the session's: some 200,000, a fifth of a
    second per full collection on a small machine) move to the collector's permanent
    generation until the test ends. What the test makes and drops is collected as ever; an
    object of before that the test's objects reference counts as alive, as any reference
    from outside a collected generation does.
    """
    import gc

    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
