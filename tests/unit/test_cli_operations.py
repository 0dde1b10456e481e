"""The operations flags (issue 15): each works as documented or stops start-up with exit 2
and a message naming it; none is accepted and ignored."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.cli import parse_settings

STATIC = ["--static-endpoints", "127.0.0.2:8000"]
POOL = ["--pool-name", "pool"]


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        parse_settings(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err


def test_defaults_follow_the_reference() -> None:
    settings = parse_settings(POOL)
    assert settings.metrics_endpoint_auth is True
    assert settings.enable_pprof is True
    assert settings.ha_enable_leader_election is False
    assert settings.enable_cert_reload is False
    assert settings.watch_config_file is False
    assert settings.tls_min_version == "VersionTLS12"


def test_static_mode_refuses_metrics_auth_until_it_is_turned_off(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = _refused(STATIC, capsys)
    assert "--metrics-endpoint-auth" in err
    assert "--metrics-endpoint-auth=false" in err
    assert parse_settings([*STATIC, "--metrics-endpoint-auth=false"]).metrics_endpoint_auth is False


@pytest.mark.parametrize(
    ("argv", "flag", "why"),
    [
        (
            [*STATIC, "--metrics-endpoint-auth=false", "--ha-enable-leader-election"],
            "--ha-enable-leader-election",
            "Kubernetes API",
        ),
        ([*POOL, "--enable-cert-reload"], "--enable-cert-reload", "--cert-path"),
        (
            [*POOL, "--enable-cert-reload", "--secure-serving=false"],
            "--enable-cert-reload",
            "--secure-serving",
        ),
        ([*POOL, "--watch-config-file"], "--watch-config-file", "--config-file"),
        ([*POOL, "--tls-min-version", "VersionTLS13"], "--tls-min-version", "TLS 1.3"),
        ([*POOL, "--tls-min-version", "VersionTLS11"], "--tls-min-version", "TLS 1.2"),
        ([*POOL, "--tls-cipher-suites", "TLS_RSA_WITH_RC4_128_SHA"], "--tls-cipher-suites", ""),
        (
            [*POOL, "--secure-serving=false", "--tls-cipher-suites", "x"],
            "--tls-cipher-suites",
            "",
        ),
        ([*POOL, "--grpc-max-recv-msg-size", "10"], "--grpc-max-recv-msg-size", "1Ki"),
        ([*POOL, "--grpc-max-send-msg-size", "4Gi"], "--grpc-max-send-msg-size", "2Gi"),
        ([*POOL, "--metrics-client-ca-file", "/etc/hostname"], "--metrics-client-ca-file", ""),
        ([*POOL, "--grpc-client-ca-file", "/nonexistent/ca.crt"], "--grpc-client-ca-file", "No "),
        ([*POOL, "--grpc-client-ca-file", "/etc/hostname"], "--grpc-client-ca-file", "no PEM"),
        (
            [*POOL, "--secure-serving=false", "--grpc-client-ca-file", "/etc/hostname"],
            "--grpc-client-ca-file",
            "needs --secure-serving",
        ),
    ],
)
def test_a_flag_that_cannot_work_is_refused_by_name(
    argv: list[str], flag: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _refused(argv, capsys)
    assert err.startswith(f"epp: {flag}")
    assert why in err


def test_metrics_tls_needs_the_pair(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "tls.crt").write_text("x")
    err = _refused([*POOL, "--metrics-cert-dir", str(tmp_path)], capsys)
    assert "--metrics-cert-dir" in err
    assert "tls.key" in err


def test_sizes_and_suites_parse() -> None:
    settings = parse_settings(
        [
            *POOL,
            "--grpc-max-recv-msg-size",
            "8Mi",
            "--grpc-max-send-msg-size=1048576",
            "--tls-cipher-suites",
            "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384",
        ]
    )
    assert settings.grpc_max_recv_msg_size == 8 << 20
    assert settings.grpc_max_send_msg_size == 1 << 20
    assert settings.tls_cipher_suites == (
        "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256",
        "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384",
    )
