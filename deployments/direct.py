"""Direct ingress: the ingress replica serves HTTP itself, with no Serve proxy in the path.

Behind Serve's proxy actor every response chunk of every stream is a Ray message from the
ingress replica to the proxy, which costs more CPU per token than the engine's own host work
(``make bench``). When the Serve config runs no HTTP proxy (``proxy_location: Disabled``),
each ingress replica listens on ``http_options``' address and port instead, with the same
ASGI app (guard, routes, metrics) under uvicorn. The socket is opened with ``SO_REUSEPORT``,
so a replica that starts while the one it replaces is still draining shares the port with
it (Linux lets only the same user do so), and the kernel spreads connections over the
ingress replicas of one node. Clients' own addresses reach the guard, as behind the proxy.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

from deployments.guard import KeepsRequestTarget

log = logging.getLogger(__name__)


def serve_http_config() -> tuple[str, int, bool]:
    """Serve's HTTP address and port, and whether it runs HTTP proxies (asked of the controller)."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    ctrl = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    http, location = ray.get([ctrl.get_http_config.remote(), ctrl.get_proxy_location.remote()], timeout=10)
    return str(http.host), int(http.port), str(getattr(location, "value", location)) != "Disabled"


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` that replicas of this user share."""
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(info[0], socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if info[0] == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(info[4])
        sock.listen(2048)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class DirectServer:
    """uvicorn serving ``app`` on this event loop, on a socket of its own."""

    def __init__(self, app: Any, host: str, port: int) -> None:
        import uvicorn
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        self.sock = listen(host, port)
        # proxy_headers off: the guard counts the socket's own peer, never an X-Forwarded-For a
        # client on loopback could write; the protocol hands the guard the whole request target
        protocol = type("Protocol", (KeepsRequestTarget, HttpToolsProtocol), {})
        config = uvicorn.Config(app, lifespan="off", log_level=None, log_config=None, access_log=False,
                                timeout_keep_alive=5, loop="none", proxy_headers=False, http=protocol)
        self.server = uvicorn.Server(config)
        self.server.install_signal_handlers = lambda: None  # the replica's process owns its signals
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.sock]))
        log.warning("the ingress serves HTTP itself on %s:%d (no Serve proxy)", host, port)

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Stop accepting, let running requests finish within ``timeout_s``, then close."""
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), timeout_s)
        except (TimeoutError, asyncio.CancelledError):
            self.server.force_exit = True
            self.task.cancel()
        finally:
            self.sock.close()
