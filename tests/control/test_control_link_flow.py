"""One control link, both ends in the test: how notices flow (in order, awaited one by one, batched by
post_soon, within the link's frame limit), how many requests run at once, late replies, and what
closing cancels."""

from __future__ import annotations

import asyncio
import gc

import pytest

from moriio_async import Access, ControlPlaneError, MemoryDesc
from moriio_async.control.link import ControlLink
from moriio_async.core.framing import FrameError
from moriio_async.core.protocol import Exports, ListMemory, Notice, Notify, Reply, Request, encode

from .linkpair import Handler, linked


async def test_notices_arrive_in_order_and_each_is_awaited_before_the_next_frame() -> None:
    gate = asyncio.Event()
    server = Handler(gate=gate)
    async with linked(server) as ends:
        one, two, three, four = (Notify(data=bytes([i])) for i in range(4))
        assert ends.client.post(one)
        assert ends.client.post_soon(two) and ends.client.post_soon(three)
        queued = len(encode(two)) + len(encode(three))
        assert ends.client.backlog == queued  # queued for one write at the end of this iteration
        assert ends.client.post(four)  # written after the queued ones
        for _ in range(50):
            await asyncio.sleep(0.001)
            if server.notices:
                break
        await asyncio.sleep(0.02)
        assert server.notices == [one]  # held in the handler: nothing after it is read
        assert ends.server.busy
        gate.set()
        for _ in range(200):
            if len(server.notices) == 4:
                break
            await asyncio.sleep(0.005)
        assert server.notices == [one, two, three, four]
        assert server.links == [ends.server] * 4
        assert not ends.server.busy


async def test_a_burst_posted_in_one_iteration_is_one_write() -> None:
    server = Handler()
    async with linked(server) as ends:
        writes: list[bytes] = []
        write = ends.writer.write

        def counting(data: bytes | bytearray | memoryview) -> None:
            writes.append(bytes(data))
            write(data)

        ends.writer.write = counting  # type: ignore[method-assign]
        burst = [Notify(data=bytes([i])) for i in range(5)]
        assert all(ends.client.post_soon(n) for n in burst)
        assert writes == []
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert writes == [b"".join(encode(n) for n in burst)]
        for _ in range(200):
            if len(server.notices) == 5:
                break
            await asyncio.sleep(0.005)
        assert server.notices == burst


async def test_at_most_max_pending_requests_run_at_once() -> None:
    release = asyncio.Event()

    async def slow(request: Request) -> Reply:
        await release.wait()
        return Exports()

    server = Handler(slow)
    async with linked(server, max_pending=2) as ends:
        loop = asyncio.get_running_loop()
        asks = [loop.create_task(ends.client.request(ListMemory(), Exports)) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert [r.id for r in server.requests] == [1, 2]  # the third waits in the socket
        release.set()
        replies = await asyncio.gather(*asks)
        assert sorted(r.re for r in replies) == [1, 2, 3]
        assert [r.id for r in server.requests] == [1, 2, 3]


async def test_a_lone_notice_posted_soon_goes_out_and_the_links_frame_limit_holds() -> None:
    server = Handler()
    async with linked(server) as ends:
        assert ends.client.post_soon(Notify(data=b"alone"))
        for _ in range(200):
            if server.notices:
                break
            await asyncio.sleep(0.005)
        assert server.notices == [Notify(data=b"alone")]
        big = Notify(data=bytes(1 << 16))  # over this link's max_frame, well under the default one
        with pytest.raises(FrameError, match=r"exceeds the 65536-byte frame limit"):
            ends.client.post_soon(big)
        with pytest.raises(FrameError, match=r"exceeds the 65536-byte frame limit"):
            await ends.client.send(big)
        assert ends.client.backlog == 0


async def test_nothing_is_posted_on_a_stream_that_is_closing() -> None:
    async with linked(Handler()) as ends:
        ends.writer.close()  # the stream under the link, before the link itself hears of it
        assert not ends.client.closed
        assert not ends.client.post_soon(Notify(data=b"x"))
        assert not ends.client.post(Notify(data=b"x"))


async def test_a_late_reply_is_dropped_and_the_link_keeps_serving() -> None:
    async def late(request: Request) -> Reply:
        await asyncio.sleep(0.3 if request.id == 1 else 0)
        return Exports()

    async with linked(Handler(late), timeout=0.15) as ends:
        with pytest.raises(ControlPlaneError, match="no reply within"):
            await ends.client.request(ListMemory(), Exports)
        await asyncio.sleep(0.3)  # the reply to request 1 arrives now, for nobody
        assert not ends.client.closed
        assert (await ends.client.request(ListMemory(), Exports)).re == 2


async def test_the_next_request_is_read_as_soon_as_one_of_max_pending_ends() -> None:
    gates = {i: asyncio.Event() for i in (1, 2, 3)}

    async def gated(request: Request) -> Reply:
        await gates[request.id].wait()
        return Exports()

    server = Handler(gated)
    async with linked(server, max_pending=2) as ends:
        loop = asyncio.get_running_loop()
        asks = [loop.create_task(ends.client.request(ListMemory(), Exports)) for _ in range(3)]
        await asyncio.sleep(0.05)
        gates[1].set()  # one ends; 2 still runs
        assert (await asyncio.wait_for(asks[0], 5)).re == 1
        for _ in range(200):
            if len(server.requests) == 3:
                break
            await asyncio.sleep(0.005)
        assert [r.id for r in server.requests] == [1, 2, 3]
        gates[2].set()
        gates[3].set()
        assert [r.re for r in await asyncio.gather(*asks[1:])] == [2, 3]


async def test_closing_a_link_cancels_the_requests_it_serves() -> None:
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def hang(request: Request) -> Reply:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return Exports()

    async with linked(Handler(hang)) as ends:
        asking = asyncio.get_running_loop().create_task(ends.client.request(ListMemory(), Exports))
        await asyncio.wait_for(started.wait(), 5)
        ends.server.close()
        await asyncio.wait_for(cancelled.wait(), 5)
        await ends.server.wait_closed()
        assert not ends.server.busy
        with pytest.raises(ControlPlaneError):
            await asyncio.wait_for(asking, 5)  # the client hears the link end


async def test_a_peer_that_stops_reading_fails_a_send_within_the_timeout() -> None:
    async with linked(Handler(), timeout=0.2, start=False) as ends:  # the far end never reads
        loop = asyncio.get_running_loop()
        note = Notify(data=bytes(40_000))
        with pytest.raises(ControlPlaneError) as info:
            async with asyncio.timeout(10):
                for _ in range(10_000):  # until the socket buffers are full and a drain waits
                    start = loop.time()
                    await ends.client.send(note)
        assert str(info.value) == f"control link to {ends.address} failed: TimeoutError()"
        assert 0.2 - 1e-3 <= loop.time() - start < 5
        assert ends.client.closed


async def test_a_transport_that_fails_under_a_write_closes_the_link() -> None:
    async with linked(Handler()) as ends:

        def broken(data: bytes | bytearray | memoryview) -> None:
            raise RuntimeError("the transport closed under us")

        ends.writer.write = broken  # type: ignore[method-assign]
        with pytest.raises(ControlPlaneError) as info:
            await ends.client.send(Notify(data=b"x"))
        assert str(info.value) == (
            f"control link to {ends.address} failed: RuntimeError('the transport closed under us')"
        )
        assert ends.client.closed
        assert not ends.client.post(Notify(data=b"x"))


async def test_a_reply_too_large_to_send_is_dropped_and_the_link_serves_on() -> None:
    region = MemoryDesc("b", 1, "r" * 200, 0, 1, 1, Access.LOCAL_WRITE)

    async def answer(request: Request) -> Reply:
        return Exports(memory=[region] * 400) if request.id == 1 else Exports()  # the first is over 64 KiB

    async with linked(Handler(answer), timeout=0.3) as ends:
        with pytest.raises(ControlPlaneError, match="no reply within"):
            await ends.client.request(ListMemory(), Exports)
        gc.collect()
        assert (await ends.client.request(ListMemory(), Exports)).re == 2
        assert not ends.server.closed


async def test_a_handler_that_closes_its_own_link_runs_to_its_end() -> None:
    """Closing a link from inside its own reader (a notice handler) or request task stops the others,
    not the one that called close: the handler's code after close still runs."""
    finished: list[str] = []

    class Closing(Handler):
        async def on_request(self, link: ControlLink, request: Request) -> Reply:
            link.close()
            await asyncio.sleep(0)
            finished.append("request")
            return Exports()

        async def on_notice(self, link: ControlLink, notice: Notice) -> None:
            link.close()
            await asyncio.sleep(0)
            finished.append("notice")

    for send in ("notice", "request"):
        async with linked(Closing()) as ends:
            if send == "notice":
                ends.writer.write(encode(Notify(data=b"bye")))
            else:
                ends.writer.write(encode(ListMemory(id=1)))
            for _ in range(200):
                if ends.server.closed:
                    break
                await asyncio.sleep(0.005)
            await asyncio.wait_for(ends.server.wait_closed(), 5)
            assert finished == ["notice", "request"][: 1 if send == "notice" else 2]


async def test_a_notice_handler_that_fails_ends_the_link_and_wait_closed_still_returns() -> None:
    class Failing(Handler):
        async def on_notice(self, link: ControlLink, notice: Notice) -> None:
            raise ValueError("a bug in the handler")

    server = Failing()
    async with linked(server) as ends:
        ends.writer.write(encode(Notify(data=b"x")))
        for _ in range(200):
            if ends.server.closed:
                break
            await asyncio.sleep(0.005)
        assert server.closed == [ends.server]
        await asyncio.wait_for(ends.server.wait_closed(), 5)  # the reader's error is not raised here


async def test_notices_posted_soon_before_the_stream_closes_are_dropped_quietly() -> None:
    async with linked(Handler(), start=False) as ends:  # no reader: only the test closes the client link
        assert ends.client.post_soon(Notify(data=b"x"))
        assert ends.client.backlog == len(encode(Notify(data=b"x")))
        ends.writer.close()  # the stream under the link closes before the burst is written
        await asyncio.sleep(0)  # the burst's write runs, finds the stream closing, and drops it
        await asyncio.sleep(0)
        assert not ends.client.closed
        assert ends.client.backlog == 0
        assert not ends.client.post_soon(Notify(data=b"y"))
