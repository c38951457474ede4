"""Byte-range reads of expert bundles into preallocated buffers. No MLX here: callers pass
writable NumPy views (`np.asarray(mx_array)` is a zero-copy writable view of MLX memory), and
`os.preadv` writes straight into them.

- Every OS-specific call goes through engine.platform (Linux; macOS: F_RDAHEAD, F_NOCACHE, no
  RWF_NOWAIT, no per-file page dropping). Below, Linux's names.
- A load is one vectored read (`preadv`) per contiguous run of its ranges (engine.read_plan):
  a bundle of the bundled layout is one run, so one system call and, cold, one device request,
  its iovecs the destination rows. Buffered reads (readahead off via POSIX_FADV_RANDOM so a read
  caches only its own pages) or O_DIRECT reads (page-aligned bounce buffer, then one copy per
  buffer; MLX buffers are not page aligned). If the filesystem refuses O_DIRECT the store
  falls back to buffered reads and says why (`direct_fallback`, plus a warning).
- What a read costs the reading thread, kept small because a reader's Python waits for the
  GIL while the main thread builds graphs: a ReadTarget (a slot or pool row) is checked once
  and keeps its views in file order and as a C iovec array; a bundle known to be in the page
  cache and no larger than INLINE_WARM_BYTES is copied by libc's preadv holding the GIL (a
  few microseconds; os.preadv lets go of it, and taking it back waits for the main thread);
  every other read lets go of it while the kernel works.
- Each load is classed cold (some byte had to come from the disk) or warm (every byte was in the
  page cache). `residency_method` says how:
  - "rwf_nowait" (buffered reads on Linux, where the flag starts no I/O): each run is
    first read with `preadv(..., RWF_NOWAIT)`, which copies only what is already cached. A
    full read is warm and is the read itself (one syscall per run); EAGAIN or a short read
    makes the load cold and the rest of that run (and the later runs) is read blocking.
    RWF_NOWAIT may also refuse for reasons other than residency (a page locked for a moment),
    so it can only over-count cold loads, never under-count them.
  - "mincore" (O_DIRECT, platforms without os.RWF_NOWAIT, filesystems that refuse it, or set by
    hand to force it): classed BEFORE reading, with `mincore` on a never-touched PROT_READ
    mapping of the file (an untouched mapping maps no pages, so it neither warms the cache nor
    pins pages against POSIX_FADV_DONTNEED); under O_DIRECT the class says whether the bytes
    WOULD have been warm. A bundle's slices touch, so its residency is one mincore call over
    their span (each page once), holding the GIL (engine.platform); other ranges share a
    call when at most MERGE_GAP_PAGES pages apart, into a per-thread preallocated vector.
  An O_DIRECT store that falls back to buffered reads mid-run keeps mincore.
  At open, a buffered store checks RWF_NOWAIT (`_nowait_refusal`): each file's cached first
  page must be read, and one uncached page must be refused with no read started (IOCB_NOIO).
  Some kernels start it (Linux 6.18 does: the refused page lands soon after) and then a fast
  device can answer within the call, so a cold read looks warm: there, and wherever the flag
  is refused or missing, the store classes by mincore; `residency_fallback` says why,
  `nowait_starts_io` what the probe saw.
  A failed mincore is ResidencyUnknown, never "nothing resident": a load it classes counts cold.
- Page-cache budget: the expert bytes this store has read are kept within `page_cache_budget`
  bytes by dropping the least recently read bundles with POSIX_FADV_DONTNEED (ranges rounded
  out to whole pages). With a budget, the store drops the expert files' pages when it opens,
  so the run starts from a known state.
- Every load yields a dict with the keys of traces.schema.LOAD_COLUMNS, passed to `on_load`.
"""

from __future__ import annotations

import errno
import os
import threading
import time
import warnings
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from contract import eviction
from contract.errors import BadInput, IOFault
from contract.thresholds import INLINE_WARM_BYTES
from engine import platform
from engine.manifest import LayerEntry, Manifest
from engine.native_reads import MAX_IOV as NATIVE_MAX_IOV
from engine.page_cache_budget import PageCacheBudget
from engine.platform import PAGE, ResidencyProbe, map_for_residency, unmap
from engine.range_reads import (
    DirectRefused,
    RangeReadError,
    aligned_span,
    bounce_buffer,
    iovec_array,
    read_buffered,
    read_direct,
    read_nowait,
    read_warm,
)
from engine.read_plan import IOV_MAX, ReadTarget, Run, plan
from traces.schema import DEMAND, WHOLE_LAYER, WHOLE_LAYER_EXPERT

LoadCallback = Callable[[dict], None]

class ExpertReadError(IOFault):
    """A failed or short expert read; the message names layer, expert and file."""


class ResidencyUnknown(IOFault):
    """mincore failed on an expert file: which of its pages are cached is not known."""


# How long the open-time probe waits for the read a refused RWF_NOWAIT may have started (one
# page: far longer than a page read takes, to allow for a busy disk): it drops the page again
# once it lands.
NOWAIT_IO_WAIT_S = 0.1


def _copy_keeps_gil(run: Run) -> bool:
    """A copy out of the page cache that keeps the GIL: into a ReadTarget's iovecs, no longer
    than INLINE_WARM_BYTES (a few microseconds; letting go of the GIL and taking it back
    would wait for the main thread)."""
    return run.iovecs is not None and run.length <= INLINE_WARM_BYTES


@dataclass(frozen=True)
class _Bundle:
    """Where one expert's bundle lies in its layer file (cached: do not modify)."""

    ranges: list[tuple[int, int]]  # (offset, length) of each tensor's slice, in file order
    spans: list[tuple[int, int]]  # the ranges joined where they touch: one in the bundled layout
    nbytes: int  # the slices' bytes (the padding between bundles not counted)


@dataclass
class _File:
    path: str
    size: int
    fd: int  # buffered
    dfd: int  # O_DIRECT, -1 when not used
    addr: int  # base of the untouched PROT_READ mapping used for mincore (0: none)


@dataclass
class NativeRead:
    """One bundle's read as a native job takes it (ExpertStore.native_read)."""

    file: _File
    run: Run
    iovecs: object  # the run's buffers as a C iovec array
    ranges: list[tuple[int, int]]  # what the load covers (the row, the budget)
    views: list[np.ndarray]  # the destination buffers, in file order
    drops: list[tuple[int, int, int]]  # the budget's victims (fd, offset, length)


NATIVE_THREAD = "native"  # the load rows' thread of a native read


class ExpertStore:
    def __init__(
        self,
        manifest: Manifest,
        o_direct: bool = False,
        page_cache_budget: int | None = None,
        on_load: LoadCallback | None = None,
        cache_policy: str = eviction.DEFAULT,
    ):
        self.manifest = manifest
        self.on_load = on_load
        # called on the reading thread as each read ends, inside its started..finished span
        # (calibration's stall probe holds reads there: a slower device, the device left out)
        self.read_hook: Callable[[], None] | None = None
        # check each cold bundle read against the manifest's crc32 (where it has them): a
        # file changed underneath or bad bytes from the device fail the read, not the reply
        self.verify_cold = False
        if page_cache_budget is not None:
            platform.require_page_drop("page-cache budget")
        self.platform = platform.current()
        self._nowait = self.platform.rwf_nowait
        self.direct = o_direct
        self.direct_fallback: str | None = None
        self._local = threading.local()  # per-thread O_DIRECT bounce buffer
        self._probe = ResidencyProbe()  # mincore (engine.platform)
        self.budget = PageCacheBudget(page_cache_budget, self.platform.drop_pages, PAGE,
                                      cache_policy) if page_cache_budget is not None else None
        self._files: dict[int, _File] = {}
        self.nowait_starts_io: bool | None = None  # None: not probed (_nowait_starts_no_io)
        self._bundles: dict[tuple[int, int], _Bundle] = {}  # _bundle's cache
        self._slices: dict[int, tuple[tuple[str, int], ...]] = {}  # _views' cache
        self.iov_max = IOV_MAX  # iovecs per vectored read (the kernel's limit)
        for layer, entry in manifest.layers.items():
            self._files[layer] = self._open(str(manifest.path(entry.file)))
        # "rwf_nowait" | "mincore" (see the module docstring); set to "mincore" to force it.
        self.residency_fallback: str | None = self._nowait_refusal()
        self.residency_method = "mincore" if self.residency_fallback else "rwf_nowait"
        if page_cache_budget is not None:
            self.drop_page_cache()

    # ------------------------------------------------------------ files

    def _open(self, path: str) -> _File:
        try:
            fd = self.platform.open_buffered(path)
        except OSError as err:
            raise BadInput(f"{path}: cannot open ({err.strerror})") from None
        size = os.fstat(fd).st_size
        dfd = -1
        if self.direct:
            try:
                dfd = self.platform.open_uncached(path)
            except OSError as err:
                self._no_direct(f"uncached open ({self.platform.uncached}) of {path} failed: "
                                f"{err.strerror}")
        return _File(path, size, fd, dfd, map_for_residency(fd, size))

    def _nowait_refusal(self) -> str | None:
        """None when an RWF_NOWAIT read tells cached from uncached, else why it can't (then
        mincore classes). Each file's first page, when cached, must be read without waiting.
        One uncached page (the files share a directory, so a filesystem; page 0 of the first
        file, dropped if cached) must be refused AND its read not started (IOCB_NOIO): where
        the flag starts the read, a fast device can answer within the call, and a cold read
        comes back looking warm (reports/store/nowait_probe.py measured it). The probe waits
        for a started read to land and drops the page again: it leaves nothing in flight (a
        read in flight survives a drop unseen by mincore, not being up to date yet)."""
        if self.direct:
            return "O_DIRECT reads bypass the page cache"
        if self._nowait is None:
            return f"RWF_NOWAIT is missing on this platform ({self.platform.name})"
        files = [f for f in self._files.values() if f.size]
        for f in files:
            if not f.addr:
                return f"{f.path}: no mapping to check RWF_NOWAIT against mincore"
            try:
                resident, total = self._resident_pages(f, [(0, 1)])
            except ResidencyUnknown as err:
                return str(err)
            if not total:
                return f"{f.path}: mincore failed"
            if resident:
                try:
                    if self._nowait_first_byte(f) != 1:
                        return f"{f.path}: RWF_NOWAIT refused a resident page"
                except OSError as err:
                    return f"RWF_NOWAIT read of {f.path} failed: {err.strerror}"
        for f in files:
            self.platform.flush(f.fd)  # a dirty page cannot be dropped
            self.platform.drop_pages(f.fd, 0, PAGE)
            if not self._resident_pages(f, [(0, 1)])[0]:
                return self._nowait_starts_no_io(f)
        # A fresh file's pages can stay a while after a drop (ext4 frees a written page once
        # its journal commit is done): untested, the flag is not trusted.
        return "no first page could be dropped to check that RWF_NOWAIT starts no read" \
            if files else None

    def _nowait_starts_no_io(self, f: _File) -> str | None:
        """None when RWF_NOWAIT refuses file `f`'s uncached first page and starts no read of
        it; else why not. Sets `nowait_starts_io`."""
        try:
            n = self._nowait_first_byte(f)
        except OSError as err:
            return f"RWF_NOWAIT read of {f.path} failed: {err.strerror}"
        landed = n == 1 or self._await_first_page(f)
        self.platform.drop_pages(f.fd, 0, PAGE)
        self.nowait_starts_io = landed
        if n == 1:
            return f"{f.path}: RWF_NOWAIT read a non-resident page"
        if landed:
            return (f"{f.path}: a refused RWF_NOWAIT read started the page's read (no "
                    "IOCB_NOIO): a fast device can answer within the call, classing a cold "
                    "read warm")
        return None

    def _nowait_first_byte(self, f: _File) -> int:
        """Bytes an RWF_NOWAIT read of the file's first byte got (0: refused, EAGAIN)."""
        try:
            return os.preadv(f.fd, [bytearray(1)], 0, self._nowait)
        except OSError as err:
            if err.errno != errno.EAGAIN:
                raise
            return 0

    def _await_first_page(self, f: _File) -> bool:
        """True when page 0, refused by RWF_NOWAIT, lands in the page cache anyway within
        NOWAIT_IO_WAIT_S."""
        deadline = time.perf_counter() + NOWAIT_IO_WAIT_S
        while time.perf_counter() < deadline:
            if self._resident_pages(f, [(0, 1)])[0]:
                return True
            time.sleep(0.0005)
        return False

    def _no_direct(self, reason: str) -> None:
        if self.direct:
            self.direct = False
            self.direct_fallback = reason
            warnings.warn(f"O_DIRECT unavailable, using buffered reads: {reason}", stacklevel=3)

    def close(self) -> None:
        for f in self._files.values():
            self._close(f)
        self._files = {}

    @staticmethod
    def _close(f: _File) -> None:
        unmap(f.addr, f.size)
        os.close(f.fd)
        if f.dfd >= 0:
            os.close(f.dfd)

    def file_path(self, layer: int) -> str:
        return self._files[layer].path

    def reopen(self, layer: int) -> None:
        """Open the layer's file again (it was replaced: a new inode); no read in flight."""
        old = self._files[layer]
        self._files[layer] = self._open(old.path)
        self._close(old)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ layout helpers

    def layer(self, layer: int) -> LayerEntry:
        return self.manifest.layers[layer]

    def expert_shapes(self, layer: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """{tensor name: (per-expert shape, dtype name)} for the layer's tensors, in file order."""
        return {n: (tuple(t.shape[1:]), t.dtype)
                for n, t in self.manifest.layers[layer].tensors.items()}

    def bundle_ranges(self, layer: int, expert: int) -> list[tuple[int, int]]:
        return list(self._bundle(layer, expert).ranges)

    def _bundle(self, layer: int, expert: int) -> _Bundle:
        """The bundle's ranges and spans, computed once."""
        bundle = self._bundles.get((layer, expert))
        if bundle is None:
            entry = self.manifest.layers[layer]
            ranges = [entry.expert_range(n, expert) for n in entry.tensors]
            spans: list[tuple[int, int]] = []
            for off, length in ranges:
                if spans and spans[-1][0] + spans[-1][1] == off:
                    spans[-1] = (spans[-1][0], spans[-1][1] + length)
                else:
                    spans.append((off, length))
            bundle = _Bundle(ranges, spans, sum(n for _, n in ranges))
            self._bundles[(layer, expert)] = bundle
        return bundle

    def layer_ranges(self, layer: int) -> list[tuple[int, int]]:
        """The byte ranges a whole-layer read covers: one per tensor (stacked), or the span of
        every bundle with the padding between them (bundled)."""
        entry = self.manifest.layers[layer]
        if self.manifest.layout == "stacked":
            return [(t.offset, t.nbytes * t.shape[0]) for t in entry.tensors.values()]
        starts = [t.offset for t in entry.tensors.values()]
        ends = [t.offset + (t.shape[0] - 1) * t.stride + t.nbytes
                for t in entry.tensors.values()]
        return [(min(starts), max(ends) - min(starts))]

    # ------------------------------------------------------------ residency

    def _resident_pages(self, f: _File, ranges: list[tuple[int, int]]) -> tuple[int, int]:
        """(resident pages, total pages) over `ranges` of file `f` (mincore: engine.platform).
        Raises ResidencyUnknown when mincore fails."""
        try:
            return self._probe.resident_pages(f.addr, ranges)
        except OSError as err:
            raise ResidencyUnknown(f"{f.path}: {err.strerror}") from None

    def residency(self, layer: int, expert: int) -> float:
        """Fraction of the bundle's pages in the page cache (1.0 = fully warm)."""
        r, t = self._resident_pages(self._files[layer], self._bundle(layer, expert).spans)
        return r / t if t else 0.0

    def is_cold(self, layer: int, expert: int) -> bool:
        """True when any page of the bundle would come from the disk."""
        r, t = self._resident_pages(self._files[layer], self._bundle(layer, expert).spans)
        return r < t

    def page_cache_bytes(self, layer: int | None = None) -> int:
        """Resident bytes of all expert files (or one layer's; mincore), -1 if unknown."""
        total = 0
        for f in self._files.values() if layer is None else [self._files[layer]]:
            if f.size and not f.addr:
                return -1
            try:
                r, _ = self._resident_pages(f, [(0, f.size)]) if f.size else (0, 0)
            except ResidencyUnknown:
                return -1
            total += r * PAGE
        return total

    def drop_page_cache(self, layer: int | None = None) -> None:
        """Evict the expert files' (or one layer file's) pages: the next reads are cold."""
        files = self._files.values() if layer is None else [self._files[layer]]
        for f in files:
            self.platform.flush(f.fd)  # dirty pages (a fresh conversion) cannot be dropped
            self.platform.drop_pages(f.fd)
        if self.budget is not None:
            self.budget.forget(layer)

    def drop_until_cold(self, layer: int | None = None, tries: int = 5,
                        settle_s: float = 0.05) -> int:
        """Drop, settle, drop again, then check with mincore that nothing stayed resident, a
        few times. A page whose read is in flight (readahead, another thread's read, the read
        a refused RWF_NOWAIT starts) is locked, so a drop keeps it, and not yet up to date, so
        mincore does not count it: it lands after the drop. The settle lets it land first.
        Returns the expert files' resident bytes left (0: cold; -1: unknown)."""
        left = -1
        for i in range(tries):
            self.drop_page_cache(layer)
            time.sleep(settle_s * (i + 1))
            self.drop_page_cache(layer)
            left = self.page_cache_bytes(layer)
            if left <= 0:
                return left
        return left

    # ------------------------------------------------------------ reads

    def read_bundle(
        self,
        layer: int,
        expert: int,
        into: Mapping[str, np.ndarray],
        *,
        source: str = DEMAND,
        thread: str = "main",
        issued_ns: int | None = None,
        waited: bool = True,
        emit: bool = True,
        known_cold: bool = False,
        step: int = -1,
    ) -> dict:
        """Read expert `expert` of `layer` into `into` (tensor name -> writable C-contiguous
        array of exactly that expert's slice size; a ReadTarget when the same buffers take
        many reads): one vectored read per contiguous run of its slices (one in the bundled
        layout). Returns the load row (also sent to `on_load` when `emit`). `known_cold`: a
        `read_bundle_if_warm` found it not cached (the kernel may have started reading it
        since), so the row says cold."""
        bundle = self._bundle(layer, expert)
        views = self._views(layer, expert, into)
        runs = self._bundle_runs(bundle, views, getattr(into, "iovecs", None))
        row = self._load(layer, expert, bundle.ranges, runs, source, thread, issued_ns, waited,
                         emit, cold=True if known_cold else None, step=step,
                         spans=bundle.spans)
        if self.verify_cold and row["cold"]:
            self._check_crc(layer, expert, views)
        return row

    def _check_crc(self, layer: int, expert: int, views: list[np.ndarray]) -> None:
        """Raise ExpertReadError when the bundle just read is not the bytes the manifest's
        crc32 describes (no checksums: nothing to check)."""
        crcs = self.manifest.layers[layer].bundle_crc32
        if not crcs:
            return
        crc = 0
        for view in views:
            crc = zlib.crc32(view.view(np.uint8).reshape(-1), crc)
        if crc != crcs[expert]:
            raise self._fail(self._files[layer], layer, expert,
                             f"crc32 {crc:08x} where the manifest has {crcs[expert]:08x} (the "
                             "file changed, or the device returned bad bytes)")

    def read_bundle_if_warm(self, layer: int, expert: int, into: Mapping[str, np.ndarray], *,
                            source: str = DEMAND, thread: str = "main",
                            issued_ns: int | None = None, step: int = -1) -> dict | None:
        """`read_bundle` when the whole bundle is in the page cache (a copy that cannot block
        on the device); None otherwise, with nothing waited for (`into` may then hold part of
        the bundle: read it again). Never warm under O_DIRECT. The row is not emitted."""
        if self.direct:
            return None
        bundle = self._bundle(layer, expert)

        def runs() -> list[Run]:
            return self._bundle_runs(bundle, self._views(layer, expert, into),
                                     getattr(into, "iovecs", None))

        if self.residency_method == "rwf_nowait":
            started = time.perf_counter_ns()
            f = self._files[layer]
            for run in runs():
                if not self._read_nowait(f, run, layer, expert, finish=False):
                    return None
            return self._row(layer, expert, bundle.ranges, started, issued_ns, source, thread,
                             step=step)
        try:
            r, t = self._resident_pages(self._files[layer], bundle.spans)
        except ResidencyUnknown:
            return None  # not known to be warm
        if r < t:
            return None  # refused before the buffers are looked at, as a cold ask should be
        return self._load(layer, expert, bundle.ranges, runs(), source, thread, issued_ns,
                          False, False, cold=False, step=step)

    def _views(self, layer: int, expert: int, into: Mapping[str, np.ndarray]
               ) -> list[np.ndarray]:
        """`into`'s buffers in the layer file's tensor order (the order of its ranges), each
        checked against its slice; a ReadTarget's only on its first read for the layer."""
        slices = self._slices.get(layer)
        if slices is None:  # (tensor name, bytes of one expert's slice), in file order
            slices = tuple((n, t.nbytes) for n, t in self.manifest.layers[layer].tensors.items())
            self._slices[layer] = slices
        checked = into.checked if isinstance(into, ReadTarget) else None
        if checked is not None and checked[0] == slices:  # layers alike share a target
            return checked[1]
        views = [into[n] for n, _ in slices]
        self._check_buffers(layer, expert, [nbytes for _, nbytes in slices], views)
        if isinstance(into, ReadTarget):
            into.checked, into.iovecs = (slices, views), iovec_array(views)
        return views

    @staticmethod
    def _check_buffers(layer: int, expert: int, lengths: list[int],
                       views: list[np.ndarray]) -> None:
        """Each buffer must be writable, C-contiguous and exactly its range's length."""
        for length, view in zip(lengths, views, strict=True):
            flags = view.flags
            if view.nbytes != length or not flags.c_contiguous or not flags.writeable:
                who = "whole layer" if expert == WHOLE_LAYER_EXPERT else f"expert {expert}"
                raise ValueError(f"layer {layer} {who}: buffer of {view.nbytes} bytes "
                                 f"(contiguous={flags.c_contiguous}) for a {length}-byte range")

    def _bundle_runs(self, bundle: _Bundle, views: list[np.ndarray],
                     iovecs: object = None) -> list[Run]:
        """The vectored reads of a bundle into `views` (checked; `iovecs`: the same as a C
        array, a ReadTarget's): one run straight into them when its slices touch (the bundled
        layout), else engine.read_plan's."""
        if len(bundle.spans) == 1 and len(views) <= self.iov_max:
            return [Run(bundle.spans[0][0], views, bundle.nbytes, iovecs)]
        return self._runs(bundle.ranges, views)

    def _runs(self, ranges: list[tuple[int, int]], views: list[np.ndarray]) -> list[Run]:
        """The vectored reads of `ranges` into `views` (engine.read_plan; checked buffers)."""
        return plan([(off, view) for (off, _), view in zip(ranges, views, strict=True)],
                    iov_max=self.iov_max)

    def read_layer(
        self,
        layer: int,
        into: Mapping[str, np.ndarray],
        *,
        source: str = WHOLE_LAYER,
        thread: str = "main",
        issued_ns: int | None = None,
        waited: bool = True,
        emit: bool = True,
        step: int = -1,
    ) -> dict:
        """Read a layer's experts whole into `into` (name -> [E, ...]): in the bundled layout
        every expert's slices scatter into the stacks, as few vectored reads as IOV_MAX allows;
        in the stacked layout one read per tensor."""
        entry = self.manifest.layers[layer]
        if self.manifest.layout == "stacked":
            segments = [(t.offset, t.nbytes * t.shape[0], into[n])
                        for n, t in entry.tensors.items()]
        else:
            segments = sorted(((t.offset + e * t.stride, t.nbytes, into[n][e])
                               for n, t in entry.tensors.items() for e in range(t.shape[0])),
                              key=lambda s: s[0])
        ranges = [(off, length) for off, length, _ in segments]
        views = [v for _, _, v in segments]
        self._check_buffers(layer, WHOLE_LAYER_EXPERT, [n for _, n in ranges], views)
        runs = self._runs(ranges, views)
        return self._load(layer, WHOLE_LAYER_EXPERT, self.layer_ranges(layer), runs, source,
                          thread, issued_ns, waited, emit, step=step)

    def emit(self, row: dict) -> None:
        if self.on_load is not None:
            self.on_load(row)

    def _load(self, layer, expert, ranges, runs: list[Run], source, thread, issued_ns, waited,
              emit, cold: bool | None = None, step: int = -1,
              spans: list[tuple[int, int]] | None = None):
        """`ranges`: what the load covers (budget, the row; residency over `spans`, the same
        bytes joined where they touch, when given); `runs`: its reads. `cold`: already known
        (checked by the caller), else found out here."""
        f = self._files[layer]
        started = time.perf_counter_ns()
        issued = started if issued_ns is None else issued_ns
        nowait = not self.direct and self.residency_method == "rwf_nowait"
        if cold is None and nowait:
            cold = False  # until a run is not wholly in the page cache
        elif cold is None:
            try:
                r, t = self._resident_pages(f, ranges if spans is None else spans)
                cold = r < t
            except ResidencyUnknown:
                cold = True  # unknown counts cold: like RWF_NOWAIT, over-count, never under
        for run in runs:
            if self.direct and f.dfd >= 0:
                self._read_direct(f, run, layer, expert)
            elif nowait and not cold:
                cold = not self._read_nowait(f, run, layer, expert)
            elif cold is False and _copy_keeps_gil(run):
                self._read_warm(f, run, layer, expert)
            else:
                self._read_buffered(f, run, layer, expert)
        row = self._row(layer, expert, ranges, started, issued, source, thread, cold, waited,
                        step)
        if emit:
            self.emit(row)
        return row

    def _row(self, layer, expert, ranges, started, issued_ns, source, thread, cold=False,
             waited=False, step: int = -1, finished_ns: int | None = None,
             charged: bool = False) -> dict:
        """A finished read's load row (the page-cache budget is charged here, unless
        `charged`). `finished_ns`: when it finished, if not now (a native read's own stamp)."""
        if self.read_hook is not None:
            self.read_hook()
        finished = time.perf_counter_ns() if finished_ns is None else finished_ns
        issued = started if issued_ns is None else issued_ns
        if not self.direct and self.budget is not None and not charged:
            self.budget.charge((layer, expert), self._files[layer].fd, ranges, step)
        return {
            "step": step, "layer": layer, "expert": expert,
            "bytes": sum(length for _, length in ranges), "offset": ranges[0][0],
            "issued_ns": issued, "started_ns": started, "finished_ns": finished,
            "source": source, "cold": cold, "waited": waited,
            "wait_ns": finished - issued if waited else 0, "thread": thread,
        }

    # ------------------------------------------------------------ native reads

    def native_read(self, layer: int, expert: int, into: Mapping[str, np.ndarray]
                    ) -> NativeRead | None:
        """The bundle's one vectored read for engine.native_reads, its buffers checked; None
        where it is not one plain read: O_DIRECT, a bundle of several runs (the stacked
        layout), more iovecs than a native job takes, no C iovecs."""
        if self.direct or self.read_hook is not None:
            return None
        bundle = self._bundle(layer, expert)
        views = self._views(layer, expert, into)
        runs = self._bundle_runs(bundle, views, getattr(into, "iovecs", None))
        if len(runs) != 1:
            return None
        run = runs[0]
        iovecs = run.iovecs if run.iovecs is not None else iovec_array(run.buffers)
        if iovecs is None or len(iovecs) > NATIVE_MAX_IOV:
            return None
        f = self._files[layer]
        # charged when asked for (the victims' pages are dropped by the native thread after
        # the read), not when it lands: the main thread does no page drops
        drops = [] if self.budget is None else self.budget.victims((layer, expert), f.fd,
                                                                  bundle.ranges)
        return NativeRead(f, run, iovecs, bundle.ranges, views, drops)

    def finish_native(self, layer: int, expert: int, read: NativeRead, job, *, source: str,
                      issued_ns: int, step: int = -1, thread: str = NATIVE_THREAD) -> dict:
        """The load row of a native read that is done (`job`: engine.native_reads.Job). A
        failed read raises ExpertReadError naming the file; a short one is finished here, or
        named, as `read_buffered` does. The page-cache budget was charged when the read was
        planned (`native_read`), and its victims dropped by the thread that read (`thread`:
        a native one, or the main thread that ran the job itself)."""
        f, run = read.file, read.run
        finished = job.finished_ns
        if job.result < 0:
            raise self._fail(f, layer, expert, os.strerror(-job.result))
        if job.result != run.length:
            self._read_buffered(f, run, layer, expert, job.result)
            finished = time.perf_counter_ns()
        cold = job.cold != 0  # -1, residency unknown, counts cold (as _load's ResidencyUnknown)
        if self.verify_cold and cold:
            self._check_crc(layer, expert, read.views)
        return self._row(layer, expert, read.ranges, job.started_ns, issued_ns, source,
                         thread, cold, False, step, finished_ns=finished, charged=True)

    def _fail(self, f: _File, layer: int, expert: int, what: str) -> ExpertReadError:
        who = "whole layer" if expert == WHOLE_LAYER_EXPERT else f"expert {expert}"
        return ExpertReadError(f"{f.path}: read of layer {layer} {who} failed: {what}")

    def _read_nowait(self, f: _File, run: Run, layer, expert, finish: bool = True) -> bool:
        """Read a run, first with RWF_NOWAIT. True when the page cache held all of it (one
        syscall); otherwise (`finish`) the rest is read blocking and the load is cold."""
        try:
            n = read_nowait(f.fd, run.offset, run.buffers, self._nowait,
                            run.iovecs if _copy_keeps_gil(run) else None)
        except RangeReadError as err:
            raise self._fail(f, layer, expert, str(err)) from None
        if n == run.length:
            return True
        if finish:
            self._read_buffered(f, run, layer, expert, n)
        return False

    def _read_buffered(self, f: _File, run: Run, layer, expert, done: int = 0) -> None:
        try:
            read_buffered(f.fd, run.offset, run.length, run.buffers, f.size, done)
        except RangeReadError as err:
            raise self._fail(f, layer, expert, str(err)) from None

    def _read_warm(self, f: _File, run: Run, layer, expert) -> None:
        try:
            read_warm(f.fd, run.offset, run.length, run.buffers, run.iovecs, f.size)
        except RangeReadError as err:
            raise self._fail(f, layer, expert, str(err)) from None

    def _read_direct(self, f: _File, run: Run, layer, expert) -> None:
        local = self._local  # one bounce buffer per thread
        local.bounce = bounce_buffer(getattr(local, "bounce", None),
                                     aligned_span(run.offset, run.length))
        try:
            read_direct(f.dfd, run.offset, run.length, run.buffers, f.size, local.bounce)
        except DirectRefused as err:
            self._no_direct(f"O_DIRECT read of {f.path} failed: {err}")
            self._read_buffered(f, run, layer, expert)
        except RangeReadError as err:
            raise self._fail(f, layer, expert, str(err)) from None
