"""``--watch-config-file``: the EndpointPickerConfig reloaded under traffic, from a file
swapped the way a ConfigMap volume swaps it (the ``..data`` symlink)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from app.container import Container, build_container
from app.runner import serve
from app.settings import Settings
from domain.requestcontrol.plugins.precise_prefix_producer import PrecisePrefixCacheProducer
from tests.simulator.kvevents import BlockStored, KVEventPublisher
from tests.support.extproc import completion, response_body, response_headers, set_headers
from tests.support.kube_api import wait_until
from tests.support.stack import free_port
from tests.support.tokenizer import write_tokenizer_json

from .test_extproc_protocol import EnvoyStream


def _config(profile: str, scorer: str = "queue-scorer") -> str:
    return f"""
plugins:
- type: {scorer}
- type: max-score-picker
schedulingProfiles:
- name: {profile}
  plugins:
  - pluginRef: {scorer}
  - pluginRef: max-score-picker
"""


class ConfigMapVolume:
    """A directory laid out as the kubelet lays out a ConfigMap volume: ``config.yaml`` ->
    ``..data/config.yaml``, ``..data`` -> ``..<version>``, swapped atomically by rename."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.version = 0
        self.path = root / "config.yaml"

    def publish(self, text: str) -> None:
        self.version += 1
        target = self.root / f"..v{self.version}"
        target.mkdir()
        (target / "config.yaml").write_text(text)
        link = self.root / "..data_tmp"
        link.symlink_to(target.name)
        os.replace(link, self.root / "..data")
        if not self.path.is_symlink():
            self.path.symlink_to("..data/config.yaml")


@contextlib.asynccontextmanager
async def _running(container: Container) -> AsyncIterator[None]:
    stop = asyncio.Event()
    task = asyncio.create_task(serve(container, stop))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def _request(channel: grpc.aio.Channel) -> str:
    """One whole request and response; the x-epp-decision header the EPP answered."""
    stream = EnvoyStream(channel)
    await stream.route(completion())
    await stream.send(response_headers([(":status", "200"), ("content-type", "text/plain")]))
    reply = await stream.read()
    await stream.send(response_body(b"ok", end_of_stream=True))
    await stream.read()
    await stream.finish()
    headers = dict(set_headers(reply.response_headers.response))
    return headers["x-epp-decision"]


async def test_a_reload_under_traffic_fails_no_request_and_takes_effect(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    volume = ConfigMapVolume(tmp_path)
    volume.publish(_config("alpha"))
    settings = Settings(
        static_endpoints="127.0.0.250:9,127.0.0.251:9",
        metrics_endpoint_auth=False,
        bind_address="127.0.0.1",
        grpc_port=0,
        grpc_health_port=0,
        metrics_port=0,
        secure_serving=False,
        config_file=volume.path,
        watch_config_file=True,
        explain_decisions=True,
        tracing=False,
    )
    container = build_container(settings)
    decisions: list[str] = []
    failures: list[BaseException] = []
    stop_traffic = asyncio.Event()

    async def client(channel: grpc.aio.Channel) -> None:
        while not stop_traffic.is_set():
            try:
                decisions.append(await _request(channel))
            except Exception as exc:  # any failed request fails the test below
                failures.append(exc)

    async def seen(profile: str, within: float = 10.0) -> None:
        deadline = time.monotonic() + within
        while not (decisions and decisions[-1].startswith(f"{profile}:")):
            assert not failures, failures[:3]
            assert time.monotonic() < deadline, f"no decision by {profile}: {decisions[-3:]}"
            await asyncio.sleep(0.02)

    async with _running(container):
        watcher = container.config_watcher()
        assert watcher is not None
        servers = container.servers()
        await wait_until(
            lambda: servers.bound_grpc_port > 0 and container.datastore().synced,
            what="the EPP to serve",
        )
        async with grpc.aio.insecure_channel(f"127.0.0.1:{servers.bound_grpc_port}") as channel:
            clients = [asyncio.create_task(client(channel)) for _ in range(4)]
            try:
                await seen("alpha")
                volume.publish(_config("beta"))  # the ConfigMap is updated
                await seen("beta")
                served = len(decisions)
                # a bad config: logged, the running one kept
                volume.publish(_config("beta").replace("queue-scorer\n", "no-such-scorer\n", 1))
                deadline = time.monotonic() + 10
                while watcher.refusals == 0:
                    assert time.monotonic() < deadline, "the bad config was not noticed"
                    await asyncio.sleep(0.02)
                await seen("beta")
                # a restart-only section changed: refused too
                volume.publish("featureGates: [flowControl]\n" + _config("gamma"))
                while watcher.refusals == 1:
                    assert time.monotonic() < deadline, "the gated config was not noticed"
                    await asyncio.sleep(0.02)
                decisions_after = len(decisions)
                await wait_until(
                    lambda: len(decisions) >= decisions_after + 20, what="more requests"
                )
            finally:
                stop_traffic.set()
                await asyncio.gather(*clients)
    assert failures == [], f"{len(failures)} of {len(decisions) + len(failures)} failed"
    assert len(decisions) > served
    assert all(d.startswith("beta:") for d in decisions[decisions_after:])
    assert watcher.reloads == 1
    assert "not reloaded, keeping the running one" in caplog.text
    assert "no-such-scorer" in caplog.text
    assert "featureGates: changed, which needs a restart" in caplog.text


async def test_reloads_leave_no_listeners_of_replaced_plugins_behind(tmp_path: Path) -> None:
    """The prefix producer and the in-flight load subscribe to endpoint changes; a hundred
    reloads must not leave a hundred generations of them subscribed."""
    path = tmp_path / "config.yaml"
    path.write_text(_config("alpha", "prefix-cache-scorer"))
    container = build_container(
        Settings(
            static_endpoints="127.0.0.250:9",
            metrics_endpoint_auth=False,
            config_file=path,
            watch_config_file=True,
            tracing=False,
        )
    )
    container.processor()
    watcher = container.config_watcher()
    assert watcher is not None
    datastore = container.datastore()
    listening = datastore.listener_count
    assert listening > 0
    for n in range(100):
        text = _config(f"p{n}", "prefix-cache-scorer")
        assert await watcher.offer(text)
        assert not await watcher.offer(text.replace("max-score", "no-such"))
    assert watcher.reloads == 100
    assert watcher.refusals == 100
    assert datastore.listener_count == listening


def _precise_config(tokenizer: Path, port: int, blocks: int) -> str:
    return f"""
plugins:
- type: precise-prefix-cache-producer
  parameters:
    tokenProcessorConfig: {{hashSeed: "1", tokenizerPath: "{tokenizer}"}}
    kvEventsConfig: {{socketPort: {port}}}
    maxPrefixBlocksToMatch: {blocks}
- type: prefix-cache-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins: [{{pluginRef: prefix-cache-scorer}}, {{pluginRef: max-score-picker}}]
"""


async def test_a_reload_stops_the_replaced_producers_event_subscriptions(tmp_path: Path) -> None:
    ip = "127.0.0.62"
    port = free_port(ip)
    publisher = KVEventPublisher(endpoint=f"tcp://{ip}:{port}")
    publisher.start()
    tokenizer = write_tokenizer_json(tmp_path / "tokenizer.json")
    volume = ConfigMapVolume(tmp_path / "volume")
    volume.root.mkdir()
    volume.publish(_precise_config(tokenizer, port, 100))
    settings = Settings(
        static_endpoints=f"{ip}:9",
        metrics_endpoint_auth=False,
        bind_address="127.0.0.1",
        grpc_port=0,
        grpc_health_port=0,
        metrics_port=0,
        secure_serving=False,
        config_file=volume.path,
        watch_config_file=True,
        tracing=False,
    )
    container = build_container(settings)
    endpoint = f"{ip}:9"

    def producer() -> PrecisePrefixCacheProducer:
        watcher = container.config_watcher()
        assert watcher is not None
        found = [
            p for p in watcher.running.plugins.values() if isinstance(p, PrecisePrefixCacheProducer)
        ]
        assert len(found) == 1
        return found[0]

    async def received(plugin: PrecisePrefixCacheProducer, block: int) -> None:
        deadline = time.monotonic() + 10
        while not plugin.index.match([block], [endpoint]):
            assert time.monotonic() < deadline, f"block {block} never arrived"
            publisher.publish([_stored(block)])  # until the subscriber is connected
            await asyncio.sleep(0.02)

    try:
        async with _running(container):
            old = producer()  # subscribed at start-up, before any request
            await received(old, 1)
            volume.publish(_precise_config(tokenizer, port, 200))
            watcher = container.config_watcher()
            assert watcher is not None
            await wait_until(lambda: watcher.reloads == 1, what="the reload")
            new = producer()
            assert new is not old
            await received(new, 2)
            # the replaced producer no longer follows the server
            assert old.index.match([2], [endpoint]) == {}
    finally:
        await publisher.stop()


def _stored(block: int) -> BlockStored:
    return BlockStored(
        block_hashes=[block],
        parent_block_hash=None,
        token_ids=[],
        block_size=16,
        lora_id=None,
        medium=None,
        lora_name=None,
    )
