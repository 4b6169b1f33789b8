"""A Ctrl-C that lands on a garbage collection's callbacks: finalizers still know that they
run in a collection, and nothing says so once it ended.

Python runs a pending signal handler at the start of the first Python code a collection
calls; when that is a callback of the collection, the ``KeyboardInterrupt`` is reported as
unraisable and the callback does nothing. The interrupt is made pending from C code that
calls the collection right after (``map`` over ``operator.call``), or by a finalizer written
in C, so that it lands on the package's callback, which the test checks.
"""

from __future__ import annotations

import _thread
import gc
from typing import ClassVar

import pytest
from interrupts import collections_by_hand, interrupted_then

from torch_to_nnef import _owned
from torch_to_nnef._owned import collecting_here

pytestmark = [pytest.mark.timeout(60)]


class _Recorded:
    """Garbage in a cycle whose finalizer records whether it runs in a collection."""

    seen: ClassVar[list[bool]] = []

    def __init__(self) -> None:
        self.cycle = self

    def __del__(self) -> None:
        _Recorded.seen.append(collecting_here())


class _Interrupting:
    """Garbage in a cycle whose finalizer makes a Ctrl-C pending, running no Python code
    (a builtin, called with no argument): the next Python code the collection runs gets it."""

    __del__ = staticmethod(_thread.interrupt_main)

    def __init__(self) -> None:
        self.cycle = self


def test_finalizers_know_they_run_in_a_collection_whose_first_callback_a_ctrl_c_cut() -> None:
    _Recorded.seen.clear()
    with collections_by_hand() as caught:
        _Recorded()
        interrupted_then(gc.collect)
    assert [(report.exc_type, report.object) for report in caught] == [
        (KeyboardInterrupt, _owned._note_collection)
    ], "the Ctrl-C did not land on the package's callback: the test proves nothing"
    assert _Recorded.seen == [True]
    assert not collecting_here()


def test_no_collection_is_said_to_run_after_one_whose_last_callback_a_ctrl_c_cut() -> None:
    with collections_by_hand() as caught:
        _Interrupting()
        gc.collect()
    assert [(report.exc_type, report.object) for report in caught] == [
        (KeyboardInterrupt, _owned._note_collection)
    ], "the Ctrl-C did not land on the package's callback: the test proves nothing"
    assert not collecting_here()
