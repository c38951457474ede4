"""Expert files are trusted only while they are the files that were verified.

At load the manifest's sizes (and sha256, engine.manifest.verify_files) were checked. A file
changed afterwards, in place or replaced, would feed garbage into every expert read from it,
and the experts already loaded (staged slots, hot rows) would keep serving the old bytes. The
watch keeps each expert file's identity as verified (size, modification time, inode, device)
and `check()` compares it with a `stat` (microseconds per file, so it runs around every
request). A file whose identity moved is hashed against the manifest:
  - it matches (restored, or rewritten with the same bytes): it is trusted again, reopened if
    it is a new inode, and its loaded experts are dropped (they may have been read while it
    was wrong);
  - it does not: its loaded experts are dropped and `ExpertFileChanged` names it; the same
    identity is refused again without another hash, until the file changes once more.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from contract.errors import IOFault
from engine.manifest import Manifest, sha256_file

Identity = tuple[int, int, int, int]  # size, mtime_ns, inode, device


class ExpertFileChanged(IOFault):
    """An expert file is no longer the file that was verified."""


def identity(path: str) -> Identity | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev


class FileWatch:
    def __init__(self, manifest: Manifest, paths: dict[int, str],
                 forget: Callable[[set[int]], None], reopen: Callable[[int], None]):
        """`paths`: layer -> its expert file; `forget(layers)` drops their loaded experts;
        `reopen(layer)` opens a replaced file again."""
        self.manifest, self.paths, self.forget, self.reopen = manifest, paths, forget, reopen
        self.verified = {layer: identity(p) for layer, p in paths.items()}
        self.refused: dict[int, Identity | None] = {}  # layer -> the identity that failed

    def check(self) -> None:
        """Raise ExpertFileChanged when an expert file is not the verified one."""
        moved = {layer: now for layer, p in self.paths.items()
                 if (now := identity(p)) != self.verified[layer]}
        if not moved:
            return
        self.forget(set(moved))
        bad = []
        for layer, now in sorted(moved.items()):
            if now is not None and self.refused.get(layer) != now and self._matches(layer):
                if now[2:] != (self.verified[layer] or (0, 0, 0, 0))[2:]:
                    self.reopen(layer)
                self.verified[layer] = now
                self.refused.pop(layer, None)
            else:
                self.refused[layer] = now
                bad.append((layer, now))
        if bad:
            layer, now = bad[0]
            raise ExpertFileChanged(self._describe(layer, now)
                                    + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))

    def _entry(self, layer: int):
        return self.manifest.files[self.manifest.layers[layer].file]

    def _matches(self, layer: int) -> bool:
        try:
            return sha256_file(self.manifest.path(self.manifest.layers[layer].file)) == \
                self._entry(layer).sha256
        except OSError:
            return False

    def _describe(self, layer: int, now: Identity | None) -> str:
        name = self.manifest.layers[layer].file
        if now is None:
            return f"{name}: expert file of layer {layer} is gone since it was verified"
        size = self._entry(layer).size
        what = (f"its size is {now[0]} bytes, {size} expected" if now[0] != size
                else "its sha256 no longer matches the manifest")
        return (f"{name}: expert file of layer {layer} changed since it was verified ({what}); "
                "its loaded experts were dropped, and it is used again once it matches")
