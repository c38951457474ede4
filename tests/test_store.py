"""ExpertStore: bytes, cold/warm classification, page-cache budget (verified with mincore),
O_DIRECT, load rows, read errors."""

from __future__ import annotations

import errno
import os
import time

import numpy as np
import pytest
from layer_reference import stacked_reference
from store_helpers import expert_buffers, needs_real_page_cache

from engine.manifest import read_manifest
from engine.store import PAGE, ExpertReadError, ExpertStore
from traces.schema import LOAD_COLUMNS


def test_read_bundle_matches_file(store, tiny_random_converted):
    m = store.manifest
    for layer in (m.moe_layers[0], m.moe_layers[-1]):
        ref = stacked_reference(tiny_random_converted / m.layers[layer].file)
        for e in (0, 7, m.num_experts - 1):
            buf = expert_buffers(store, layer)
            row = store.read_bundle(layer, e, buf)
            for n, v in buf.items():
                assert np.array_equal(v, ref[n][e]), (layer, e, n)
            assert row["bytes"] == m.layers[layer].bundle_bytes


def test_read_layer_matches_file(store, tiny_random_converted):
    layer = store.manifest.moe_layers[1]
    ref = stacked_reference(tiny_random_converted / store.manifest.layers[layer].file)
    into = {n: np.zeros_like(v) for n, v in ref.items()}
    row = store.read_layer(layer, into)
    assert row["expert"] == -1 and row["source"] == "whole_layer"
    for n in ref:
        assert np.array_equal(into[n], ref[n])


def test_load_rows_follow_schema(store):
    store.read_bundle(0, 3, expert_buffers(store, 0), step=5)  # the step is the caller's
    assert not hasattr(store, "step")  # the store holds none: it does I/O only
    row = store.rows[-1]
    assert set(row) == set(LOAD_COLUMNS)
    assert row["step"] == 5 and row["layer"] == 0 and row["expert"] == 3
    assert row["issued_ns"] <= row["started_ns"] <= row["finished_ns"]
    assert row["wait_ns"] == row["finished_ns"] - row["issued_ns"] and row["waited"]
    assert row["offset"] == store.manifest.layers[0].expert_range("gate_proj.weight", 3)[0]
    assert row["source"] == "demand" and row["thread"] == "main"


def test_cold_then_warm(store):
    needs_real_page_cache(store)
    # Up to 3 tries of the premise: in one fresh-clone run the kernel brought dropped pages
    # back between mincore and the read; a store that never classes a read cold fails all.
    for _ in range(3):
        store.drop_page_cache(1)
        time.sleep(0.05)
        assert store.is_cold(1, 4) and store.residency(1, 4) == 0.0
        row = store.read_bundle(1, 4, expert_buffers(store, 1))
        if row["cold"] is True:
            break
    else:
        pytest.fail("a read of a bundle mincore found not resident was never classed cold")
    assert store.residency(1, 4) == 1.0
    row = store.read_bundle(1, 4, expert_buffers(store, 1))
    assert row["cold"] is False
    # Readahead is off: a neighbour that shares no page with expert 4 stays cold.
    assert store.is_cold(1, 9)
    store.drop_page_cache(1)
    assert store.is_cold(1, 4)


def test_o_direct_reads_identical_bytes_and_bypass_cache(tiny_random_converted):
    m = read_manifest(tiny_random_converted)
    ref = stacked_reference(tiny_random_converted / m.layers[2].file)
    with ExpertStore(m, o_direct=True) as s:
        if not s.direct:
            pytest.skip(f"O_DIRECT refused here: {s.direct_fallback}")
        s.drop_page_cache()
        dropped = s.page_cache_bytes() == 0
        for e in range(m.num_experts):
            buf = expert_buffers(s, 2)
            row = s.read_bundle(2, e, buf)
            assert s.direct, s.direct_fallback
            for n, v in buf.items():
                assert np.array_equal(v, ref[n][e]), (e, n)
            if dropped:  # O_DIRECT never caches, so every read finds its pages absent
                assert row["cold"] is True
        if dropped:  # O_DIRECT reads did not populate the page cache
            assert s.page_cache_bytes() == 0
        into = {n: np.zeros_like(v) for n, v in ref.items()}
        s.read_layer(2, into)
        assert all(np.array_equal(into[n], ref[n]) for n in ref)


def test_page_cache_budget_is_real(tiny_random_converted):
    m = read_manifest(tiny_random_converted)
    # Budget of 4 bundles counted in whole pages (a bundle's ranges rounded out to the pages
    # they touch, each page once: one span in the bundled layout).
    probe = ExpertStore(m)
    ranges = probe.bundle_ranges(0, 0)
    probe.close()
    pages = -(-(ranges[-1][0] + ranges[-1][1]) // PAGE) - ranges[0][0] // PAGE
    budget = 4 * pages * PAGE
    with ExpertStore(m, page_cache_budget=budget) as s:
        if s.page_cache_bytes() != 0:
            pytest.skip("this filesystem keeps file pages resident (tmpfs?)")
        order = [(layer, e) for layer in m.moe_layers for e in range(0, m.num_experts, 2)]
        peak = 0
        for layer, e in order:
            s.read_bundle(layer, e, expert_buffers(s, layer))
            peak = max(peak, s.page_cache_bytes())
        assert 0 < peak <= budget
        last = order[-4:]
        assert all(s.residency(layer, e) == 1.0 for layer, e in last)
        assert all(s.is_cold(layer, e) for layer, e in order[:-4])
        # Re-reading an old bundle makes it most recent; the oldest of the last four goes.
        s.read_bundle(*order[0], expert_buffers(s, order[0][0]))
        assert s.residency(*order[0]) == 1.0 and s.is_cold(*last[0])
        assert s.page_cache_bytes() <= budget
        # LRU, not FIFO: re-reading a resident bundle refreshes it. Kept now (oldest first):
        # last[1], last[2], last[3], order[0]; refresh last[1], then a new bundle evicts
        # last[2] (FIFO would evict last[1], the oldest read).
        s.read_bundle(*last[1], expert_buffers(s, last[1][0]))
        new = (m.moe_layers[0], 1)  # odd experts were never read
        s.read_bundle(*new, expert_buffers(s, new[0]))
        assert s.residency(*last[1]) == 1.0 and s.residency(*new) == 1.0
        assert s.is_cold(*last[2])  # (last[3] may share a page with last[2]: not checked)


def test_read_errors_name_layer_expert_file(tiny_random_converted, model_copy):
    d = model_copy(tiny_random_converted)
    m = read_manifest(d)
    path = d / m.layers[3].file
    with ExpertStore(m) as s:
        os.truncate(path, m.layers[3].tensors["down_proj.weight"].offset)
        with pytest.raises(ExpertReadError) as err:
            s.read_bundle(3, 30, expert_buffers(s, 3))
        msg = str(err.value)
        assert str(path) in msg and "layer 3" in msg and "expert 30" in msg
        assert "short read" in msg
        with pytest.raises(ValueError, match="buffer"):
            buf = expert_buffers(s, 0)
            buf["up_proj.scales"] = buf["up_proj.scales"][:1]
            s.read_bundle(0, 1, buf)


def test_o_direct_refused_falls_back_clearly(tiny_random_converted, monkeypatch):
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr("engine.store.os.open", refusing_open)
    m = read_manifest(tiny_random_converted)
    with pytest.warns(UserWarning, match="O_DIRECT unavailable"):
        s = ExpertStore(m, o_direct=True)
    assert not s.direct and "Invalid argument" in s.direct_fallback
    buf = expert_buffers(s, 0)
    s.read_bundle(0, 2, buf)
    ref = stacked_reference(tiny_random_converted / m.layers[0].file)
    assert all(np.array_equal(buf[n], ref[n][2]) for n in buf)
    s.close()


def test_o_direct_read_refused_falls_back_to_buffered(tiny_random_converted, monkeypatch):
    """A filesystem that opens O_DIRECT but refuses its first read (EINVAL): the store warns,
    reads buffered from then on, and the bytes are the file's."""
    m = read_manifest(tiny_random_converted)
    s = ExpertStore(m, o_direct=True)
    if not s.direct:
        pytest.skip(f"O_DIRECT refused at open here: {s.direct_fallback}")
    direct_fds = {f.dfd for f in s._files.values()}
    real_preadv = os.preadv

    def refusing_preadv(fd, bufs, off, *flags):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, bufs, off, *flags)

    monkeypatch.setattr("engine.range_reads.os.preadv", refusing_preadv)
    buf = expert_buffers(s, 1)
    with pytest.warns(UserWarning, match="O_DIRECT unavailable"):
        s.read_bundle(1, 3, buf)
    assert not s.direct and "Invalid argument" in s.direct_fallback
    ref = stacked_reference(tiny_random_converted / m.layers[1].file)
    assert all(np.array_equal(buf[n], ref[n][3]) for n in buf)
    s.close()


def test_drop_until_cold_drops_again_while_pages_stay_and_says_what_is_left(store, monkeypatch):
    """Pages a read still had in flight can land after a drop: the store drops and checks with
    mincore until nothing is resident, and reports what stayed when it never empties."""
    drops, resident = [], iter([8192, 4096, 0])
    monkeypatch.setattr(store, "drop_page_cache", lambda layer=None: drops.append(layer))
    monkeypatch.setattr(store, "page_cache_bytes", lambda layer=None: next(resident))
    assert store.drop_until_cold(tries=5, settle_s=0.0) == 0
    assert drops == [None] * 6  # dropped twice a try until mincore saw nothing left
    drops.clear()
    monkeypatch.setattr(store, "page_cache_bytes", lambda layer=None: 4096)
    assert store.drop_until_cold(layer=1, tries=4, settle_s=0.0) == 4096
    assert drops == [1] * 8


def test_drop_until_cold_empties_a_warm_layer(store):
    needs_real_page_cache(store)
    layer = store.manifest.moe_layers[0]
    for e in range(4):
        store.read_bundle(layer, e, expert_buffers(store, layer))
    assert store.page_cache_bytes(layer) > 0
    assert store.drop_until_cold(layer) == 0
    assert all(store.is_cold(layer, e) for e in range(4))


def test_a_failed_mincore_is_unknown_never_cold_or_warm(store, monkeypatch):
    """mincore failing must not read as "nothing resident" (a cold premise nobody checked,
    and a warm class for every load classed by it): residency raises naming the file, the
    page-cache size is unknown (-1), a load it classes counts cold, and nothing is 'warm'."""
    from engine import platform
    from engine.store import ResidencyUnknown

    layer = store.manifest.moe_layers[0]
    store.read_bundle(layer, 2, expert_buffers(store, layer))  # cached now
    store.residency_method = "mincore"

    def failing_mincore(addr, length, vec) -> int:
        import ctypes
        ctypes.set_errno(errno.ENOMEM)
        return -1

    monkeypatch.setattr(platform._libc, "mincore", failing_mincore)  # whole files
    monkeypatch.setattr(platform, "_mincore_holding_gil", failing_mincore)  # bundles
    with pytest.raises(ResidencyUnknown, match=store.manifest.layers[layer].file):
        store.residency(layer, 2)
    with pytest.raises(ResidencyUnknown):
        store.is_cold(layer, 2)
    assert store.page_cache_bytes() == -1
    assert store.read_bundle(layer, 2, expert_buffers(store, layer))["cold"] is True
    assert store.read_bundle_if_warm(layer, 2, expert_buffers(store, layer)) is None


def _uncached(fd: int, offset: int) -> bool:
    """mincore on a fresh mapping of the file: is the page at `offset` out of the cache?"""
    from engine.platform import ResidencyProbe, map_for_residency, unmap

    size = os.fstat(fd).st_size
    addr = map_for_residency(fd, size)
    try:
        return ResidencyProbe().resident_pages(addr, [(offset, 1)])[0] == 0
    finally:
        unmap(addr, size)


@pytest.mark.parametrize("kernel", ["sound", "reads_anyway", "starts_io", "as_is"])
def test_open_probe_trusts_rwf_nowait_only_where_it_starts_no_read(tiny_random_converted,
                                                                     monkeypatch, kernel):
    """The open-time probe makes one page uncached and reads it with RWF_NOWAIT. Trusted only
    when refused with no read started ("sound"); a kernel that reads it ("reads_anyway") or
    starts its read ("starts_io", as Linux 6.18 does: then a fast device answers within the call
    and a cold read looks warm) sends the store to mincore, whose cold loads are cold. Either
    way the probe leaves the files as cold as it found them: nothing lands afterwards."""
    real = os.preadv

    def preadv(fd, buffers, offset, flags=0):
        if kernel == "as_is" or not flags & os.RWF_NOWAIT:
            return real(fd, buffers, offset, flags)
        if not _uncached(fd, offset):
            return real(fd, buffers, offset)  # cached: a copy
        if kernel == "reads_anyway":
            return real(fd, buffers, offset)  # a blocking read from the device
        if kernel == "starts_io":
            os.pread(fd, 1, offset)  # the refused page's read, started (here: finished)
        raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")

    with ExpertStore(read_manifest(tiny_random_converted)) as s:
        if s._nowait is None:
            pytest.skip("no RWF_NOWAIT on this platform")
        s.drop_until_cold(settle_s=0.01)
    monkeypatch.setattr(os, "preadv", preadv)
    with ExpertStore(read_manifest(tiny_random_converted)) as s:
        if kernel == "sound":
            assert s.residency_method == "rwf_nowait", s.residency_fallback
            assert s.nowait_starts_io is False
        elif kernel == "as_is":  # this kernel: whichever it is, the verdict says it
            assert (s.residency_method == "rwf_nowait") == (s.nowait_starts_io is False)
        else:
            expect = {"reads_anyway": "read a non-resident page", "starts_io": "no IOCB_NOIO"}
            assert s.residency_method == "mincore" and expect[kernel] in s.residency_fallback
            assert s.nowait_starts_io is True
        time.sleep(0.02)  # a read left in flight would have landed by now
        assert s.page_cache_bytes() == 0
        layer = s.manifest.moe_layers[1]
        assert s.read_bundle(layer, 4, expert_buffers(s, layer))["cold"] is True
        assert s.read_bundle(layer, 4, expert_buffers(s, layer))["cold"] is False
