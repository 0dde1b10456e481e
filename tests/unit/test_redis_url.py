"""Redis URLs: the forms ``--redis-url`` accepts, and errors that name the problem."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from adapters.redis import connect, parse_redis_url


def test_a_single_server_url() -> None:
    url = parse_redis_url("redis://10.0.0.5:6380/2")
    assert (url.tls, url.cluster, url.nodes, url.db) == (False, False, (("10.0.0.5", 6380),), 2)
    assert url.username is None
    assert url.password is None


def test_defaults_port_6379_and_db_0() -> None:
    url = parse_redis_url("redis://redis.default.svc")
    assert url.nodes == (("redis.default.svc", 6379),)
    assert url.db == 0


def test_user_and_password_are_percent_decoded_and_kept_out_of_repr() -> None:
    url = parse_redis_url("rediss://epp:p%40ss%3Aw@host:6379")
    assert (url.username, url.password) == ("epp", "p@ss:w")
    assert "p@ss" not in repr(url)
    assert parse_redis_url("redis://:only-password@host").password == "only-password"
    assert parse_redis_url("redis://:only-password@host").username is None


def test_tls_options() -> None:
    url = parse_redis_url(
        "rediss://host:6380?ssl_ca_certs=/etc/ca.pem&ssl_cert_reqs=optional"
        "&ssl_check_hostname=false"
    )
    assert url.tls
    assert url.ssl_ca_certs == "/etc/ca.pem"
    assert url.ssl_cert_reqs == "optional"
    assert url.ssl_check_hostname is False
    assert parse_redis_url("rediss://host").ssl_ca_certs is None  # the system's CAs


def test_a_cluster_url_lists_seed_nodes() -> None:
    url = parse_redis_url("redis+cluster://a:7000,b:7001,[::1]:7002")
    assert url.cluster
    assert not url.tls
    assert url.nodes == (("a", 7000), ("b", 7001), ("::1", 7002))
    assert parse_redis_url("rediss+cluster://a:7000").tls


def test_connect_returns_the_client_for_the_form() -> None:
    assert isinstance(connect("redis://127.0.0.1:6379"), Redis)
    assert isinstance(connect("redis+cluster://127.0.0.1:7000,127.0.0.1:7001"), RedisCluster)


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("localhost:6379", "expected <scheme>://host:port"),
        ("http://localhost:6379", "unknown scheme 'http'"),
        ("redis://", "missing host"),
        ("redis://:6379", "missing host"),
        ("redis://host:port", "bad port 'port'"),
        ("redis://host:70000", "bad port '70000'"),
        ("redis://host/zero", "bad database number 'zero'"),
        ("redis://a:1,b:2", "several hosts need a +cluster scheme"),
        ("redis+cluster://a:1/3", "a cluster has no database number"),
        ("rediss://host?timeout=1", "unknown query parameter 'timeout'"),
        ("redis://host?ssl_ca_certs=/ca.pem", "ssl_ca_certs needs a rediss scheme"),
        ("rediss://host?ssl_cert_reqs=maybe", "ssl_cert_reqs='maybe'"),
        ("rediss://host?ssl_ca_certs=", "empty ssl_ca_certs"),
        ("redis+cluster://a:1,,b:2", "missing host"),
    ],
)
def test_a_bad_url_names_the_problem(url: str, problem: str) -> None:
    with pytest.raises(ValueError, match="redis URL") as raised:
        parse_redis_url(url)
    assert problem in str(raised.value)


def test_a_password_never_appears_in_an_error() -> None:
    with pytest.raises(ValueError, match="unknown query parameter") as raised:
        parse_redis_url("redis://user:secret@host?x=1")
    assert "secret" not in str(raised.value)
