"""The TCP initiator against a target that breaks the protocol: a response that does not answer the
request at the head (another opcode, another sequence number, more requests than the chunk holds, a
payload of the wrong size) fails that request BAD_RESP_ERR with vendor BAD_RESPONSE, flushes every
later one, and leaves the pair in ERR. No byte lands outside the failed READ's own buffer (whose
contents are undefined after a failure, as on verbs: the payload is received with the header).

The target speaks the data wire by hand (``datawire.py``)."""

from __future__ import annotations

import socket
import threading

import pytest

from moriio_async.backends import open_backend
from moriio_async.backends.base import QpState
from moriio_async.backends.tcp import VendorErr
from moriio_async.status import Opcode, WcStatus

from . import datawire as dw
from .harness import FakeTargetClient, make_options

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.only_backends("tcp", reason="the TCP backend's data port, spoken by hand"),
]

SIZE = 4096
BAD = {  # the response to a one-request READ chunk of SIZE bytes, sequence number 0
    "another-opcode": dw.RESPONSE.pack(dw.WRITE, 0, 0, 0, 1, 0, 0),
    "another-seq": dw.RESPONSE.pack(dw.READ, 0, 0, 5, 1, 0, SIZE),
    "more-than-the-chunk": dw.RESPONSE.pack(dw.READ, 0, 0, 0, 2, 0, 2 * SIZE),
    "failure-past-the-chunk": dw.RESPONSE.pack(dw.READ, dw.REM_ACCESS_ERR, 1, 0, 1, 0, 0),
    "success-of-nothing": dw.RESPONSE.pack(dw.READ, 0, 0, 0, 0, 0, 0),
    "short-payload": dw.RESPONSE.pack(dw.READ, 0, 0, 0, 1, 0, SIZE - 1),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_a_response_that_answers_another_request_is_a_bad_response(kind: str) -> None:
    fake = socket.create_server(("127.0.0.1", 0))
    backend = open_backend("tcp", make_options("tcp", retry_timeout=5.0))

    def serve() -> None:
        conn, _ = fake.accept()
        with conn:
            dw.accept_one_request(conn)
            conn.sendall(BAD[kind] + b"\7" * SIZE)
            conn.settimeout(10)
            while conn.recv(1 << 16):  # until the initiator hangs up
                pass

    server = threading.Thread(target=serve)
    server.start()
    try:
        client = FakeTargetClient.dial(backend, fake.getsockname()[1], 2 * SIZE)
        qp, waiter = client.qp, client.waiter
        client.read(1, 0, SIZE)
        [wc] = waiter.wait(1)
        assert (wc.wr_id, wc.status, wc.vendor_err, wc.opcode, wc.qp_num) == (
            1,
            WcStatus.BAD_RESP_ERR,
            VendorErr.BAD_RESPONSE,
            Opcode.RDMA_READ,
            qp.qp_num,
        )
        assert qp.state == QpState.ERR
        client.read(2, SIZE, SIZE)
        [wc] = waiter.wait(1)
        assert (wc.wr_id, wc.status, wc.vendor_err) == (2, WcStatus.WR_FLUSH_ERR, 0)
        assert not client.buf[SIZE:].any(), "a byte landed outside the failed request's buffer"
    finally:
        backend.close()
        server.join()
        fake.close()
