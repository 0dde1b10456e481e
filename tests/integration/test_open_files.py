"""The ``epp`` process against its open-file limit.

Before: with a soft ``nofile`` of 1,024 (what many hosts still give), 1,100 idle
connections made every new connection fail, Envoy's included, and nothing was logged. Now
the process raises its soft limit to the hard one at start and says so, and logs once when
it runs out of descriptors (connections are refused) and once when it has some again.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

from tests.support.stack import ChildProcess, wait_for

from .test_process import Epp

SOFT, HARD = 128, 256
#: Starts ``python -m app ...`` with the soft and hard limits above.
LIMITED = (
    "import os, resource, sys; "
    f"resource.setrlimit(resource.RLIMIT_NOFILE, ({SOFT}, {HARD})); "
    "os.execv(sys.executable, [sys.executable, '-m', 'app', *sys.argv[1:]])"
)


def limited(epp: Epp) -> ChildProcess:
    argv = list(epp.child.argv)
    assert argv[:3] == [sys.executable, "-m", "app"]
    return ChildProcess("epp", [sys.executable, "-c", LIMITED, *argv[3:]], epp.child.log_path)


def open_files_limit(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no open-files line")


def test_the_soft_limit_is_raised_and_running_out_is_logged(tmp_path: Path) -> None:
    epp = Epp(tmp_path)
    epp.child = limited(epp)
    epp.child.start()
    held: list[socket.socket] = []
    try:
        wait_for(epp.serving, timeout=30, what="SERVING")
        assert epp.child.process is not None
        assert open_files_limit(epp.child.process.pid) == (HARD, HARD)
        assert f"soft limit raised from {SOFT} to the hard limit {HARD}" in epp.child.log()
        # idle connections until the process has no descriptor left
        for _ in range(HARD + 16):
            held.append(socket.create_connection(("127.0.0.1", epp.grpc_port), timeout=5))
        wait_for(
            lambda: "new connections, Envoy's included, are refused" in epp.child.log(),
            timeout=15,
            what="the line saying connections are refused",
        )
        for connection in held:
            connection.close()
        held.clear()
        wait_for(
            lambda: "new connections accepted again" in epp.child.log(),
            timeout=15,
            what="the line saying connections are accepted again",
        )
        wait_for(epp.serving, timeout=15, what="SERVING again")
    finally:
        for connection in held:
            connection.close()
        epp.child.stop()
    log = epp.child.log()
    assert log.count("are refused until some close") == 1, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
