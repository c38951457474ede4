"""In the stacked (version-1) layout, tensor slices smaller than a page share it with their page
group's other experts (sim.page_cache, ModelProfile.shared_page_reads / page_group): the
kernel's page cache does this to the engine's reads (checked with mincore), the profile derives
it from a manifest, and the sim's reads and cold classes follow a hand-worked sequence. The
bundled layout starts every bundle on a page: no page is shared, which the kernel confirms."""

from __future__ import annotations

import numpy as np
import pytest
import simpy
from sim_helpers import hardware

from contract.errors import BadInput
from engine.manifest import read_manifest
from engine.store import ExpertStore
from sim.cpu import Cores
from sim.gil import Gil
from sim.loads import Fetcher, Load
from sim.model_profile import PAGE, read_manifest_json, shared_page_slices
from sim.page_cache import PageCache
from sim.storage import Device


def _pages(tensors: dict, expert: int) -> set[int]:
    """The file pages of `expert`'s slices (from the manifest's offsets and strides)."""
    pages: set[int] = set()
    for t in tensors.values():
        start = int(t["offset"]) + expert * int(t["stride"])
        pages.update(range(start // PAGE, -(-(start + int(t["stride"])) // PAGE)))
    return pages


def _grown_by_expert_1(root) -> tuple[int, int, dict]:
    """(resident bytes after reading expert 0 of the first MoE layer, bytes expert 1's read
    then added, its row), the expert files' pages dropped first (mincore)."""
    with ExpertStore(read_manifest(root)) as store:
        store.drop_page_cache()
        if store.page_cache_bytes() != 0:
            pytest.skip("this filesystem keeps file pages resident (tmpfs?): fadvise cannot drop")
        index = store.manifest.moe_layers[0]
        bufs = {n: np.zeros(s, dtype=dt) for n, (s, dt) in store.expert_shapes(index).items()}
        store.read_bundle(index, 0, bufs)
        first = store.page_cache_bytes(index)
        row = store.read_bundle(index, 1, bufs)
        return first, store.page_cache_bytes(index) - first, row


def test_bundled_experts_share_no_page(tiny_random_converted):
    raw = read_manifest_json(tiny_random_converted)
    assert shared_page_slices(raw) == (0, 1)
    first, grown, row = _grown_by_expert_1(tiny_random_converted)
    bundle_pages = -(-int(raw["bundle_bytes"]) // PAGE)
    assert first == grown == bundle_pages * PAGE and row["cold"]


def test_a_partners_read_caches_the_small_slices_pages(tiny_random_stacked):
    tiny_random_converted = tiny_random_stacked
    raw = read_manifest_json(tiny_random_converted)
    layer = raw["layers"][0]
    shared, group = shared_page_slices(raw)
    # tiny-random: the scales and biases are a fraction of a page a slice
    strides = sorted({int(t["stride"]) for t in layer["tensors"].values()})
    assert (shared, group) == (6, PAGE // strides[0]) and strides[0] < PAGE
    first, grown, row = _grown_by_expert_1(tiny_random_converted)
    # expert 1 brings in only the pages expert 0's read did not: its weights', not the
    # scales' and biases' it shares
    assert first == len(_pages(layer["tensors"], 0)) * PAGE
    assert grown == len(_pages(layer["tensors"], 1) - _pages(layer["tensors"], 0)) * PAGE
    assert grown < first and row["cold"]


def test_the_profile_counts_slices_that_share_an_aligned_page():
    def manifest(*tensors: tuple[int, int]) -> dict:
        return {"layers": [{"tensors": {f"t{i}": {"offset": off, "stride": stride}
                                        for i, (off, stride) in enumerate(tensors)}}]}

    assert shared_page_slices(manifest((4096, 16384), (1052672, 2048), (1183744, 2048))) == \
        (2, 2)
    # a slice that does not divide the page, or a tensor off a page boundary: not counted
    assert shared_page_slices(manifest((4096, 16384), (8192, 3000), (10240, 2048))) == (0, 1)
    # several small strides: the smallest group (a page cached only via its nearest experts)
    assert shared_page_slices(manifest((0, 16384), (1 << 20, 1024), (2 << 20, 2048))) == (2, 2)
    # every slice shares a page: not modelled
    assert shared_page_slices(manifest((0, 1024), (8192, 2048))) == (0, 1)


def test_more_shared_slices_than_preads_is_one_line(tmp_path):
    from sim.profiles import load_model

    path = tmp_path / "m.toml"
    path.write_text("\n".join([
        'name = "m"', "layers = 2", "experts = 8", "k = 2", "bundle_bytes = 4096",
        "resident_bytes = 1000", "active_params = 1e6", "kv_bytes_per_token = 64",
        "consumer_first = -1", "consumer_last = -1", "heads = 0", "head_bytes = 0",
        "build_ms_per_layer = 0.1", "head_build_ms = 0.0", "bundle_reads = 3",
        "shared_page_reads = 4", "page_group = 2"]))
    with pytest.raises(BadInput, match="shared_page_reads: 4 must be less than bundle_reads"):
        load_model(str(path))


def test_the_page_cache_keeps_a_groups_shared_page_until_one_of_it_is_pushed_out():
    pc = PageCache(3 * 1000, 1000, 8, shared_reads=6, page_group=2)
    assert pc.shared_missing(4) == 6  # nothing cached
    assert pc.shared_missing(5) == 0  # expert 4's read brought the page in
    for key in (4, 5, 6):
        pc.fill(key, (0, 0))
    pc.fill(7, (0, 0))  # pushes 4 out: the budget drops its pages, the one 5 shares too
    assert 5 in pc.lru and pc.shared_missing(5) == 6
    assert pc.shared_missing(7) == 0  # 6 and 7's page is still there
    # off: no group, O_DIRECT, or groups across layers
    assert PageCache(3000, 1000, 8).shared_missing(4) == 0
    assert PageCache(3000, 1000, 8, enabled=False, shared_reads=6, page_group=2) \
        .shared_missing(4) == 0
    assert PageCache(3000, 1000, 6, shared_reads=6, page_group=4).shared_missing(4) == 0


BUNDLE = 3 * 4096 + 6 * 2048  # three slices of a page, six of half a page
PAGED = 9 * 4096  # its ranges rounded out to pages


def _reads(shared_reads: int, latency_s: float = 0.0001, bandwidth: float = 1e12
           ) -> list[tuple[int, float, bool]]:
    """Loads of experts 4, 5, 6, 7 then 5 again, through a page cache of three bundles: 9
    preads a bundle, 6 of them in pages two experts share, no CPU. (expert, wall ms, cold)
    each."""
    env = simpy.Environment()
    hw = hardware(load_overhead_ms=0.0, cold_overhead_ms=0.0, memcpy_gbps=0.0, readahead=False)
    pc = PageCache(3 * BUNDLE, BUNDLE, 8, shared_reads=shared_reads, page_group=2)
    f = Fetcher(env, hw, Device(latency_s, bandwidth), pc, Cores(env, 0), 8, BUNDLE, PAGED,
                gil=Gil(env, True), bundle_reads=9)
    out = []

    def run():
        for e in (4, 5, 6, 7, 5):
            load = Load(0, 0, e, e, BUNDLE, 1, "demand", env.now, env.event())
            yield from f.perform(load, "main")
            out.append((e, round((load.finished - load.started) * 1e3, 4), load.cold))

    env.process(run())
    env.run()
    return out


def test_reads_skip_the_shared_pages_a_partner_cached_and_reread_them_once_dropped():
    assert _reads(6) == [
        (4, 0.9, True),  # all nine slices from the device
        (5, 0.3, True),  # the six small ones are in the pages 4's read cached
        (6, 0.9, True),
        (7, 0.3, True),  # the cache now holds 5, 6, 7: 4 pushed out, and 5's shared page
        (5, 0.6, True),  # held, but its small slices read again: a cold load
    ]
    # without sharing: every cold bundle is nine requests, a held one warm
    assert _reads(0) == [(4, 0.9, True), (5, 0.9, True), (6, 0.9, True), (7, 0.9, True),
                         (5, 0.0, False)]


def test_the_bytes_read_are_the_pages_missing():
    # no latency, a page a millisecond: the whole paged bundle, then its own three pages, ...,
    # then the six shared pages alone
    assert _reads(6, 0.0, 4096e3) == [(4, 9.0, True), (5, 3.0, True), (6, 9.0, True),
                                      (7, 3.0, True), (5, 6.0, True)]
