"""A copy of a converted model that no page cache holds: how calibrate measures cold reads on a
platform that cannot drop one file's pages (macOS: no POSIX_FADV_DONTNEED).

The expert files are written through uncached descriptors (engine.platform.create_uncached:
F_NOCACHE on macOS), so none of their pages stay cached; the store then reads them uncached
(its o_direct mode, F_NOCACHE), so reading them keeps them cold. Every other file is copied
plainly. An uncached write may need an aligned length (O_DIRECT, where the tests run macOS mode
on Linux), so a file's last partial page is appended through a plain descriptor: at most one
page per file is cached."""

from __future__ import annotations

import mmap
import os
import shutil
from pathlib import Path

from calibration.storage_probes import write_all
from engine import platform
from engine.platform import PAGE

CHUNK = 4 << 20


def uncached_copy(model_dir: Path, into: Path) -> Path:
    """Copy `model_dir` (a converted model) to `into` (created), its expert files uncached."""
    from engine.manifest import read_manifest

    manifest = read_manifest(model_dir)
    expert_files = {manifest.layers[i].file for i in manifest.moe_layers}
    shutil.copytree(model_dir, into, ignore=lambda d, names: [
        n for n in names if (Path(d) / n).relative_to(model_dir).as_posix() in expert_files])
    for name in sorted(expert_files):
        _write_uncached(model_dir / name, into / name)
    return into


def _write_uncached(src: Path, dst: Path) -> None:
    p = platform.current()
    dst.parent.mkdir(parents=True, exist_ok=True)
    buf = mmap.mmap(-1, CHUNK)  # page-aligned
    tail = b""
    fd = p.create_uncached(str(dst))
    try:
        with open(src, "rb") as f:
            while n := f.readinto(buf):
                aligned = n // PAGE * PAGE
                with memoryview(buf) as view:
                    write_all(fd, view[:aligned])
                if aligned < n:  # the file's last partial page
                    tail = bytes(buf[aligned:n])
                    break
        p.flush(fd)
    finally:
        os.close(fd)
        buf.close()
    if tail:
        with open(dst, "ab") as f:
            f.write(tail)
