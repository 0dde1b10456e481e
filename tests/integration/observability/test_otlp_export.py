"""The OTLP exporters against real trace receivers (gRPC, and HTTP with binary protobuf):
what arrives, with which headers, over TLS, and how a collector that is down is reported."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from adapters.envoy.tls import self_signed_certificate
from adapters.otel.tracing import OtelTracing
from tests.integration.observability.otlp_http_receiver import OtlpHttpReceiver
from tests.integration.observability.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.support.stack import free_port

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver().start()
    yield receiver
    receiver.stop()


def _otlp(endpoint: str, **extra: str) -> dict[str, str]:
    return {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_TRACES_SAMPLER_ARG": "1",
        **extra,
    }


def _arrived(receiver: OtlpReceiver, count: int) -> dict[str, ReceivedSpan]:
    spans = receiver.wait_for(lambda s: len(s) >= count, timeout=10, what=f"{count} spans")
    return {s.name: s for s in spans}


def test_spans_arrive_with_their_ids_attributes_and_status(receiver: OtlpReceiver) -> None:
    tracing = OtelTracing(_otlp(receiver.endpoint, OTEL_SERVICE_NAME="epp-test"))
    carrier = {"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01", "tracestate": "vendor=x"}
    root = tracing.start_span("gateway.request", carrier=carrier)
    child = tracing.start_span("gateway.scheduling", parent=root, attributes={"profile": "p"})
    child.set_attribute("candidates", 3)
    child.set_attribute("score", 0.5)
    child.set_attribute("cached", True)
    child.record_error("no endpoint")
    child.end()
    root.end()
    assert tracing.force_flush()
    spans = _arrived(receiver, 2)
    tracing.shutdown()

    server, internal = spans["gateway.request"], spans["gateway.scheduling"]
    assert server.trace_id == internal.trace_id == TRACE_ID
    assert server.parent_span_id == CALLER_SPAN
    assert internal.parent_span_id == server.span_id
    assert (server.kind, internal.kind) == (2, 1)  # SERVER, INTERNAL
    assert server.trace_state == internal.trace_state == "vendor=x"
    assert server.flags == 0x301  # sampled, with a remote parent
    assert internal.flags == 0x101  # sampled, local parent
    assert internal.attributes == {"profile": "p", "candidates": 3, "score": 0.5, "cached": True}
    assert (internal.status_code, internal.status_message) == (2, "no endpoint")
    assert server.status_code == 0
    assert server.service_name == "epp-test"
    assert server.start_ns <= internal.start_ns <= internal.end_ns <= server.end_ns


def test_headers_and_gzip_reach_the_collector(receiver: OtlpReceiver) -> None:
    env = _otlp(
        receiver.endpoint,
        OTEL_EXPORTER_OTLP_HEADERS="x-api-key=s%20cret, Tenant=a",
        OTEL_EXPORTER_OTLP_COMPRESSION="gzip",
    )
    tracing = OtelTracing(env)
    tracing.start_span("gateway.request").end()
    assert tracing.force_flush()
    _arrived(receiver, 1)
    tracing.shutdown()
    (metadata,) = receiver.metadata
    assert metadata["x-api-key"] == "s cret"
    assert metadata["tenant"] == "a"


def test_tls_to_a_collector_with_the_configured_ca(tmp_path: Path) -> None:
    certificate = self_signed_certificate("collector")
    ca = tmp_path / "ca.pem"
    ca.write_bytes(certificate.certificate_pem)
    receiver = OtlpReceiver(certificate=certificate).start()
    try:
        assert receiver.endpoint.startswith("https://")
        tracing = OtelTracing(_otlp(receiver.endpoint, OTEL_EXPORTER_OTLP_CERTIFICATE=str(ca)))
        tracing.start_span("gateway.request").end()
        assert tracing.force_flush()
        assert list(_arrived(receiver, 1)) == ["gateway.request"]
        tracing.shutdown()
    finally:
        receiver.stop()


def test_a_collector_that_is_down_is_logged_once_and_its_recovery_too(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = free_port()
    env = _otlp(f"http://127.0.0.1:{port}", OTEL_EXPORTER_OTLP_TIMEOUT="300")
    tracing = OtelTracing(env)
    with caplog.at_level(logging.INFO, logger="adapters.otel.export"):
        for _ in range(2):
            tracing.start_span("lost").end()
            assert tracing.force_flush()  # the export gave up: nothing left queued
        failed = [r for r in caplog.records if "failed" in r.getMessage()]
        assert len(failed) == 1
        assert f"127.0.0.1:{port}" in failed[0].getMessage()

        receiver = OtlpReceiver(port=port).start()
        try:
            # The channel reconnects on its own backoff: export until an export succeeds
            # (a span can reach the collector in an export that still times out).
            deadline = time.monotonic() + 20
            while not any("recovered" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, "no export to the restarted collector"
                tracing.start_span("delivered").end()
                tracing.force_flush()
            assert {s.name for s in receiver.spans()} == {"delivered"}
        finally:
            tracing.shutdown()
            receiver.stop()
    assert any("recovered" in r.getMessage() for r in caplog.records)


# OTLP over HTTP with binary protobuf (OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf)


def _http(**extra: str) -> dict[str, str]:
    return {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_TRACES_SAMPLER_ARG": "1",
        **extra,
    }


def test_http_protobuf_posts_to_v1_traces_under_the_base_endpoint() -> None:
    receiver = OtlpHttpReceiver().start()
    try:
        env = _http(
            OTEL_EXPORTER_OTLP_ENDPOINT=receiver.base + "/",
            OTEL_EXPORTER_OTLP_HEADERS="x-api-key=k",
            OTEL_EXPORTER_OTLP_COMPRESSION="gzip",
        )
        tracing = OtelTracing(env)
        assert tracing.describe()["exporter"] == f"otlp http/protobuf to {receiver.base}/v1/traces"
        root = tracing.start_span("gateway.request")
        tracing.start_span("gateway.scheduling", parent=root).end()
        root.end()
        assert tracing.force_flush()
        assert sorted(receiver.wait_for(2, timeout=10)) == ["gateway.request", "gateway.scheduling"]
        tracing.shutdown()
    finally:
        receiver.stop()
    assert receiver.paths == ["/v1/traces"]
    (headers,) = receiver.headers
    assert headers["x-api-key"] == "k"
    assert headers["content-type"] == "application/x-protobuf"
    assert headers["content-encoding"] == "gzip"


def test_http_protobuf_retries_a_busy_collector_and_uses_a_traces_endpoint_as_given(
    tmp_path: Path,
) -> None:
    certificate = self_signed_certificate("collector")
    ca = tmp_path / "ca.pem"
    ca.write_bytes(certificate.certificate_pem)
    receiver = OtlpHttpReceiver(certificate=certificate).start()
    receiver.fail_next = 2  # 503 twice, then accepted (backoff 0.5 s, then 1 s)
    try:
        env = _http(
            OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=receiver.base + "/custom/traces",
            OTEL_EXPORTER_OTLP_CERTIFICATE=str(ca),
        )
        tracing = OtelTracing(env)
        tracing.start_span("gateway.request").end()
        assert tracing.force_flush()
        assert receiver.wait_for(1, timeout=10) == ["gateway.request"]
        tracing.shutdown()
    finally:
        receiver.stop()
    assert receiver.refused == 2
    assert receiver.paths == ["/custom/traces"] * 3


def test_http_protobuf_to_a_collector_that_is_down_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    env = _http(
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{free_port()}",
        OTEL_EXPORTER_OTLP_TIMEOUT="300",
    )
    tracing = OtelTracing(env)
    with caplog.at_level(logging.WARNING, logger="adapters.otel.export"):
        for _ in range(2):
            tracing.start_span("lost").end()
            assert tracing.force_flush()
    tracing.shutdown()
    (failed,) = [r for r in caplog.records if "failed" in r.getMessage()]
    assert "/v1/traces" in failed.getMessage()
