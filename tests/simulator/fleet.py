"""A group of simulated instances on consecutive loopback addresses."""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import Self

from tests.simulator.config import SimulatorConfig
from tests.simulator.server import ModelServerSimulator
from tests.simulator.stats import EngineStats


class SimulatorFleet:
    """Starts ``instances`` simulators named ``<name_prefix>-<i>`` on ``base_ip + i``.

    Every instance shares ``config`` and listens on ``port`` (``0``: each picks a free one),
    except those ``overrides`` gives a configuration of their own (instance index ->
    config: a slower server, for instance). Use as ``async with SimulatorFleet(3, port=0)
    as fleet: ...``.
    """

    def __init__(
        self,
        instances: int = 1,
        *,
        config: SimulatorConfig | None = None,
        base_ip: str = "127.0.0.2",
        port: int = 8000,
        name_prefix: str = "sim",
        overrides: Mapping[int, SimulatorConfig] | None = None,
    ) -> None:
        if instances < 1:
            raise ValueError(f"instances must be >= 1, got {instances}")
        first = ipaddress.ip_address(base_ip)
        shared = config if config is not None else SimulatorConfig()
        own = overrides or {}
        self._instances = tuple(
            ModelServerSimulator(
                own.get(index, shared),
                name=f"{name_prefix}-{index}",
                host=str(first + index),
                port=port,
            )
            for index in range(instances)
        )

    @property
    def instances(self) -> tuple[ModelServerSimulator, ...]:
        return self._instances

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(instance.url for instance in self._instances)

    def stats(self) -> dict[str, EngineStats]:
        """Each instance's engine records, by instance name."""
        return {instance.name: instance.stats() for instance in self._instances}

    def by_name(self, name: str) -> ModelServerSimulator:
        for instance in self._instances:
            if instance.name == name:
                return instance
        raise KeyError(name)

    def __len__(self) -> int:
        return len(self._instances)

    def __iter__(self) -> Iterator[ModelServerSimulator]:
        return iter(self._instances)

    def __getitem__(self, index: int) -> ModelServerSimulator:
        return self._instances[index]

    async def start(self) -> None:
        """Start every instance; if one fails, the started ones are stopped again."""
        results = await asyncio.gather(
            *(instance.start() for instance in self._instances), return_exceptions=True
        )
        failures = [result for result in results if isinstance(result, BaseException)]
        if failures:
            await self.stop()
            raise failures[0]

    async def stop(self) -> None:
        await asyncio.gather(*(instance.stop() for instance in self._instances))

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
