"""``make demo-ha`` as a user runs it (short): three EPP replicas on one real redis-server
behind Envoy; what it prints says which replica routed each request and that every
conversation stayed on one model server."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.demo import SYSTEMS
from tests.support.redis import redis_available
from tests.support.stack import ROOT

pytestmark = pytest.mark.e2e


def test_demo_ha_shows_each_conversation_on_one_server_across_replicas() -> None:
    if not redis_available():
        pytest.fail("redis-server and redis-cli are not on PATH: run `make install`")
    done = subprocess.run(
        [sys.executable, "-m", "tests.demo_ha", "--rounds", "3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    rows = re.findall(r"^\s*\d+\s+conversation (\d)\s+replica (\d)\s+200\s+(\S+)", out, re.M)
    assert len(rows) == 3 * len(SYSTEMS), out
    assert {replica for _, replica, _ in rows} == {"1", "2", "3"}, out  # all three routed
    for conversation in range(len(SYSTEMS)):
        servers = {server for c, _, server in rows if c == str(conversation)}
        replicas = {replica for c, replica, _ in rows if c == str(conversation)}
        assert len(servers) == 1, (conversation, out)
        assert len(replicas) > 1, (conversation, out)  # routed by several replicas
    assert "every conversation stayed on one server across 3 replicas: yes" in out
    assert "Done." in out
