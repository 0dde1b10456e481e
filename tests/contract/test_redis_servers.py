"""The test Redis servers themselves: single, cluster, TLS, ACL, kill and restart."""

from __future__ import annotations

from tests.support.redis import ACL_PASSWORD, ACL_USER, RedisCluster, RedisServer


def test_a_server_answers_and_restarts_empty_on_the_same_port(
    redis_scratch_server: RedisServer,
) -> None:
    server = redis_scratch_server
    server.cli("SET", "epp:k", "v")
    port = server.port
    server.kill()
    assert server.cli("PING", check=False).strip() != "PONG"
    server.start()
    assert server.port == port
    assert server.cli("GET", "epp:k").strip() == ""  # nothing persisted


def test_the_cluster_has_three_masters_and_every_slot(redis_cluster: RedisCluster) -> None:
    assert len(redis_cluster.nodes) == 3
    for node in redis_cluster.nodes:
        info = node.cli("CLUSTER", "INFO")
        assert "cluster_state:ok" in info
        assert "cluster_slots_assigned:16384" in info
        assert "cluster_known_nodes:3" in info


def test_the_tls_server_refuses_plain_text_and_answers_over_tls(
    tls_redis_server: RedisServer,
) -> None:
    assert tls_redis_server.cli("PING").strip() == "PONG"  # redis-cli --tls --cacert
    plain = RedisServer(port=tls_redis_server.port)  # same port, no TLS
    try:
        assert plain.cli("PING", check=False).strip() != "PONG"
    finally:
        plain.close()


def test_the_acl_user_may_touch_epp_keys_only(redis_server: RedisServer) -> None:
    auth = ["--user", ACL_USER, "--pass", ACL_PASSWORD, "--no-auth-warning"]
    assert redis_server.cli(*auth, "HSET", "epp:x", "a", "1").strip() == "1"
    assert "NOPERM" in redis_server.cli(*auth, "HSET", "other:x", "a", "1", check=False)
    assert "NOPERM" in redis_server.cli(*auth, "FLUSHALL", check=False)
