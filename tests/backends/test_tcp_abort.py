"""Deregistration against a peer's request on the TCP target (issue 8): an abort ends the socket call
moving the region's bytes at once, the peer is answered REM_ACCESS_ERR and never reset before it read
the answer, and an abort that comes after the call ended leaves the connection serving.

The peer speaks the data wire by hand (``datawire.py``)."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from moriio_async.backends.tcp import VendorErr
from moriio_async.backends.tcp.connection import Connection
from moriio_async.backends.tcp.reactor import Reactor
from moriio_async.status import WcStatus

from . import datawire as dw
from .test_tcp_trust import random_token, target

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.only_backends("tcp", reason="the TCP backend's data port, spoken by hand"),
]


def test_deregistration_aborts_a_trickled_write_instead_of_waiting() -> None:
    """Issue 8: deregistration waited for a WRITE trickling into the region (the loop stood 18 s)."""
    with target(retry_timeout=30.0) as t:
        sock, status = dw.dial(t.port, random_token(t))
        assert status == dw.OK
        sock.sendall(dw.chunk(dw.WRITE, 0, (t.mr.rkey, t.mr.addr, 4096)) + b"\7" * 10)
        try:
            with dw.Dripper(sock, 0.05):
                deadline = time.monotonic() + 5
                while not (t.buf[:10] == 7).all():  # the payload is landing in the region
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                started = time.perf_counter()
                t.backend.deregister_memory(t.mr)
                took = time.perf_counter() - started
                snapshot = t.buf.copy()
                r = dw.response(sock)
                assert (r.status, r.vendor) == (dw.REM_ACCESS_ERR, VendorErr.REMOTE_DEREGISTERED)
                time.sleep(0.3)
                assert np.array_equal(t.buf, snapshot), "a byte landed after deregistration returned"
                assert t.counters["aborted_requests"] == 1
                assert took < 5.0, f"deregistration waited {took:.1f}s for the peer"  # the old wait: 30 s here
        finally:
            sock.close()


def test_an_aborted_write_is_answered_and_not_reset_while_the_initiator_still_sends() -> None:
    """A pipelining initiator is still sending the payloads behind the aborted WRITE. The target must
    neither reset the connection (Linux resets one that gets data after both directions were shut)
    nor close it before the initiator hung up: either makes the initiator's sender fail the request
    RETRY_EXC_ERR before its receiver reads REM_ACCESS_ERR. (CI caught this as a flake.)"""
    with target(retry_timeout=30.0) as t:
        sock, status = dw.dial(t.port, random_token(t))
        assert status == dw.OK
        try:
            sock.sendall(dw.chunk(dw.WRITE, 0, (t.mr.rkey, t.mr.addr, 4096)) + b"\7" * 10)
            deadline = time.monotonic() + 5
            while not (t.buf[:10] == 7).all():  # the payload is landing in the region
                assert time.monotonic() < deadline
                time.sleep(0.01)
            t.backend.deregister_memory(t.mr)
            # The rest of this payload, then the next WRITE, as a pipelined initiator sends them.
            sock.sendall(b"\7" * 4086 + dw.chunk(dw.WRITE, 1, (t.mr.rkey, t.mr.addr, 4096)) + b"\7" * 4096)
            time.sleep(0.2)
            sock.sendall(b"\7" * 4096)  # a reset connection fails here
            r = dw.response(sock)
            assert (r.status, r.vendor) == (dw.REM_ACCESS_ERR, VendorErr.REMOTE_DEREGISTERED)
            assert not dw.closed_within(sock, 0.3), "the target hung up before the initiator did"
        finally:
            sock.close()


def test_an_abort_after_the_socket_call_ended_leaves_the_connection_serving() -> None:
    """Deregistration aborts every holder of a pin; one whose call on the region already ended (its
    bytes are in, its answer and unpin come next) must not have its socket shut, or the chunks after
    it are served on a read-shut socket and their refusal can be beaten by a reset."""
    ours, theirs = socket.socketpair()
    reactor = Reactor("test-reactor")
    try:
        with ours, theirs:
            connection = Connection(ours, 5.0, reactor)
            connection.abort()  # not between pinning a chunk's regions and the end of its moves on them
            theirs.sendall(b"request")
            assert ours.recv(16) == b"request"
            ours.sendall(b"answer")
            assert theirs.recv(16) == b"answer"
    finally:
        reactor.stop(lambda: None)


def test_a_request_after_deregistration_fails_with_rem_access_err() -> None:
    with target() as t:
        sock, status = dw.dial(t.port, random_token(t))
        assert status == dw.OK
        t.backend.deregister_memory(t.mr)
        sock.sendall(dw.chunk(dw.WRITE, 0, (t.mr.rkey, t.mr.addr, 16)) + b"\1" * 16)
        r = dw.response(sock)
        assert (r.status, r.vendor) == (int(WcStatus.REM_ACCESS_ERR), VendorErr.UNKNOWN_RKEY)
        assert not t.buf.any()
        sock.close()
