"""Every HTTP and WebSocket endpoint edgerun serves (OpenAI's API, the dashboard, the browser node page, stage
files, pipeline workers' WebSockets) is a Starlette application run by uvicorn: this module runs one on an
event-loop thread, on a socket bound beforehand.

The loop is a thread of its own, not the caller's, because a pipeline master's deployment and forward passes
run on the same loop as its workers' WebSockets (one loop, no hand-off between threads per message), while the
caller's thread generates and blocks on them."""

from __future__ import annotations

import contextlib
import socket
import time

from starlette.types import ASGIApp

from edgerun.errors import EdgerunError
from edgerun.net.channel import EventLoopThread
from edgerun.net.wire import PP_MAX_FRAME

START_TIMEOUT_S = 30.0


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket, bound here so that a port in use is one clear line before anything slow runs."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise EdgerunError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


class HttpServer:
    """uvicorn serving `app` on `sock` from the loop of `net` (a new loop thread unless given, which close() then
    stops), taking WebSocket messages of up to `max_message` bytes. Returns once it accepts connections."""

    def __init__(self, app: ASGIApp, sock: socket.socket, net: EventLoopThread | None = None,
                 max_message: int = PP_MAX_FRAME) -> None:
        import uvicorn

        self.sock = sock
        self.port = sock.getsockname()[1]
        self.own_net = net is None
        self.net = net or EventLoopThread()
        # Pipeline frames carry a prefill's hidden states: WebSocket messages as large as the wire allows, and
        # no compression (float32 activations barely compress, and deflate would cost more than the link).
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                                    ws_max_size=max_message, ws_per_message_deflate=False,
                                                    timeout_graceful_shutdown=2))
        self.done = self.net.submit(self.server.serve(sockets=[sock]))
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if self.done.done():
                self.done.result()  # uvicorn's own error
                raise EdgerunError("the HTTP server stopped while starting")
            if time.monotonic() > deadline:
                raise EdgerunError(f"the HTTP server did not start within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.01)

    def running(self) -> bool:
        return not self.done.done()

    def close(self) -> None:
        """Stop serving (open WebSockets are closed), release the socket, and stop the loop if it is ours."""
        self.server.should_exit = True
        with contextlib.suppress(Exception):
            self.done.result(timeout=5)
        self.sock.close()
        if self.own_net:
            self.net.stop()
