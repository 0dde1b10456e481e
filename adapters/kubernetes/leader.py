"""``--ha-enable-leader-election``: active-passive replicas on a coordination.k8s.io Lease.

The same protocol as client-go's leader election, so the timings an operator knows apply:
every ``retry_period`` a candidate reads the Lease. It takes the Lease when nobody holds it,
when it was released (empty holder), or when the holder has not renewed it for
``lease_duration`` *as observed by this candidate* (the local clock measures how long the
record stayed unchanged, so clock skew between nodes does not matter). The leader renews
every ``retry_period``. Writes carry the Lease's resourceVersion, so two candidates racing
for it cannot both win: the loser gets a 409 Conflict and stays a follower.

The leader stops being leader at once when the Lease names another holder, and after
``renew_deadline`` without a successful renewal (API server unreachable); either way only
readiness changes: the streams in flight finish. On ``run``'s cancellation (SIGTERM) a
leader releases the Lease (empty holder, duration 1 s), so a follower takes over within one
``retry_period`` instead of waiting a whole ``lease_duration``.

The API calls block (the ``kubernetes`` client is synchronous): they run in worker threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import time
from typing import Any

from kubernetes.client import ApiClient, CoordinationV1Api, V1Lease, V1LeaseSpec, V1ObjectMeta
from kubernetes.client.exceptions import ApiException

__all__ = ["LEASE_DURATION", "RENEW_DEADLINE", "RETRY_PERIOD", "LeaderElector"]

logger = logging.getLogger(__name__)

#: client-go's and controller-runtime's defaults, which the reference EPP runs with.
LEASE_DURATION = 15.0
RENEW_DEADLINE = 10.0
RETRY_PERIOD = 2.0


def _now() -> datetime.datetime:
    """Now, for a MicroTime field. The client writes it with ``isoformat()``, which drops
    the fraction when it is zero, and the API server parses MicroTime with exactly six
    fractional digits: a zero fraction is nudged to one microsecond."""
    now = datetime.datetime.now(datetime.UTC)
    return now if now.microsecond else now.replace(microsecond=1)


class LeaderElector:
    """Holds or waits for the Lease ``namespace/name`` as ``identity``; see the module
    docstring. ``is_leader`` is read by readiness; ``run`` campaigns until cancelled."""

    def __init__(
        self,
        api_client: ApiClient,
        *,
        namespace: str,
        name: str,
        identity: str,
        lease_duration: float = LEASE_DURATION,
        renew_deadline: float = RENEW_DEADLINE,
        retry_period: float = RETRY_PERIOD,
    ) -> None:
        if not retry_period < renew_deadline < lease_duration:
            raise ValueError("need retry period < renew deadline < lease duration")
        self._api = CoordinationV1Api(api_client)
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self._lease_duration = lease_duration
        self._renew_deadline = renew_deadline
        self._retry_period = retry_period
        self._timeout = (retry_period, retry_period)
        self._observed: tuple[Any, ...] | None = None
        self._observed_at = 0.0
        self._renewed_at = 0.0
        self._leader = False
        self._failing = False
        self.transitions = 0  # times this process became leader

    @property
    def is_leader(self) -> bool:
        return self._leader

    def leader(self) -> bool:
        """``is_leader`` as a callable, for readiness."""
        return self._leader

    async def run(self) -> None:
        logger.info(
            "leader election: campaigning for Lease %s/%s as %s",
            self.namespace,
            self.name,
            self.identity,
        )
        try:
            while True:
                await self._round()
                await asyncio.sleep(self._retry_period)
        except asyncio.CancelledError:
            if self._leader:
                self._set_leader(False, "shutting down; Lease released")
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.to_thread(self._release), self._retry_period)
            raise

    async def _round(self) -> None:
        try:
            held = await asyncio.to_thread(self._try_acquire_or_renew)
        except Exception as exc:  # the API server is unreachable or refuses
            if not self._failing:
                self._failing = True
                logger.warning("leader election: cannot reach the Lease: %s", exc)
            held = None
        else:
            if self._failing:
                self._failing = False
                logger.info("leader election: the Lease is reachable again")
        now = time.monotonic()
        if held:
            self._renewed_at = now
            if not self._leader:
                self.transitions += 1
                self._set_leader(True, "acquired the Lease; reporting ready")
        elif self._leader:
            if held is False:
                self._set_leader(False, "the Lease has another holder; not ready")
            elif now - self._renewed_at > self._renew_deadline:
                self._set_leader(False, f"not renewed for {self._renew_deadline:g}s; not ready")

    def _set_leader(self, leader: bool, why: str) -> None:
        self._leader = leader
        logger.info("leader election: %s (Lease %s/%s)", why, self.namespace, self.name)

    def _try_acquire_or_renew(self) -> bool:
        """True when this process holds the Lease after the call (blocking)."""
        try:
            lease: Any = self._api.read_namespaced_lease(
                self.name, self.namespace, _request_timeout=self._timeout
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            return self._create()
        spec = lease.spec or V1LeaseSpec()
        record = (spec.holder_identity, spec.renew_time, spec.lease_duration_seconds)
        now = time.monotonic()
        if record != self._observed:
            self._observed, self._observed_at = record, now
        holder = spec.holder_identity
        duration = spec.lease_duration_seconds or self._lease_duration
        if holder and holder != self.identity and now < self._observed_at + duration:
            return False
        stamp = _now()
        if holder != self.identity:
            spec.acquire_time = stamp
            spec.lease_transitions = (spec.lease_transitions or 0) + 1
        spec.holder_identity = self.identity
        spec.lease_duration_seconds = round(self._lease_duration)
        spec.renew_time = stamp
        lease.spec = spec
        try:
            self._api.replace_namespaced_lease(
                self.name, self.namespace, lease, _request_timeout=self._timeout
            )
        except ApiException as exc:
            if exc.status == 409:  # another candidate wrote first
                return False
            raise
        self._observed = (self.identity, stamp, spec.lease_duration_seconds)
        return True

    def _create(self) -> bool:
        stamp = _now()
        lease = V1Lease(
            metadata=V1ObjectMeta(name=self.name, namespace=self.namespace),
            spec=V1LeaseSpec(
                holder_identity=self.identity,
                lease_duration_seconds=round(self._lease_duration),
                acquire_time=stamp,
                renew_time=stamp,
                lease_transitions=0,
            ),
        )
        try:
            self._api.create_namespaced_lease(self.namespace, lease, _request_timeout=self._timeout)
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return True

    def _release(self) -> None:
        lease: Any = self._api.read_namespaced_lease(
            self.name, self.namespace, _request_timeout=self._timeout
        )
        if lease.spec is None or lease.spec.holder_identity != self.identity:
            return
        stamp = _now()
        lease.spec.holder_identity = ""
        lease.spec.lease_duration_seconds = 1
        lease.spec.renew_time = stamp
        lease.spec.acquire_time = stamp
        self._api.replace_namespaced_lease(
            self.name, self.namespace, lease, _request_timeout=self._timeout
        )
