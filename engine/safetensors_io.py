"""safetensors files, read and written without holding a model: headers checked against the
file size before any tensor is touched, and files written front to back from lazily produced
tensors (one evaluated at a time), with each data section 4096-byte aligned for O_DIRECT."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable
from pathlib import Path

from contract.errors import BadInput
from contract.thresholds import ALIGN
from engine.manifest import FileEntry

_ST_DTYPES = {
    "float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64",
    "uint8": "U8", "uint16": "U16", "uint32": "U32", "uint64": "U64",
    "int8": "I8", "int16": "I16", "int32": "I32", "int64": "I64", "bool": "BOOL",
}


def dtype_name(dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


# ---------------------------------------------------------------- safetensors, read side


def read_safetensors_header(path: Path) -> tuple[int, dict]:
    """(data_start, header dict) after checking the file holds every byte the header promises."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise BadInput(f"{path}: truncated: no safetensors header")
            (n,) = struct.unpack("<Q", raw)
            if n > 100_000_000 or 8 + n > size:
                raise BadInput(f"{path}: truncated or not a safetensors file (header {n} bytes)")
            header = json.loads(f.read(n))
    except OSError as err:
        raise BadInput(f"{path}: cannot read ({err.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise BadInput(f"{path}: not a safetensors file (bad header)") from None
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
              default=0)
    if 8 + n + end > size:
        raise BadInput(f"{path}: truncated: {size} bytes, header needs {8 + n + end}")
    return 8 + n, header


# ---------------------------------------------------------------- safetensors, write side


class _HashingWriter:
    """A file written front to back with its sha256 computed on the way."""

    def __init__(self, path: Path):
        self.f = open(path, "wb")
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data) -> None:
        mv = memoryview(data).cast("B")
        self.f.write(mv)
        self.sha.update(mv)
        self.size += mv.nbytes

    def close(self) -> FileEntry:
        self.f.close()
        return FileEntry(self.size, self.sha.hexdigest())


def write_safetensors(
    path: Path, specs: list[tuple[str, tuple[int, ...], str]], produce: Callable, metadata=None
) -> tuple[FileEntry, dict[str, int]]:
    """Write tensors `specs` = [(name, shape, dtype name)] in order; `produce(name)` returns the
    (lazy) mx.array for a name when its turn comes. Returns (file entry, absolute offsets)."""
    import mlx.core as mx

    header: dict = {"__metadata__": metadata or {"format": "mlx"}}
    offsets, pos = {}, 0
    for name, shape, dt in specs:
        nbytes = nbytes_of(shape, dt)
        header[name] = {"dtype": _ST_DTYPES[dt], "shape": list(shape),
                        "data_offsets": [pos, pos + nbytes]}
        offsets[name] = pos
        pos += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % ALIGN)
    data_start = 8 + len(blob)
    out = _HashingWriter(path)
    try:
        out.write(struct.pack("<Q", len(blob)))
        out.write(blob)
        for name, shape, dt in specs:
            arr = mx.contiguous(produce(name))
            mx.eval(arr)
            if tuple(arr.shape) != tuple(shape) or dtype_name(arr.dtype) != dt:
                raise AssertionError(f"{name}: produced {arr.shape} {arr.dtype}, "
                                     f"header says {shape} {dt}")
            # NumPy's buffer protocol has no bfloat16: write its bytes as uint16
            out.write(memoryview(arr.view(mx.uint16) if dt == "bfloat16" else arr))
            del arr
    finally:
        entry = out.close()
    return entry, {k: data_start + v for k, v in offsets.items()}


def nbytes_of(shape, dt: str) -> int:
    n = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "uint8": 1, "uint16": 2,
         "uint32": 4, "uint64": 8, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "bool": 1}[dt]
    for d in shape:
        n *= int(d)
    return n
