"""HTTP plumbing shared by the serving processes: bounded bodies, msgspec JSON, and running uvicorn.

``serve`` binds the listening socket itself (port 0 picks one; a restarted
instance passes its old port again), prints one JSON line ``{"url": ...}`` on
stdout once uvicorn accepts connections, and with ``parent_watch`` shuts down
gracefully when its stdin closes: a launcher that dies, even by SIGKILL, leaves
no server behind.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Protocol, TypeVar

import msgspec
import uvicorn
from fastapi import FastAPI, Request, Response

from .config import InstanceSettings
from .instance import Instance, ServingError
from .messages import AbortRequest, ErrorBody
from .metrics import CONTENT_TYPE

__all__ = ["add_instance_routes", "add_json_route", "instance_app", "json_response", "read_body", "read_json", "serve"]

log = logging.getLogger("moriio_async.serving")
T = TypeVar("T")


class Aborts(Protocol):
    def abort(self, request_id: str) -> None:
        """The proxy gave up on ``request_id``: end what this server holds for it."""


S = TypeVar("S", bound=Aborts)
MAX_BODY = 1 << 20
"""Largest request body accepted by any serving endpoint."""


async def read_body(request: Request, limit: int = MAX_BODY) -> bytes:
    """The request body, refusing more than ``limit`` bytes before reading them all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ServingError(413, f"request body larger than {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ServingError(413, f"request body larger than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: Request, kind: type[T]) -> T:
    """Decode the body as ``kind`` (strict types); ``ServingError(400)`` when it is not one."""
    try:
        return msgspec.json.decode(await read_body(request), type=kind)
    except msgspec.DecodeError as exc:
        raise ServingError(400, f"bad {kind.__name__}: {exc}") from None


def json_response(obj: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json", headers=headers)


class InstanceGetter:
    """The app's instance, once its lifespan started it."""

    def __init__(self) -> None:
        self.instance: Instance | None = None

    def __call__(self) -> Instance:
        if self.instance is None:
            raise ServingError(503, "the instance is starting", retryable=True)
        return self.instance


def add_instance_routes(app: FastAPI, get: InstanceGetter) -> None:
    """``/health``, ``/metrics``, and ServingError answered as an ``ErrorBody``."""

    @app.exception_handler(ServingError)
    async def serving_error(_request: Request, exc: ServingError) -> Response:
        return json_response(ErrorBody(str(exc), exc.retryable, exc.cause), exc.status)

    @app.get("/health")
    async def health() -> Response:
        return json_response(get().health())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(get().metrics.render(), media_type=CONTENT_TYPE)


def instance_app(
    settings: InstanceSettings, role: str, make_server: Callable[[Instance], S]
) -> tuple[FastAPI, Callable[[], S]]:
    """An instance's FastAPI app: its lifespan starts one ``Instance`` (and the role's server over it)
    and closes it; ``/health``, ``/metrics`` and ``/abort`` (the server's ``abort``); and a getter for the
    server (503 while starting)."""
    getter = InstanceGetter()
    servers: list[S] = []

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        instance = Instance(settings)
        await instance.start()
        servers.append(make_server(instance))
        getter.instance = instance
        try:
            yield
        finally:
            getter.instance = None
            await instance.close()

    app = FastAPI(title=f"moriio_async {role} {settings.name}", lifespan=lifespan)
    add_instance_routes(app, getter)

    def server() -> S:
        getter()  # ServingError(503) until the lifespan has started the instance
        return servers[0]

    async def abort(srv: S, req: AbortRequest) -> Response:
        srv.abort(req.request_id)
        return json_response({"ok": True})

    add_json_route(app, "/abort", AbortRequest, server, abort)
    return app, server


def add_json_route(
    app: FastAPI,
    path: str,
    kind: type[T],
    server: Callable[[], S],
    handle: Callable[[S, T], Awaitable[Response]],
) -> None:
    """``POST path``: ``handle`` the role's server (503 while the instance starts, before the body is read)
    and the body as a ``kind`` (400 if it is not one)."""

    async def route(request: Request) -> Response:
        srv = server()
        return await handle(srv, await read_json(request, kind))

    app.post(path, name=path.strip("/"))(route)


def _watch_parent(server: uvicorn.Server, loop: asyncio.AbstractEventLoop) -> None:
    def wait_for_eof() -> None:
        # A plain blocking read in a daemon thread: EOF means whoever started us is gone.
        while os.read(sys.stdin.fileno(), 4096):
            pass
        loop.call_soon_threadsafe(setattr, server, "should_exit", True)

    threading.Thread(target=wait_for_eof, name="parent-watch", daemon=True).start()


def serve(app: FastAPI, host: str, port: int, *, role: str, parent_watch: bool = False) -> int:
    """Run ``app`` until SIGINT/SIGTERM (or stdin EOF with ``parent_watch``); 0 on a clean stop."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound = sock.getsockname()[1]
    loop_impl = "uvloop" if _has_uvloop() else "asyncio"
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=3, access_log=False)
    server = uvicorn.Server(config)

    async def main() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():  # noqa: ASYNC110 (uvicorn offers a flag, no event)
            await asyncio.sleep(0.01)
        if server.started:
            url = f"http://{host}:{bound}"
            print(json.dumps({"role": role, "url": url, "pid": os.getpid()}), flush=True)
            if parent_watch:
                _watch_parent(server, asyncio.get_running_loop())
        await task

    if loop_impl == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())
    return 0 if server.started else 1


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True
