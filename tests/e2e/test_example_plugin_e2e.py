"""The example out-of-tree plugin (``examples/sticky-sessions``) routing through a real Envoy.

The EPP process finds ``sticky-session-scorer`` through its ``epp.plugins`` entry point (it
is installed into the environment by ``make install``), as a user's EPP would.
"""

from __future__ import annotations

from collections import Counter

import aiohttp
import orjson
import pytest

from tests.simulator import DEFAULT_MODEL, INSTANCE_HEADER
from tests.support.stack import Stack, StackOptions

pytestmark = pytest.mark.e2e

CONFIG = """
plugins:
- type: sticky-session-scorer
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins: [{pluginRef: sticky-session-scorer, weight: 3}, {pluginRef: queue-scorer},
            {pluginRef: max-score-picker}]
"""

SESSIONS = [f"chat-{i}" for i in range(12)]
TURNS = 4


async def _served_by(session: aiohttp.ClientSession, url: str, chat: str, turn: int) -> str:
    body = orjson.dumps({"model": DEFAULT_MODEL, "prompt": f"{chat} turn {turn}", "max_tokens": 1})
    async with session.post(
        f"{url}/v1/completions", data=body, headers={"x-session-id": chat}
    ) as response:
        await response.read()
        assert response.status == 200, await response.text()
        return response.headers[INSTANCE_HEADER]


async def test_the_turns_of_a_chat_session_are_served_by_the_same_server() -> None:
    options = StackOptions(
        simulators=3, simulator_base_ip="127.0.0.52", epp_args=["--config-text", CONFIG]
    )
    with Stack.run(options) as stack:
        async with aiohttp.ClientSession() as session:
            served: dict[str, Counter[str]] = {chat: Counter() for chat in SESSIONS}
            for turn in range(TURNS):
                for chat in SESSIONS:
                    served[chat][await _served_by(session, stack.url, chat, turn)] += 1
    # Each session stays where its first turn went (a random pick would move it: the
    # prompts share no prefix and the servers are idle)...
    assert all(len(servers) == 1 for servers in served.values()), served
    # ...and the sessions did not all land on one server: the first turns were spread.
    homes = {next(iter(servers)) for servers in served.values()}
    assert len(homes) > 1, served
