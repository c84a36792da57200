"""The ingress's own HTTP server (deployments/direct.py), without Ray: a shared port, the
socket's own peer as the client, a stop that lets a running request finish."""

from __future__ import annotations

import asyncio

import httpx

from deployments.direct import DirectServer


async def _echo(scope: dict, receive, send) -> None:  # noqa: ANN001 - ASGI
    if scope["type"] != "http":
        return
    if scope["path"] == "/slow":
        await asyncio.sleep(0.5)
    body = f"{scope['client'][0]} {scope['path']}".encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def test_two_servers_share_a_port_and_see_the_sockets_own_peer():
    async def main() -> tuple[list[str], str, str]:
        a = DirectServer(_echo, "127.0.0.1", 0)
        port = a.sock.getsockname()[1]
        b = DirectServer(_echo, "127.0.0.1", port)  # a replacement replica while the old one drains
        async with httpx.AsyncClient() as c:
            for _ in range(100):  # until both serve
                if a.server.started and b.server.started:
                    break
                await asyncio.sleep(0.02)
            spoofed = await c.get(f"http://127.0.0.1:{port}/x", headers={"X-Forwarded-For": "203.0.113.9"})
            slow = asyncio.create_task(c.get(f"http://127.0.0.1:{port}/slow"))
            await asyncio.sleep(0.1)
            await asyncio.gather(a.stop(5.0), b.stop(5.0))  # stop accepting, finish the running one
            done = await slow
            try:
                await c.get(f"http://127.0.0.1:{port}/after", timeout=2)
                after = "served"
            except httpx.HTTPError:
                after = "refused"
        return [spoofed.text], done.text, after

    spoofed, slow, after = asyncio.run(main())
    assert spoofed == ["127.0.0.1 /x"]  # X-Forwarded-For is not taken from a loopback client
    assert slow == "127.0.0.1 /slow"  # a request running when the server stopped got its answer
    assert after == "refused"
