"""A node relaying its runner's Generate stream to a peer (``node.relay_generation``), over real grpc.aio servers on
127.0.0.1: the runner's end is a server that streams heartbeats (the runner process is the daemon's outer edge).

When a runner dies, its supervisor sees the process end and closes the channel to it, sometimes before gRPC has
seen the socket close. The relay's read then raises ``asyncio.CancelledError``, and a handler ended by it leaves
the peer's call open with nothing to read: a killed tensor-group leader's stream ended only at the peer's 10 s
idle limit. The peer must get an error chunk at once, and a peer that goes away must still stop the runner's
generation."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc

from exo.cluster.node import relay_generation
from exo.wire.proto_gen import node_pb2 as pb
from exo.wire.proto_gen import node_pb2_grpc as pb_grpc

HOST = "127.0.0.1"


class Runner(pb_grpc.RunnerServicer):
    """Streams a heartbeat every 20 ms until its caller cancels."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()

    async def Generate(self, request, context):  # noqa: ANN001, ANN201, N802
        try:
            while True:
                yield pb.GenerateChunk(heartbeat=True)
                await asyncio.sleep(0.02)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


class Relay(pb_grpc.NodeServicer):
    def __init__(self, runner_channel: grpc.aio.Channel) -> None:
        self.channel = runner_channel

    async def Generate(self, request, context):  # noqa: ANN001, ANN201, N802 - as NodeServicer.Generate relays
        call = pb_grpc.RunnerStub(self.channel).Generate(request)
        async with contextlib.aclosing(relay_generation(call, request.model, context)) as chunks:
            async for chunk in chunks:
                yield chunk


async def _servers() -> tuple[Runner, grpc.aio.Server, grpc.aio.Channel, grpc.aio.Server, grpc.aio.Channel]:
    runner = Runner()
    runner_server = grpc.aio.server()
    pb_grpc.add_RunnerServicer_to_server(runner, runner_server)
    runner_port = runner_server.add_insecure_port(f"{HOST}:0")
    await runner_server.start()
    runner_channel = grpc.aio.insecure_channel(f"{HOST}:{runner_port}")
    relay_server = grpc.aio.server()
    pb_grpc.add_NodeServicer_to_server(Relay(runner_channel), relay_server)
    relay_port = relay_server.add_insecure_port(f"{HOST}:0")
    await relay_server.start()
    return runner, runner_server, runner_channel, relay_server, grpc.aio.insecure_channel(f"{HOST}:{relay_port}")


def test_a_runner_channel_closed_under_the_call_is_an_error_chunk_at_once_not_a_hang():
    async def main() -> None:
        _, runner_server, runner_channel, relay_server, peer_channel = await _servers()
        try:
            call = pb_grpc.NodeStub(peer_channel).Generate(pb.GenerateRequest(model="m"))
            assert (await call.read()).heartbeat  # the stream runs
            await runner_channel.close(grace=None)  # what the supervisor does once the runner's process ended
            closed = time.monotonic()
            async with asyncio.timeout(5):
                msg = await call.read()
                while msg is not grpc.aio.EOF and msg.heartbeat:  # those already in flight
                    msg = await call.read()
            assert msg is not grpc.aio.EOF and msg.HasField("error"), msg
            assert msg.error.type == "model_unavailable" and "went away" in msg.error.message, msg.error
            assert time.monotonic() - closed < 1.0
            assert await call.read() is grpc.aio.EOF
        finally:
            await peer_channel.close()
            await relay_server.stop(None)
            await runner_server.stop(None)

    asyncio.run(main())


def test_a_peer_that_goes_away_still_cancels_the_runner_s_generation():
    async def main() -> None:
        runner, runner_server, runner_channel, relay_server, peer_channel = await _servers()
        try:
            call = pb_grpc.NodeStub(peer_channel).Generate(pb.GenerateRequest(model="m"))
            assert (await call.read()).heartbeat
            call.cancel()
            await asyncio.wait_for(runner.cancelled.wait(), 5)
        finally:
            await peer_channel.close()
            await runner_channel.close()
            await relay_server.stop(None)
            await runner_server.stop(None)

    asyncio.run(main())
