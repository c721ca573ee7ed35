"""control.inbox: a reader or a writer cancelled just after its wakeup passes the wakeup on.

A wakeup is one item (for a reader) or room for one (for a writer); a waiter
cancelled between being woken and running would otherwise take it with it,
and the next waiter would wait for ever with an item queued, or room free.
"""

from __future__ import annotations

import asyncio

from moriio_async.control.inbox import Inbox, Notification


def note(data: bytes) -> Notification:
    return Notification("peer", data)


async def test_a_reader_cancelled_after_its_wakeup_passes_the_item_on() -> None:
    inbox = Inbox()
    first = asyncio.create_task(inbox.get())
    second = asyncio.create_task(inbox.get())
    await asyncio.sleep(0)  # both wait, first in line
    await inbox.put(note(b"x"))  # wakes the first reader only
    first.cancel()  # before it ran
    assert (await asyncio.wait_for(second, 10)).data == b"x"
    assert first.cancelled() and len(inbox) == 0


async def test_a_writer_cancelled_after_its_wakeup_passes_the_room_on() -> None:
    inbox = Inbox(max_items=1)
    await inbox.put(note(b"a"))
    first = asyncio.create_task(inbox.put(note(b"b")))
    second = asyncio.create_task(inbox.put(note(b"c")))
    await asyncio.sleep(0)  # both wait for room, first in line
    assert (await inbox.get()).data == b"a"  # room for one: wakes the first writer only
    first.cancel()  # before it ran
    await asyncio.wait_for(second, 10)
    assert first.cancelled() and [(await inbox.get()).data] == [b"c"] and len(inbox) == 0
