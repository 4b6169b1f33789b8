"""Ctrl-C at each point of an operation in turn (``SignalAt``): whatever it interrupts, no
file, descriptor or SIGINT handler is left behind, and the value on disk is whole."""

from __future__ import annotations

import gc
import itertools
import os
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch
import torch
from interrupts import SignalAt

from torch_to_nnef import _interrupts
from torch_to_nnef.tensor import storage
from torch_to_nnef.tensor.offload import OffloadedTensor

SOURCE = str(Path(storage.__file__).parents[1])  # the package's tensor code

needs_proc = pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="needs /proc")


def left_in(directory: Path) -> set[str]:
    """The files under ``directory``, and what the process's descriptors open in it (or of
    it) point to."""
    left = {str(path) for path in directory.rglob("*")}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith(str(directory)):
            left.add(f"descriptor of {target}")
    return left


def sweep(
    run: Callable[[], object],
    directory: Path,
    check: Callable[[str], None] = lambda where: None,
    within: str = SOURCE,
) -> int:
    """Run ``run`` with a Ctrl-C at its n-th point, for n = 1, 2, ... until one runs without
    it. After each, with the KeyboardInterrupt dropped and a collection made: no file or
    descriptor is left in ``directory`` that was not there before, Python's SIGINT handler is
    in force with no stale one recorded, and ``check(where)`` holds. Return the number of
    points interrupted.

    Not counted: the points of finalizers (a file's removal as its tensor dies), where
    Python loses an interrupt whatever the code does. Not checked: a Ctrl-C at the entry to
    an ``__exit__`` method, where Python runs a pending handler before any of its code,
    which therefore cannot guard it."""
    for n in itertools.count(1):
        before = left_in(directory)
        signal_at = SignalAt(n, within, finalizers=False)
        sys.setprofile(signal_at)
        try:
            run()
        except KeyboardInterrupt:
            pass
        finally:
            sys.setprofile(None)
        gc.collect()
        where = signal_at.where or "no point (ran to its end)"
        if where != "call __exit__":
            assert left_in(directory) - before == set(), f"a Ctrl-C at {where} left them"
            check(where)
        assert _interrupts._replaced == [], f"a Ctrl-C at {where} left a stale handler"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        if not signal_at.fired:
            return n - 1
    raise AssertionError("unreachable")


@needs_proc
@pytest.mark.timeout(120)
def test_a_ctrl_c_anywhere_in_a_write_leaves_no_temporary_and_the_old_or_new_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "p.safetensors"
    old, new = torch.zeros(1000), torch.ones(1000)
    storage.write_payload(path, {"x": old})

    def check(where: str) -> None:
        value = safetensors.torch.load_file(path)["x"]
        assert torch.equal(value, old) or torch.equal(value, new), f"torn at {where}"

    points = sweep(lambda: storage.write_payload(path, {"x": new}), tmp_path, check)
    assert points > 50, "the write made fewer points than expected: the test proves little"


@needs_proc
@pytest.mark.timeout(180)
def test_a_ctrl_c_anywhere_in_an_offload_leaves_nothing_once_the_tensor_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new offloaded tensor's file and private directory go with the tensor, wherever a
    Ctrl-C cut its creation: between the rename and the file's owner, or between the making
    of the directory and its remover, they once stayed for the process's life."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # private directories land here
    value = torch.arange(1000, dtype=torch.float32)
    points = sweep(lambda: OffloadedTensor.from_original_tensor(value, "w"), tmp_path)
    assert points > 50, "the offload made fewer points than expected: the test proves little"


@needs_proc
@pytest.mark.timeout(120)
def test_a_ctrl_c_anywhere_in_a_read_leaves_no_descriptor(tmp_path: Path) -> None:
    path = tmp_path / "p.safetensors"
    value = torch.arange(1000, dtype=torch.float32)
    storage.write_payload(path, {"x": value})

    def read() -> None:
        got = storage.read_payload(storage.read_layout(path))["x"]
        assert torch.equal(got, value)

    points = sweep(read, tmp_path)
    assert points > 20, "the read made fewer points than expected: the test proves little"


def test_a_ctrl_c_anywhere_in_a_hold_leaves_python_s_handler_and_no_stale_one(
    tmp_path: Path,
) -> None:
    """A Ctrl-C raised just as a hold put Python's handler back once left the replaced
    handler recorded, which every child forked later got back in place of its own."""

    def hold() -> None:
        with _interrupts.InterruptHold() as held:
            held.start()

    assert sweep(hold, tmp_path, within=_interrupts.__file__) > 3
