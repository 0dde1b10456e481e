"""The ``PrefixIndex`` contract, run on every implementation: the in-memory index, Redis on
one server, and Redis on a 3-master cluster. Every test asserts what a caller observes
(``match`` results), so the three must behave identically.

Hash sequences start at their chain's root, as the prefix plugin's always do (a chain's
hashes each cover the prefix before them). ``size()`` may be -1 (unknown) on a shared store.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable

import pytest
from redis.asyncio.cluster import RedisCluster as ClusterClient

from adapters.redis import RedisClient, RedisPrefixIndex
from domain.prefixcache import InMemoryPrefixIndex
from ports.prefix_index import (
    ClaimingPrefixIndex,
    PrefixIndex,
    StagedClaimingPrefixIndex,
    TailAddingPrefixIndex,
)
from tests.contract.conftest import BACKENDS, backend_client
from tests.support.prefix_model import PrefixIndexModel
from tests.support.redis import RedisCluster, RedisServer

MakeIndex = Callable[[], PrefixIndex]


def chain(seed: int, length: int) -> list[int]:
    """A chain of ``length`` 64-bit hashes; different seeds give different roots."""
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(length)]


C = chain(1, 300)
D = chain(2, 10)
E = chain(3, 10)


class _Backend:
    """Indexes sharing one store (several processes), and the client behind them."""

    def __init__(self, name: str, client: RedisClient | None, prefix: str) -> None:
        self.name = name
        self.client = client
        self._memory = InMemoryPrefixIndex()
        self._prefix = prefix

    def make(self) -> PrefixIndex:
        if self.client is None:
            return self._memory  # one process's index: "another process" is the same one
        return RedisPrefixIndex(self.client, key_prefix=self._prefix)


@pytest.fixture(params=BACKENDS)
async def backend(request: pytest.FixtureRequest, key_prefix: str) -> AsyncIterator[_Backend]:
    name: str = request.param
    client = backend_client(request)
    yield _Backend(name, client, key_prefix)
    if client is not None:
        await client.aclose()


@pytest.fixture
def index(backend: _Backend) -> PrefixIndex:
    return backend.make()


def assert_size(index: PrefixIndex, expected: int) -> None:
    assert index.size() in (expected, -1)


async def test_an_empty_index_matches_nothing(index: PrefixIndex) -> None:
    assert await index.match(C[:10]) == {}
    assert await index.match([]) == {}
    assert_size(index, 0)


async def test_match_counts_the_held_prefix_per_endpoint(index: PrefixIndex) -> None:
    await index.add(C[:4], "a", 100)
    await index.add(C[:2], "b", 100)
    assert await index.match(C[:6]) == {"a": 4, "b": 2}
    assert await index.match(C[:1]) == {"a": 1, "b": 1}
    assert await index.match(D[:3]) == {}


async def test_match_stops_at_the_first_hash_nobody_holds(index: PrefixIndex) -> None:
    await index.add([C[0], C[1], C[3], C[4]], "a", 100)
    # C[2] is held by no one: C[3] and C[4] are never reached.
    assert await index.match(C[:5]) == {"a": 2}


async def test_match_counts_hashes_an_endpoint_holds_even_if_not_consecutive(
    index: PrefixIndex,
) -> None:
    await index.add([C[0], C[2]], "a", 100)
    await index.add([C[0], C[1]], "b", 100)
    # The walk continues through C[1] (held by b only), so a counts C[0] and C[2].
    assert await index.match(C[:3]) == {"a": 2, "b": 2}
    assert await index.match(C[:4]) == {"a": 2, "b": 2}


async def test_adding_twice_adds_nothing(index: PrefixIndex) -> None:
    await index.add(C[:3], "a", 100)
    await index.add(C[:3], "a", 100)
    await index.add(C[:4], "b", 100)
    assert await index.match(C[:4]) == {"a": 3, "b": 4}
    assert_size(index, 7)


async def test_the_oldest_hashes_are_evicted_beyond_capacity(index: PrefixIndex) -> None:
    await index.add(C[:1], "b", 100)
    await index.add(C[:3], "a", 3)
    await index.add(D[:1], "a", 3)  # evicts C[0] from a
    assert await index.match(C[:3]) == {"b": 1, "a": 2}
    assert await index.match(D[:1]) == {"a": 1}
    assert_size(index, 4)


async def test_adding_a_held_hash_makes_it_most_recent(index: PrefixIndex) -> None:
    await index.add(C[:3], "a", 3)
    await index.add(C[:1], "a", 3)  # C[0] is now the newest; C[1] the oldest
    await index.add(D[:1], "a", 3)  # evicts C[1]
    assert await index.match(C[:3]) == {"a": 1}  # C[0] held, C[1] by nobody: stop
    assert await index.match(D[:1]) == {"a": 1}


async def test_one_request_longer_than_capacity_keeps_its_last_hashes(index: PrefixIndex) -> None:
    await index.add(C[:5], "b", 100)
    await index.add(C[:5], "a", 2)
    assert await index.match(C[:5]) == {"b": 5, "a": 2}
    await index.remove_endpoint("b")
    assert await index.match(C[:5]) == {}  # a kept C[3], C[4] only
    assert_size(index, 2)


async def test_eviction_keeps_other_holders(index: PrefixIndex) -> None:
    await index.add(C[:2], "a", 2)
    await index.add(C[:2], "b", 2)
    await index.add(D[:2], "a", 2)  # a evicts C[0] and C[1]
    assert await index.match(C[:2]) == {"b": 2}
    assert await index.match(D[:2]) == {"a": 2}
    assert_size(index, 4)


async def test_a_smaller_capacity_shrinks_the_endpoint(index: PrefixIndex) -> None:
    await index.add(C[:5], "b", 100)
    await index.add(C[:5], "a", 10)
    await index.add([], "a", 2)
    assert await index.match(C[:5]) == {"b": 5, "a": 2}
    await index.add(D[:4], "b", 100)
    await index.add(D[:4], "a", 3)  # a larger capacity again keeps more (C's are gone)
    assert await index.match(D[:4]) == {"b": 4, "a": 3}
    assert await index.match(C[:5]) == {"b": 5}


async def test_removing_an_endpoint_forgets_only_its_entries(index: PrefixIndex) -> None:
    await index.add(C[:3], "a", 10)
    await index.add(C[:4], "b", 10)
    await index.add(D[:2], "a", 10)
    await index.remove_endpoint("a")
    assert await index.match(C[:4]) == {"b": 4}
    assert await index.match(D[:2]) == {}
    await index.remove_endpoint("a")  # unknown now: ignored
    await index.remove_endpoint("never-seen")
    assert await index.match(C[:4]) == {"b": 4}
    assert_size(index, 4)


async def test_a_removed_endpoint_name_starts_empty_when_it_comes_back(
    index: PrefixIndex,
) -> None:
    await index.add(C[:3], "a", 10)
    await index.add(C[:3], "b", 10)
    await index.remove_endpoint("a")
    await index.add(E[:1], "c", 10)
    await index.add(D[:1], "a", 10)
    assert await index.match(C[:3]) == {"b": 3}
    assert await index.match(E[:1]) == {"c": 1}
    assert await index.match(D[:1]) == {"a": 1}


async def test_many_re_touches_keep_exact_lru_order(index: PrefixIndex) -> None:
    await index.add(D[:5], "a", 7)  # D[0..4]; then C[0..1] re-touched many times
    for _ in range(300):
        await index.add(C[:2], "a", 7)
    await index.add(E[:2], "a", 7)  # evicts D[0] and D[1], the oldest
    assert await index.match(D[:5]) == {}
    assert await index.match(C[:2]) == {"a": 2}
    assert await index.match(E[:2]) == {"a": 2}
    await index.add(E[:5], "a", 7)  # three more: D[2], D[3], D[4] go
    assert await index.match(C[:2]) == {"a": 2}
    assert_size(index, 7)


async def test_many_endpoints_share_one_hash(index: PrefixIndex) -> None:
    names = [f"pod-{i}-rank-0" for i in range(150)]
    for name in names:
        await index.add(C[:2], name, 10)
    assert await index.match(C[:2]) == dict.fromkeys(names, 2)
    for name in names[:149]:
        await index.remove_endpoint(name)
    assert await index.match(C[:2]) == {names[149]: 2}


async def test_long_chains_of_256_blocks(index: PrefixIndex) -> None:
    long = C[:256]
    await index.add(long, "a", 1000)
    await index.add(long[:200], "b", 1000)
    await index.add(long, "c", 100)  # keeps its last 100 blocks
    assert await index.match(long) == {"a": 256, "b": 200, "c": 100}
    assert await index.match([*long, *chain(9, 10)]) == {"a": 256, "b": 200, "c": 100}
    assert await index.match(C[:300]) == {"a": 256, "b": 200, "c": 100}


async def test_another_process_sees_the_adds_and_removals(backend: _Backend) -> None:
    first, second = backend.make(), backend.make()
    await first.add(C[:4], "a", 100)
    assert await second.match(C[:4]) == {"a": 4}
    await second.add(C[:6], "b", 100)
    assert await first.match(C[:6]) == {"a": 4, "b": 6}
    await second.remove_endpoint("a")
    assert await first.match(C[:6]) == {"b": 6}


async def test_chains_with_different_roots_spread_over_the_cluster(
    backend: _Backend,
) -> None:
    index = backend.make()
    chains = [chain(100 + i, 8) for i in range(12)]
    for i, hashes in enumerate(chains):
        await index.add(hashes, f"pod-{i % 3}", 1000)
    for i, hashes in enumerate(chains):
        assert await index.match(hashes) == {f"pod-{i % 3}": 8}
    if isinstance(backend.client, ClusterClient) and isinstance(index, RedisPrefixIndex):
        client = backend.client
        nodes = {str(client.get_node_from_key(index.chain_key(h[0]))) for h in chains}
        assert len(nodes) > 1, "every chain landed on one node"
        # Each chain's blocks are one key: its node holds them all.
        for i, hashes in enumerate(chains):
            stored = await client.hgetall(index.chain_key(hashes[0]))
            assert {f"{h:016x}".encode() for h in hashes} <= set(stored)
            assert all(f" pod-{i % 3}\n".encode() in stored[f"{h:016x}".encode()] for h in hashes)


async def test_adding_a_tail_records_the_end_of_the_chain(index: PrefixIndex) -> None:
    assert isinstance(index, TailAddingPrefixIndex)
    await index.add(C[:6], "a", 100)
    await index.add_tail(C[:10], 6, "a", 100)
    assert await index.match(C[:10]) == {"a": 10}
    # The held start keeps its older recency: it is evicted first.
    await index.add_tail(C[:12], 10, "a", 8)
    assert await index.match(C[:12]) == {}
    assert await index.match(C[:4]) == {}
    await index.add(C[:12], "b", 100)
    assert await index.match(C[:12]) == {"a": 8, "b": 12}


def claiming(index: PrefixIndex) -> ClaimingPrefixIndex:
    assert isinstance(index, ClaimingPrefixIndex)
    return index


async def test_claiming_a_new_chain_records_it_for_the_claimer(index: PrefixIndex) -> None:
    assert await claiming(index).claim(D, "a", 100) == "a"
    assert await index.match(D) == {"a": 10}
    # The claim's capacity applies as an add's: D's oldest blocks make room for E.
    assert await claiming(index).claim(E, "a", 12) == "a"
    assert await index.match(E) == {"a": 10}
    assert await index.match(D) == {}


async def test_claiming_a_held_chain_names_its_owner_and_records_nothing(
    index: PrefixIndex,
) -> None:
    await index.add(D[:3], "a", 100)
    await index.add(D[:8], "b", 100)
    assert await claiming(index).claim(D, "c", 100) == "b"
    assert await index.match(D) == {"a": 3, "b": 8}
    # A chain sharing only the first block is held too: its holder owns it.
    other = [D[0], *chain(7, 5)]
    assert await claiming(index).claim(other, "c", 100) in ("a", "b")
    assert await index.match(other) == {"a": 1, "b": 1}


async def test_a_staged_claim_names_its_owner_then_records_the_rest(backend: _Backend) -> None:
    """A store that names a claim's owner before its last writes (``claim_owner``): the
    chain is the owner's at once, and with the rest run the index is as after ``claim``."""
    index = backend.make()
    if not isinstance(index, StagedClaimingPrefixIndex):
        pytest.skip(f"{backend.name} claims in one step")
    owner, rest = await index.claim_owner(D, "a", 100)
    assert owner == "a"
    assert await index.match(D) == {"a": 10}
    if rest is not None:
        await rest()
    owner, rest = await index.claim_owner(E, "a", 12, ["b"])
    assert owner == "b"  # a counts one new chain, b none
    if rest is not None:
        await rest()
    owner, rest = await index.claim_owner(chain(11, 10), "a", 12)
    assert owner == "a"
    if rest is not None:
        await rest()
    # the capacity applies as a claim's: D's oldest blocks made room
    assert await index.match(D) == {}
    owner, rest = await index.claim_owner(E, "c", 100, ["a"])
    assert owner == "b"
    if rest is not None:
        await rest()
    assert await index.match(E) == {"b": 10}


async def test_a_removed_owner_no_longer_owns(index: PrefixIndex) -> None:
    await claiming(index).claim(D, "a", 100)
    await index.remove_endpoint("a")
    assert await claiming(index).claim(D, "b", 100) == "b"
    assert await index.match(D) == {"b": 10}


async def test_processes_claiming_one_new_chain_at_once_agree_on_one_owner(
    backend: _Backend,
) -> None:
    indexes = [claiming(backend.make()) for _ in range(6)]
    await indexes[0].match(D)  # a cluster client's first call learns the slots, alone
    for round_ in range(5):
        hashes = chain(500 + round_, 12)
        owners = await asyncio.gather(
            *(ix.claim(hashes, f"pod-{i}", 100) for i, ix in enumerate(indexes))
        )
        assert len(set(owners)) == 1, owners
        assert await indexes[0].match(hashes) == {owners[0]: 12}


async def test_new_chains_claimed_at_once_spread_over_equally_good_endpoints(
    backend: _Backend,
) -> None:
    """Processes placing different new chains, each with the same pick and the other
    endpoints as alternates, spread them: each goes to the endpoint the fewest new chains
    went to lately (the pick among equals), also when they claim at the same instant."""
    indexes = [claiming(backend.make()) for _ in range(3)]
    await indexes[0].match(D)  # a cluster client's first call learns the slots, alone
    chains = [chain(600 + i, 6) for i in range(8)]
    owners = [
        await indexes[i % 3].claim(hashes, "a", 100, ["b", "c", "d"])
        for i, hashes in enumerate(chains)
    ]
    assert owners == ["a", "b", "c", "d"] * 2
    for hashes, owner in zip(chains, owners, strict=True):
        assert await indexes[0].match(hashes) == {owner: 6}
    more = [chain(700 + i, 6) for i in range(4)]
    at_once = await asyncio.gather(
        *(indexes[i % 3].claim(h, "a", 100, ["b", "c", "d"]) for i, h in enumerate(more))
    )
    assert sorted(at_once) == ["a", "b", "c", "d"]
    # A held chain names its owner, whatever the alternates.
    assert await indexes[1].claim(chains[1], "c", 100, ["a", "d"]) == "b"


async def test_claims_without_alternates_count_too(backend: _Backend) -> None:
    """A new chain claimed with no alternates counts for its endpoint as one claimed with
    them does: the next choice among equals goes elsewhere."""
    indexes = [claiming(backend.make()) for _ in range(2)]
    await indexes[0].match(D)  # a cluster client's first call learns the slots, alone
    assert await indexes[0].claim(chain(800, 6), "a", 100) == "a"
    assert await indexes[1].claim(chain(801, 6), "a", 100) == "a"
    assert await indexes[0].claim(chain(802, 6), "b", 100) == "b"
    # a: 2 claims, b: 1, c: none
    assert await indexes[1].claim(chain(803, 6), "a", 100, ["b", "c"]) == "c"
    assert await indexes[0].claim(chain(804, 6), "a", 100, ["b"]) == "b"


async def test_claims_that_find_the_chain_held_do_not_count(backend: _Backend) -> None:
    """Processes claiming one new chain at once: only the winner's claim counts, so the
    next choice among equals is not skewed by the losers'."""
    indexes = [claiming(backend.make()) for _ in range(3)]
    await indexes[0].match(D)  # a cluster client's first call learns the slots, alone
    hashes = chain(900, 6)
    assert await indexes[0].claim(hashes, "a", 100) == "a"
    assert await indexes[1].claim(hashes, "b", 100, ["c"]) == "a"
    assert await indexes[2].claim(hashes, "d", 100) == "a"
    # a loser that had picked the owner too (two processes placing one new chain at once
    # both choose the least claimed endpoint): the chain still counts once
    assert await indexes[1].claim(hashes, "a", 100) == "a"
    assert await indexes[2].claim(hashes, "a", 100, ["c", "d"]) == "a"
    # a: 1 claim; b, c and d none: the pick wins each tie
    assert await indexes[1].claim(chain(901, 6), "b", 100, ["c"]) == "b"
    assert await indexes[2].claim(chain(902, 6), "d", 100, ["c"]) == "d"
    # a, b and d: 1 claim each, so a, the pick, wins the tie with d
    assert await indexes[0].claim(chain(903, 6), "a", 100, ["d"]) == "a"


async def test_claims_in_flight_count_only_the_chains_they_place(
    backend: _Backend,
) -> None:
    """Two processes claim one new chain while a third claims another, all at the same
    instant, among the same two endpoints: the chain claimed twice counts once from the
    start, so the other chain goes to the other endpoint (a cluster chooses on one node and
    claims on another; a choice counted for the loser, though taken back later, would make
    the other chain tie and go to the pick)."""
    indexes = [claiming(backend.make()) for _ in range(3)]
    await indexes[0].match(D)  # a cluster client's first call learns the slots, alone
    for round_ in range(6):
        twice, once = chain(950 + 2 * round_, 6), chain(951 + 2 * round_, 6)
        owners = await asyncio.gather(
            indexes[0].claim(twice, "a", 100, ["b"]),
            indexes[1].claim(twice, "a", 100, ["b"]),
            indexes[2].claim(once, "a", 100, ["b"]),
        )
        assert owners[0] == owners[1], f"round {round_}: {owners}"
        assert sorted(owners[1:]) == ["a", "b"], f"round {round_}: {owners}"
    # A chain placed already, claimed again among other endpoints (a process whose match
    # missed it) while a new chain is claimed: the first claim never counts, even for a
    # moment, so the new chain goes to the pick among equals.
    placed = chain(990, 6)
    assert await indexes[0].claim(placed, "e", 100) == "e"
    for round_ in range(6):
        fresh = chain(991 + round_, 6)
        pair = await asyncio.gather(
            indexes[1].claim(placed, f"c{round_}", 100, [f"d{round_}"]),
            indexes[2].claim(fresh, f"c{round_}", 100, [f"d{round_}"]),
        )
        assert list(pair) == ["e", f"c{round_}"], f"round {round_}"


async def test_random_operations_agree_with_the_model(index: PrefixIndex) -> None:
    rng = random.Random(42)
    chains = [chain(200 + i, 12) for i in range(5)]
    endpoints = ["a", "b", "c", "d"]
    model = PrefixIndexModel()
    for step in range(250):
        hashes = rng.choice(chains)[: rng.randint(1, 12)]
        roll = rng.random()
        if roll < 0.55:
            endpoint, capacity = rng.choice(endpoints), rng.choice([3, 8, 20])
            await index.add(hashes, endpoint, capacity)
            model.add(hashes, endpoint, capacity)
        elif roll < 0.6:
            endpoint = rng.choice(endpoints)
            await index.remove_endpoint(endpoint)
            model.remove(endpoint)
        elif roll < 0.7:
            endpoint, capacity = rng.choice(endpoints), rng.choice([3, 8, 20])
            held = model.match(hashes)
            owner = await claiming(index).claim(hashes, endpoint, capacity)
            if model.match(hashes[:1]):
                assert held.get(owner) == max(held.values()), f"step {step}"
            else:
                assert owner == endpoint, f"step {step}"
                model.add(hashes, endpoint, capacity)
        else:
            assert await index.match(hashes) == model.match(hashes), f"step {step}"


def test_the_cluster_fixture_has_three_masters(redis_cluster: RedisCluster) -> None:
    assert len(redis_cluster.nodes) == 3
    assert all("cluster_state:ok" in n.cli("CLUSTER", "INFO") for n in redis_cluster.nodes)


def test_the_single_server_answers(redis_server: RedisServer) -> None:
    assert redis_server.cli("PING").strip() == "PONG"
