"""``ConnectionDispatcher`` on real sockets: the supervisor's side of handing ext_proc
connections to workers, and ``H2GrpcServer.start_handed``, the worker's side."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from adapters.envoy.h2 import H2GrpcServer, MethodHandler
from adapters.envoy.health import HealthServicer
from adapters.workerlink import ConnectionDispatcher
from adapters.workerlink.hub import HandedConnections

DEADLINE = 10.0


def _listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock


class _Worker:
    """The worker's end of a handoff pair, read by hand."""

    def __init__(self, end: socket.socket) -> None:
        end.setblocking(False)
        self.end = end

    async def take(self) -> socket.socket:
        async with asyncio.timeout(DEADLINE):
            while True:
                try:
                    _, fds, _, _ = socket.recv_fds(self.end, 16, 4)
                except BlockingIOError:
                    await asyncio.sleep(0.005)
                    continue
                assert len(fds) == 1
                return socket.socket(fileno=fds[0])
        raise AssertionError("unreachable")  # pragma: no cover

    def has_none(self) -> bool:
        try:
            self.end.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return True
        return False


@contextlib.asynccontextmanager
async def _dispatching(
    ready: set[int],
    workers: int,
    reports: dict[int, HandedConnections] | None = None,
) -> AsyncIterator[tuple[ConnectionDispatcher, int, list[_Worker]]]:
    listener = _listener()
    dispatcher = ConnectionDispatcher(
        listener, lambda w: w in ready, None if reports is None else reports.get
    )
    ends = [_Worker(dispatcher.attach(w)) for w in range(workers)]
    task = asyncio.create_task(dispatcher.run())
    try:
        yield dispatcher, listener.getsockname()[1], ends
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        listener.close()
        for end in ends:
            end.end.close()


async def _connect(port: int) -> socket.socket:
    client = socket.socket()
    client.setblocking(False)
    await asyncio.get_running_loop().sock_connect(client, ("127.0.0.1", port))
    return client


async def _roundtrip(client: socket.socket, handed: socket.socket) -> None:
    """The client's bytes arrive on the socket the worker was handed."""
    loop = asyncio.get_running_loop()
    handed.setblocking(False)
    await loop.sock_sendall(client, b"ping")
    async with asyncio.timeout(DEADLINE):
        assert await loop.sock_recv(handed, 4) == b"ping"


async def test_connections_go_to_the_ready_workers_in_turn() -> None:
    async with _dispatching({0, 1, 2}, 3) as (dispatcher, port, workers):
        order = []
        for _ in range(6):
            client = await _connect(port)
            worker_id, handed = await _first_taken(workers)
            await _roundtrip(client, handed)
            order.append(worker_id)
            client.close()
            handed.close()
        assert order == [0, 1, 2, 0, 1, 2]
        assert dispatcher.handed == {0: 2, 1: 2, 2: 2}


async def _first_taken(workers: list[_Worker]) -> tuple[int, socket.socket]:
    async with asyncio.timeout(DEADLINE):
        while True:
            for i, worker in enumerate(workers):
                if not worker.has_none():
                    return i, await worker.take()
            await asyncio.sleep(0.005)
    raise AssertionError("unreachable")  # pragma: no cover


async def test_a_worker_not_ready_or_gone_is_passed_over() -> None:
    ready = {0, 1, 2}
    async with _dispatching(ready, 3) as (dispatcher, port, workers):
        ready.discard(1)  # not ready: no connection for it
        workers[2].end.close()  # its process exited before the supervisor detached it
        clients = [await _connect(port) for _ in range(3)]
        for client in clients:
            await _roundtrip(client, await workers[0].take())
        assert workers[1].has_none()
        assert dispatcher.handed == {0: 3}
        for client in clients:
            client.close()


class _Readiness(set[int]):
    """A set of ready workers that counts how often the dispatcher asked."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = 0
        self.was_asked = asyncio.Event()

    def __contains__(self, worker_id: object) -> bool:
        self.asked += 1
        self.was_asked.set()
        return super().__contains__(worker_id)


async def test_while_no_worker_is_ready_connections_wait_in_the_backlog() -> None:
    ready = _Readiness()
    async with _dispatching(ready, 2) as (dispatcher, port, workers):
        client = await _connect(port)  # the kernel completes it; nobody accepts it yet
        asked = ready.asked
        async with asyncio.timeout(DEADLINE):
            while ready.asked < asked + 6:  # three more of the dispatcher's looks
                ready.was_asked.clear()
                await ready.was_asked.wait()
        assert workers[0].has_none()
        assert workers[1].has_none()
        assert dispatcher.handed == {}
        ready.add(1)
        await _roundtrip(client, await workers[1].take())
        assert dispatcher.handed == {1: 1}
        client.close()


def _health_server() -> H2GrpcServer:
    servicer = HealthServicer(lambda: True)
    handlers = {
        "/grpc.health.v1.Health/Check": MethodHandler(
            servicer.Check,
            health_pb2.HealthCheckRequest.FromString,
            lambda m: bytes(m.SerializeToString()),
            streaming=False,
        )
    }
    return H2GrpcServer(handlers)


async def test_a_worker_serves_grpc_on_the_connections_it_is_handed() -> None:
    server = _health_server()
    async with _dispatching({0}, 0) as (dispatcher, port, _):
        server.start_handed(dispatcher.attach(0))
        # ready is {0}: the attach above makes it the only worker
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="readiness"), timeout=DEADLINE
            )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert dispatcher.handed == {0: 1}

        await server.stop(1.0)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="readiness"), timeout=2
                )
        # its end was closed with the server: the dispatcher found no one to take it
        assert refused.value.code() in {
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
        }


async def test_a_connection_goes_to_the_worker_with_the_fewest_connections_taking_streams() -> None:
    reports = {
        0: HandedConnections(received=3, accepting=2, calls=10),
        1: HandedConnections(received=3, accepting=1, calls=900),  # one is going away
        2: HandedConnections(received=3, accepting=2, calls=0),
    }
    async with _dispatching({0, 1, 2}, 3, reports) as (dispatcher, port, workers):
        client = await _connect(port)
        await _roundtrip(client, await workers[1].take())
        assert dispatcher.handed == {1: 1}
        client.close()


async def test_connections_handed_and_not_yet_taken_count_as_the_workers() -> None:
    # A burst the workers report nothing of yet: worker 0, which started fewer calls, would
    # get them all if the connections handed to it did not count until it reports them.
    reports = {0: HandedConnections(), 1: HandedConnections(received=1, calls=100)}
    async with _dispatching({0, 1}, 2, reports) as (dispatcher, port, workers):
        clients = [await _connect(port) for _ in range(4)]
        taken = [await _first_taken(workers) for _ in range(4)]
        assert sorted(worker_id for worker_id, _ in taken) == [0, 0, 1, 1]
        assert dispatcher.handed == {0: 2, 1: 2}
        for sock in [*clients, *(handed for _, handed in taken)]:
            sock.close()


def test_among_equals_the_worker_with_fewer_recent_calls_goes_first() -> None:
    now = [100.0]
    reports = {
        0: HandedConnections(received=5, accepting=0, calls=400),
        1: HandedConnections(received=5, accepting=0, calls=300),
    }
    with _listener() as listener:
        dispatcher = ConnectionDispatcher(
            listener, lambda w: True, reports.get, clock=lambda: now[0]
        )
        ends = [dispatcher.attach(w) for w in (0, 1)]
        assert dispatcher.order() == [1, 0]
        # A minute on, worker 1 started 200 calls more and worker 0 none: the old calls
        # weigh e^-6 of what they did, so worker 0 is the one behind now.
        now[0] += 60.0
        reports[1] = HandedConnections(received=6, accepting=0, calls=500)
        assert dispatcher.order() == [0, 1]
        # A worker started again (attached anew, its count from zero) goes first.
        now[0] += 1.0
        reports[1] = HandedConnections(received=0, accepting=0, calls=0)
        ends.append(dispatcher.attach(1))
        assert dispatcher.order() == [1, 0]
        for end in ends:
            end.close()


async def test_a_worker_counts_the_connections_it_takes_and_the_calls_it_starts() -> None:
    server = _health_server()
    async with _dispatching({0}, 0) as (dispatcher, port, _):
        server.start_handed(dispatcher.attach(0))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for _ in range(3):
                await stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=5)
            assert (server.handed_received, server.calls_started) == (1, 3)
            assert server.accepting_connections() == 1
            for connection in server.connections:
                connection.go_away()  # what the connection age does
            assert server.accepting_connections() == 0
        await server.stop(1.0)
