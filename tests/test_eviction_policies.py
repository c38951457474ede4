"""Eviction policies (contract.eviction, sim.belady) on one hand-worked access sequence whose
victims differ between policies: the eviction order after every access, and the hits. The same
sequence drives the engine's hot pool and the simulator's hot path in test_policy_caches.py.

The sequence: a cache of 3 bundles, two layers, one expert per layer and token, stamps
(token, layer). Worked out by hand in docs/policies.md."""

from __future__ import annotations

import pytest

from contract.errors import BadInput
from contract.eviction import LFU, EvictionPolicy, check_policy, make
from sim.belady import Belady

CAPACITY = 3
# (layer, expert) per access, in order; token t accesses layer 0 then layer 1
SEQUENCE = [(0, "A"), (1, "B"), (0, "C"), (1, "B"), (0, "A"), (1, "D"), (0, "C"), (1, "B"),
            (0, "E"), (1, "B")]
STAMPS = [(i // 2, layer) for i, (layer, _) in enumerate(SEQUENCE)]

# the eviction order (next victim first) after each access, and which accesses hit
EXPECTED = {
    "lru": ([["A"], ["A", "B"], ["A", "B", "C"], ["A", "C", "B"], ["C", "B", "A"],
             ["B", "A", "D"], ["A", "D", "C"], ["D", "C", "B"], ["C", "B", "E"],
             ["C", "E", "B"]], [4, 5, 10]),
    "fifo": ([["A"], ["A", "B"], ["A", "B", "C"], ["A", "B", "C"], ["A", "B", "C"],
              ["B", "C", "D"], ["B", "C", "D"], ["B", "C", "D"], ["C", "D", "E"],
              ["D", "E", "B"]], [4, 5, 7, 8]),
    "lfu": ([["A"], ["A", "B"], ["A", "B", "C"], ["A", "C", "B"], ["C", "B", "A"],
             ["D", "B", "A"], ["C", "B", "A"], ["C", "A", "B"], ["E", "A", "B"],
             ["E", "A", "B"]], [4, 5, 8, 10]),
    "least-stale": ([["A"], ["B", "A"], ["C", "A", "B"], ["B", "C", "A"], ["A", "C", "B"],
                     ["D", "C", "B"], ["C", "B", "D"], ["B", "C", "D"], ["E", "C", "B"],
                     ["B", "E", "C"]], [4, 5, 7, 8, 10]),
    "belady": ([["A"], ["A", "B"], ["C", "A", "B"], ["B", "C", "A"], ["A", "B", "C"],
                ["D", "B", "C"], ["D", "C", "B"], ["D", "C", "B"], ["C", "E", "B"],
                ["C", "E", "B"]], [4, 5, 7, 8, 10]),
}


def new_policy(name: str) -> EvictionPolicy:
    if name == "belady":
        return Belady(zip(STAMPS, [e for _, e in SEQUENCE], strict=True))
    return make(name)


def access(policy: EvictionPolicy, key, now, capacity: int) -> bool:
    """What a cache does on one access: a hit is a use; a miss evicts the victim when full
    and admits the key. Returns whether it hit."""
    if key in policy:
        policy.use(key, now)
        return True
    if len(policy) >= capacity:
        policy.remove(policy.victim(now))
    policy.admit(key, now)
    return False


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_eviction_order_after_every_access(name):
    orders, hits = EXPECTED[name]
    policy = new_policy(name)
    got_hits = []
    for i, ((_, key), now) in enumerate(zip(SEQUENCE, STAMPS, strict=True), start=1):
        if access(policy, key, now, CAPACITY):
            got_hits.append(i)
        assert policy.order() == orders[i - 1], f"{name}: after access {i} ({key} at {now})"
    assert got_hits == hits


def test_the_sequence_tells_every_engine_policy_apart():
    """No two engine policies share their victims on this sequence (a broken policy that
    falls back to another's behaviour fails its own test above)."""
    seen = {}
    for name in ("lru", "fifo", "lfu", "least-stale"):
        policy, victims = make(name), []
        for (_, key), now in zip(SEQUENCE, STAMPS, strict=True):
            if key not in policy and len(policy) >= CAPACITY:
                victims.append(policy.victim(now))
            access(policy, key, now, CAPACITY)
        seen[name] = victims
    assert len({tuple(v) for v in seen.values()}) == 4, seen


def test_victim_skips_the_keys_kept():
    policy = make("lru")
    for i, key in enumerate("ABC"):
        policy.admit(key, (0, i))
    assert policy.victim((1, 0), keep={"A"}) == "B"
    assert policy.victim((1, 0), keep={"A", "B", "C"}) is None


def test_lfu_ages_its_counts():
    """X is used four times, then Y and Z arrive in a cache of two. With counts halved every
    2 uses per held key, X's count is back to 1 and, least recent, it goes; without aging (or
    with the default window, not reached yet) X keeps 4 and Y goes."""
    def victim_at_z(policy: LFU) -> str:
        for i, key in enumerate("XXXXY"):
            access(policy, key, (i, 0), 2)
        return policy.victim((5, 0))

    assert victim_at_z(LFU(window_per_key=2)) == "X"
    assert victim_at_z(LFU()) == "Y"
    aged = LFU(window_per_key=2)
    for i, key in enumerate("XXXX"):
        access(aged, key, (i, 0), 2)
    assert aged.count["X"] == 1  # 1, 2 -> halved 1, 2, 3 -> halved 1


def test_least_stale_takes_the_current_tokens_latest_first():
    """Within a token, keys used at earlier layers go before keys left from earlier tokens
    (which the layers still ahead may use), the latest layer first; at a new token's first
    miss every held key is of an earlier token, and the least recent goes."""
    policy = make("least-stale")
    policy.admit("old", (0, 3))
    policy.admit("l0", (1, 0))
    policy.admit("l1", (1, 1))
    assert policy.victim((1, 2)) == "l1"
    assert policy.victim((1, 2), keep={"l1"}) == "l0"
    assert policy.victim((2, 0)) == "old"


def test_bad_policy_names_are_one_line():
    with pytest.raises(BadInput, match="unknown policy 'mru'.*lru, lfu, least-stale, fifo"):
        check_policy("mru")
    with pytest.raises(BadInput, match="needs the future.*only the simulator"):
        check_policy("belady")
    assert check_policy("belady", engine=False) == "belady"
