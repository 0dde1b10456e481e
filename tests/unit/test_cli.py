"""The ``epp`` command line: reference-compatible flags, defaults and errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from app.cli import parse_settings
from app.durations import parse_duration

STATIC = [
    "--static-endpoints",
    "127.0.0.2:8000,127.0.0.3:8000",
    "--metrics-endpoint-auth=false",  # static mode has no Kubernetes API to review tokens
]


def test_defaults_match_the_reference() -> None:
    settings = parse_settings(STATIC)
    assert settings.grpc_port == 9002
    assert settings.grpc_health_port == 9003
    assert settings.metrics_port == 9090
    assert settings.secure_serving is True
    assert settings.cert_path is None
    assert settings.refresh_metrics_interval == pytest.approx(0.05)
    assert settings.refresh_prometheus_metrics_interval == pytest.approx(5.0)
    assert settings.metrics_staleness_threshold == pytest.approx(2.0)
    assert settings.log_format == "text"
    assert settings.tracing is True
    assert settings.disable_endpoint_subset_filter is False


def test_stream_limit_flags() -> None:
    defaults = parse_settings(STATIC)
    assert defaults.max_streams_per_connection == 100  # the shipped Envoy config's too
    assert defaults.max_unrouted_streams == 1000
    assert defaults.protocol_error_pause == pytest.approx(1.0)
    settings = parse_settings(
        [
            *STATIC,
            "--max-streams-per-connection",
            "0",
            "--max-unrouted-streams=50",
            "--protocol-error-pause=250ms",
        ]
    )
    assert settings.max_streams_per_connection == 0
    assert settings.max_unrouted_streams == 50
    assert settings.protocol_error_pause == pytest.approx(0.25)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--secure-serving"], True),
        (["--secure-serving=true"], True),
        (["--secure-serving=false"], False),
        (["--secure-serving=False"], False),
        (["--secure-serving", "false"], False),
        (["--secure-serving=0"], False),
    ],
)
def test_boolean_flags_accept_go_forms(argv: list[str], expected: bool) -> None:
    assert parse_settings([*STATIC, *argv]).secure_serving is expected


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("50ms", 0.05),
        ("2s", 2.0),
        ("1m30s", 90.0),
        ("1.5h", 5400.0),
        ("250us", 0.00025),
        ("1h2m3s4ms", 3723.004),
        ("0", 0.0),
        (".5s", 0.5),
    ],
)
def test_go_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "5", "5 s", "s", "1x", "-1s", "1m30", "ms50"])
def test_bad_durations_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


def test_durations_and_verbosity_flags() -> None:
    settings = parse_settings(
        [
            *STATIC,
            "--refresh-metrics-interval",
            "100ms",
            "--metrics-staleness-threshold=1m",
            "-v",
            "4",
        ]
    )
    assert settings.refresh_metrics_interval == pytest.approx(0.1)
    assert settings.metrics_staleness_threshold == pytest.approx(60.0)
    assert settings.verbosity == 4
    assert parse_settings([*STATIC, "--v=2"]).verbosity == 2


def test_pool_namespace_falls_back_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NAMESPACE", "inference")
    assert parse_settings(STATIC).pool_namespace == "inference"
    monkeypatch.delenv("NAMESPACE")
    assert parse_settings(STATIC).pool_namespace == "default"
    assert parse_settings([*STATIC, "--pool-namespace", "x"]).pool_namespace == "x"


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--grpc-port", "http"], "--grpc-port"),
        (["--grpc-port", "70000"], "--grpc-port"),
        (["--secure-serving=maybe"], "--secure-serving"),
        (["--refresh-metrics-interval", "fast"], "--refresh-metrics-interval"),
        (["--refresh-metrics-interval", "0s"], "--refresh-metrics-interval"),
        (["--metrics-staleness-threshold", "10"], "--metrics-staleness-threshold"),
        (["--log-format", "xml"], "--log-format"),
        (["--no-such-flag"], "--no-such-flag"),
        (["--config-file", "a.yaml", "--config-text", "x"], "--config-text"),
        (["--config-file", "/nonexistent/epp.yaml"], "--config-file"),
        (["--cert-path", "/nonexistent"], "--cert-path"),
        (["-v", "loud"], "-v"),
        (["--max-streams-per-connection", "-1"], "--max-streams-per-connection"),
        (["--max-unrouted-streams", "many"], "--max-unrouted-streams"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_settings([*STATIC, *argv])
    assert exited.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "--static-endpoints"),
        (["--static-endpoints", "127.0.0.2"], "--static-endpoints"),
        (["--static-endpoints", "127.0.0.2:0"], "--static-endpoints"),
        (["--static-endpoints", "a:1,a:1"], "--static-endpoints"),
        ([*STATIC, "--pool-name", "pool"], "--pool-name"),
    ],
)
def test_endpoint_source_flags(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_settings(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_ipv6_static_endpoints() -> None:
    settings = parse_settings(
        ["--static-endpoints", "[::1]:8000,127.0.0.2:8001", "--metrics-endpoint-auth=0"]
    )
    assert settings.static_endpoints == "[::1]:8000,127.0.0.2:8001"


def test_console_script_and_module_share_the_cli(tmp_path: Path) -> None:
    epp = Path(sys.executable).parent / "epp"
    for argv in ([str(epp)], [sys.executable, "-m", "app"]):
        result = subprocess.run(
            [*argv, "--grpc-port", "nope"], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 2
        assert "--grpc-port" in result.stderr
        helped = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=60)
        assert helped.returncode == 0
        assert "--static-endpoints" in helped.stdout


@pytest.mark.parametrize(
    "argv",
    [
        ["--pool-name", "pool"],
        ["--endpoint-selector", "app=vllm", "--endpoint-target-ports", "8000,8001"],
    ],
)
def test_kubernetes_modes_need_no_static_endpoints(argv: list[str]) -> None:
    settings = parse_settings(argv)
    assert settings.static_endpoints == ""
    assert settings.pool_name or settings.endpoint_selector


def test_the_endpoint_selector_needs_target_ports(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_settings(["--endpoint-selector", "app=vllm"])
    assert exited.value.code == 2
    assert "--endpoint-target-ports" in capsys.readouterr().err


def test_shared_state_flags_default_to_in_process() -> None:
    settings = parse_settings(STATIC)
    assert settings.redis_url == ""
    assert settings.redis_deadline == pytest.approx(0.005)
    assert settings.redis_claim_deadline == pytest.approx(0.05)
    assert settings.redis_lease == pytest.approx(10.0)
    assert settings.redis_load_staleness == pytest.approx(0.02)
    assert settings.redis_prefix_ttl == pytest.approx(3600.0)
    assert settings.shared_key_prefix() == "epp:static"


def test_shared_state_flags() -> None:
    settings = parse_settings(
        [
            "--pool-name",
            "pool",
            "--pool-namespace",
            "ns",
            "--redis-url",
            "redis+cluster://10.0.0.1:6379,10.0.0.2",
            "--redis-deadline",
            "2ms",
            "--redis-claim-deadline",
            "40ms",
            "--redis-lease",
            "5s",
            "--redis-load-staleness=50ms",
            "--redis-prefix-ttl",
            "30m",
        ]
    )
    assert settings.redis_url == "redis+cluster://10.0.0.1:6379,10.0.0.2"
    assert settings.redis_deadline == pytest.approx(0.002)
    assert settings.redis_claim_deadline == pytest.approx(0.04)
    assert settings.redis_lease == pytest.approx(5.0)
    assert settings.redis_load_staleness == pytest.approx(0.05)
    assert settings.redis_prefix_ttl == pytest.approx(1800.0)
    assert settings.shared_key_prefix() == "epp:ns/pool"
    explicit = parse_settings([*STATIC, "--redis-key-prefix", "epp:blue"])
    assert explicit.shared_key_prefix() == "epp:blue"


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--redis-url", "http://127.0.0.1:6379"], "--redis-url"),
        (["--redis-url", "redis://127.0.0.1:notaport"], "--redis-url"),
        (["--redis-url", "127.0.0.1:6379"], "--redis-url"),
        (["--redis-deadline", "5"], "--redis-deadline"),
        (["--redis-deadline", "0"], "--redis-deadline"),
        (["--redis-claim-deadline", "0ms"], "--redis-claim-deadline"),
        (["--redis-lease", "soon"], "--redis-lease"),
        (["--redis-load-staleness", "-1s"], "--redis-load-staleness"),
        (["--redis-lease", "1s", "--redis-load-staleness", "2s"], "--redis-load-staleness"),
        (["--redis-prefix-ttl", "1d"], "--redis-prefix-ttl"),
        (["--redis-key-prefix", "epp:{x}"], "--redis-key-prefix"),
    ],
)
def test_bad_shared_state_flags_exit_2_naming_the_flag(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_settings([*STATIC, *argv])
    assert exited.value.code == 2
    assert capsys.readouterr().err.startswith(f"epp: {flag}")


def test_a_bad_redis_url_never_shows_its_password(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_settings([*STATIC, "--redis-url", "redis://u:s3cret@127.0.0.1:0"])
    err = capsys.readouterr().err
    assert "--redis-url" in err
    assert "s3cret" not in err
