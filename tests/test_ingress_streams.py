"""The ingress's output streams end at the engine replica when the ingress stops: the pump
cancels its call at the replica directly, since a stopping replica is no longer in the
router's list (a call routed to it would not arrive, and its graceful shutdown would wait on
the open stream until it is killed)."""

from __future__ import annotations

import asyncio
from typing import Any

from deployments.streams import IngressStreams
from tests.fake_handle import FakeHandle, Streamed


class Engine(FakeHandle):
    deployment_name = "engine-of-test-ingress-streams"  # no replicas known to the router

    def __init__(self) -> None:
        self.calls: list[Streamed] = []

    def _outputs(self, ingress_id: str, conn: str, replica: str | None = None) -> Streamed:
        """Registers, then holds the stream open until the call is cancelled."""
        call = Streamed()

        async def held() -> Any:
            yield {"connected": "r1"}
            await call.cancelled.wait()

        call.gen = held()
        self.calls.append(call)
        return call


def test_closing_the_ingress_cancels_its_streams_at_the_replica_not_through_the_router():
    async def run() -> None:
        engine = Engine()
        streams = IngressStreams(engine, connect_timeout_s=1.0)
        streams.ensure()
        await asyncio.wait_for(streams.connected.wait(), 10)
        assert list(streams.streams) == ["r1"]
        held = engine.calls[0]
        assert not held.cancelled.is_set()
        await asyncio.wait_for(streams.close(), 10)
        assert held.cancelled.is_set()  # the call itself was cancelled
        assert streams.streams == {} and not streams.connected.is_set()
        assert len(engine.calls) == 1  # and no stream was opened again after the close

    asyncio.run(run())
