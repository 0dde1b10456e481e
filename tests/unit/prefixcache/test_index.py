"""The in-memory prefix index: match walk, per-endpoint LRU, endpoint removal."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import contextmanager

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from domain.prefixcache import InMemoryPrefixIndex
from domain.prefixcache import index as index_module
from domain.sharedstate import ResilientPrefixIndex
from ports.prefix_index import CLAIM_HALF_LIFE, PrefixIndex
from tests.support.prefix_model import PrefixIndexModel

_rng = random.Random(7)
#: 64-bit hashes; a few share their low byte to land in the same owner-map shard.
POOL = [_rng.getrandbits(64) for _ in range(12)] + [(i << 8) | 0x2A for i in range(1, 5)]
H = POOL[:10]


class _SettledResilientIndex:
    """A ``ResilientPrefixIndex`` over a healthy remote whose ``add`` returns once the
    remote has the write too: the port's contract must hold for it as for the local one."""

    def __init__(self, inner: ResilientPrefixIndex) -> None:
        self.inner = inner

    async def match(self, hashes: Sequence[int]) -> Mapping[str, int]:
        return await self.inner.match(hashes)

    async def add(self, hashes: Sequence[int], endpoint: str, capacity: int) -> None:
        await self.inner.add(hashes, endpoint, capacity)
        await self.inner.flush()

    async def remove_endpoint(self, endpoint: str) -> None:
        await self.inner.remove_endpoint(endpoint)

    def size(self) -> int:
        return self.inner.size()


@pytest.fixture(params=["in-memory", "resilient"])
async def index(request: pytest.FixtureRequest) -> AsyncIterator[PrefixIndex]:
    """Each implementation of the port this suite pins (the contract suite)."""
    if request.param == "in-memory":
        yield InMemoryPrefixIndex()
        return
    remote = InMemoryPrefixIndex()
    # Exact recency: every write sent in full (the default re-sends a chain's start once
    # per second, so a re-touch within that second does not reach the remote).
    resilient = ResilientPrefixIndex(remote, budget=1.0, resend_interval=0.0)
    await resilient.start()
    yield _SettledResilientIndex(resilient)
    assert not resilient.degraded
    assert remote.size() == resilient.size()  # the remote holds what the local one does
    await resilient.stop()


async def test_conforms_to_the_port() -> None:
    index: PrefixIndex = InMemoryPrefixIndex()
    await index.add(H[:3], "a", 10)
    assert await index.match(H[:3]) == {"a": 3}
    await index.remove_endpoint("a")
    assert index.size() == 0


async def test_an_empty_index_matches_nothing(index: PrefixIndex) -> None:
    assert await index.match(H) == {}
    assert await index.match([]) == {}
    assert index.size() == 0


async def test_match_counts_the_held_prefix_per_endpoint(index: PrefixIndex) -> None:
    await index.add(H[:4], "a", 100)
    await index.add(H[:2], "b", 100)
    assert await index.match(H[:6]) == {"a": 4, "b": 2}
    assert await index.match(H[:1]) == {"a": 1, "b": 1}


async def test_match_stops_at_the_first_hash_nobody_holds(index: PrefixIndex) -> None:
    await index.add([H[0], H[1], H[3], H[4]], "a", 100)
    # H[2] is held by no one: H[3] and H[4] are never reached.
    assert await index.match(H[:5]) == {"a": 2}
    assert await index.match([H[5], H[0]]) == {}


async def test_match_counts_hashes_an_endpoint_holds_even_if_not_consecutive(
    index: PrefixIndex,
) -> None:
    await index.add([H[0], H[2]], "a", 100)
    await index.add([H[1]], "b", 100)
    # The walk continues through H[1] (held by b), so a is counted for H[0] and H[2].
    assert await index.match(H[:3]) == {"a": 2, "b": 1}


async def test_size_counts_hash_endpoint_pairs(index: PrefixIndex) -> None:
    await index.add(H[:3], "a", 100)
    await index.add(H[:3], "a", 100)  # already held: no new entries
    await index.add(H[1:4], "b", 100)
    assert index.size() == 6


async def test_the_oldest_hashes_are_evicted_beyond_capacity(index: PrefixIndex) -> None:
    await index.add(H[:3], "a", 3)
    await index.add([H[3]], "a", 3)
    assert await index.match([H[0]]) == {}
    assert await index.match(H[1:4]) == {"a": 3}
    assert index.size() == 3


async def test_adding_a_held_hash_makes_it_most_recent(index: PrefixIndex) -> None:
    await index.add(H[:3], "a", 3)
    await index.add([H[0]], "a", 3)  # H[0] is now the newest; H[1] the oldest
    await index.add([H[3]], "a", 3)
    assert await index.match([H[1]]) == {}
    assert await index.match([H[0]]) == {"a": 1}
    assert await index.match([H[2]]) == {"a": 1}


async def test_one_request_longer_than_capacity_keeps_its_last_hashes(index: PrefixIndex) -> None:
    await index.add(H[:5], "a", 2)
    assert await index.match([H[3]]) == {"a": 1}
    assert await index.match([H[4]]) == {"a": 1}
    assert await index.match([H[2]]) == {}
    assert index.size() == 2


async def test_eviction_keeps_other_holders(index: PrefixIndex) -> None:
    await index.add(H[:2], "a", 2)
    await index.add(H[:2], "b", 2)
    await index.add(H[2:4], "a", 2)  # a evicts H[0] and H[1]
    assert await index.match(H[:2]) == {"b": 2}
    assert await index.match(H[2:4]) == {"a": 2}
    assert index.size() == 4


async def test_a_smaller_capacity_shrinks_the_endpoint(index: PrefixIndex) -> None:
    await index.add(H[:5], "a", 10)
    await index.add([], "a", 2)
    assert index.size() == 2
    assert await index.match([H[3]]) == {"a": 1}
    assert await index.match([H[2]]) == {}
    await index.add(H[5:9], "a", 3)  # a larger capacity again keeps more
    assert index.size() == 3


async def test_removing_an_endpoint_forgets_only_its_entries(index: PrefixIndex) -> None:
    await index.add(H[:3], "a", 10)
    await index.add(H[1:4], "b", 10)
    await index.remove_endpoint("a")
    assert await index.match(H[:4]) == {}  # H[0] was only a's
    assert await index.match(H[1:4]) == {"b": 3}
    assert index.size() == 3
    await index.remove_endpoint("a")  # unknown now: ignored
    await index.remove_endpoint("never-seen")
    assert index.size() == 3


async def test_a_removed_endpoint_name_starts_empty_when_it_comes_back() -> None:
    index = InMemoryPrefixIndex()
    await index.add(H[:3], "a", 10)
    await index.add(H[:3], "b", 10)
    await index.remove_endpoint("a")
    await index.add(H[5:6], "c", 10)  # may reuse a's internal slot
    await index.add(H[3:4], "a", 10)
    assert await index.match(H[:3]) == {"b": 3}
    assert await index.match(H[5:6]) == {"c": 1}
    assert await index.match(H[3:4]) == {"a": 1}
    assert index.endpoint_count() == 3


async def test_many_re_touches_keep_exact_lru_order(index: PrefixIndex) -> None:
    hot, cold = H[:2], H[2:5]
    await index.add(cold, "a", 5)
    for _ in range(1500):  # far more re-touches than live entries
        await index.add(hot, "a", 5)
    await index.add([H[5], H[6]], "a", 5)  # evicts the two oldest: cold[0], cold[1]
    assert await index.match([cold[0]]) == {}
    assert await index.match([cold[1]]) == {}
    assert await index.match([cold[2], *hot, H[5], H[6]]) == {"a": 5}
    await index.add([H[7], H[8], H[9]], "a", 5)  # then cold[2], hot[0], hot[1]
    assert await index.match(hot) == {}
    assert index.size() == 5


async def test_many_endpoints_share_one_hash(index: PrefixIndex) -> None:
    names = [f"pod-{i}-rank-0" for i in range(150)]
    for name in names:
        await index.add(H[:2], name, 10)
    assert await index.match(H[:2]) == dict.fromkeys(names, 2)
    for name in names[:149]:
        await index.remove_endpoint(name)
    assert await index.match(H[:2]) == {names[149]: 2}


ENDPOINTS = ["a", "b", "c", "d"]
OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.sampled_from(ENDPOINTS),
            st.lists(st.sampled_from(POOL), max_size=8),
            st.integers(1, 6),
        ),
        st.tuples(st.just("remove"), st.sampled_from(ENDPOINTS), st.just([]), st.just(0)),
    ),
    max_size=40,
)


@contextmanager
def _compacting_eagerly(eager: bool) -> Iterator[None]:
    saved = index_module._COMPACT_SLACK
    index_module._COMPACT_SLACK = 0 if eager else saved
    try:
        yield
    finally:
        index_module._COMPACT_SLACK = saved


def _check(ops: list[tuple[str, str, list[int], int]], eager: bool) -> None:
    index = InMemoryPrefixIndex()
    model = PrefixIndexModel()
    with _compacting_eagerly(eager):
        for op, endpoint, hashes, capacity in ops:
            if op == "add":
                index.add_sync(hashes, endpoint, capacity)
                model.add(hashes, endpoint, capacity)
            else:
                index.remove_endpoint_sync(endpoint)
                model.remove(endpoint)
            assert index.size() == model.size()
            for h in POOL:  # who holds each hash
                assert index.match_sync([h]) == model.match([h])
            assert index.match_sync(POOL[:8]) == model.match(POOL[:8])
            assert index.match_sync(POOL[8:]) == model.match(POOL[8:])


@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_behaves_like_the_simple_model(ops: list[tuple[str, str, list[int], int]]) -> None:
    _check(ops, eager=False)


@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_behaves_like_the_simple_model_while_compacting(
    ops: list[tuple[str, str, list[int], int]],
) -> None:
    _check(ops, eager=True)


def test_a_non_positive_capacity_is_refused() -> None:
    with pytest.raises(ValueError, match="capacity"):
        InMemoryPrefixIndex().add_sync(H[:1], "a", 0)


def test_holds_names_the_endpoints_known() -> None:
    index = InMemoryPrefixIndex()
    index.add_sync(H[:2], "a", 10)
    assert index.holds("a")
    assert not index.holds("b")
    index.remove_endpoint_sync("a")
    assert not index.holds("a")


def test_claim_counts_halve_every_half_life_and_forget_removed_endpoints() -> None:
    now = [100.0]
    index = InMemoryPrefixIndex(clock=lambda: now[0])
    chains = iter([[0x9000 + i, 0x9100 + i] for i in range(10)])
    assert index.claim_sync(next(chains), "a", 10, ["b"]) == "a"
    assert index.claim_sync(next(chains), "a", 10, ["b"]) == "b"
    assert index.claim_sync(next(chains), "a", 10, ["b"]) == "a"  # 1 each: the pick
    # "a" has 2 claims, "b" 1; after one half-life 1 and 0.5: "b" still fewer.
    now[0] += CLAIM_HALF_LIFE
    assert index.claim_sync(next(chains), "a", 10, ["b"]) == "b"
    # Now 1 and 1.5; long after, both are about 0: a tie, the pick.
    now[0] += 30 * CLAIM_HALF_LIFE
    assert index.claim_sync(next(chains), "b", 10, ["a"]) == "b"
    assert index.claim_sync(next(chains), "a", 10, ["b"]) == "a"  # 0 vs 1
    index.remove_endpoint_sync("b")  # its count goes with it: 1 vs 0
    assert index.claim_sync(next(chains), "a", 10, ["b"]) == "b"
