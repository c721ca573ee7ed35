"""The initiator's in-use word as the target reads it: which table slot a window is copying, and a
deregistration's wait for that window only (never for a window on another slot, never past its
deadline, never for an initiator that is gone)."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from moriio_async.backends.cma.inuse import ANY, PAGE, InUse, InUseView, tag_for

pytestmark = pytest.mark.only_backends("cma", reason="unit tests of the cma backend's in-use word")

LONG = 30.0
"""A deadline no passing test reaches."""


def test_a_window_s_word_names_its_one_slot_or_any(backend_name: str) -> None:
    assert tag_for(np.array([5], np.uint32)) == 6
    assert tag_for(np.array([5, 5, 5], np.uint32)) == 6
    assert tag_for(np.array([5, 6], np.uint32)) == ANY
    assert tag_for(np.array([0, 0], np.uint32)) == 1


def test_a_deregistration_waits_only_for_a_window_on_its_slot(backend_name: str) -> None:
    mine, view = InUse(), None
    try:
        view = InUseView(mine.fd)
        never_gone = lambda: False  # noqa: E731
        past = time.monotonic() - 1
        assert view.read() == 0
        assert view.wait_clear(7, past, never_gone) and view.wait_clear(None, past, never_gone)  # idle
        mine.enter(7 + 1)  # a window on slot 7
        assert view.read() == 8
        assert not view.wait_clear(7, past, never_gone)  # its slot: waits, gives up at the deadline
        assert not view.wait_clear(None, past, never_gone)  # any slot (closing the backend): waits too
        assert view.wait_clear(8, past, never_gone)  # another slot: no wait
        assert view.wait_clear(7, past, lambda: True)  # the initiator is gone: no wait
        mine.enter(ANY)  # a window over several slots
        assert not view.wait_clear(3, past, never_gone)
        mine.leave()
        assert view.read() == 0 and view.wait_clear(7, past, never_gone)
        # A window that ends while the target waits: the wait returns then, well before its deadline.
        mine.enter(7 + 1)
        timer = threading.Timer(0.05, mine.leave)
        timer.start()
        try:
            assert view.wait_clear(7, time.monotonic() + LONG, never_gone)
        finally:
            timer.join()
        view.close()
        assert view.read() == 0  # closed: the connection ended, it moves nothing more
        view = None
    finally:
        if view is not None:
            view.close()
        mine.close()


def test_the_target_maps_only_a_page_sized_in_use_word(backend_name: str) -> None:
    fd = os.memfd_create("not-an-in-use-page", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 2 * PAGE)
        with pytest.raises(ValueError, match=r"^not an in-use page$"):
            InUseView(fd)
    finally:
        os.close(fd)
