"""The independent reference of the math contract: NumPy float64 dequantization of the stored
experts (affine, or the microscaling modes mxfp4/mxfp8) and a per-token, per-expert loop over
the experts' activation. Shares no code with the engine."""

from __future__ import annotations

import numpy as np

# FP4 E2M1: sign, 2 exponent bits, 1 mantissa bit (OCP microscaling spec)
FP4_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def _fp8_e4m3(codes: np.ndarray) -> np.ndarray:
    """FP8 E4M3 (bias 7, no infinities, 0x7F/0xFF NaN) code -> value."""
    c = codes.astype(np.int64)
    sign = np.where(c & 0x80, -1.0, 1.0)
    exp, man = (c >> 3) & 0xF, c & 0x7
    val = np.where(exp == 0, man / 8 * 2.0 ** -6, (1 + man / 8) * 2.0 ** (exp - 7))
    return sign * val


def _unpack(q: np.ndarray, bits: int) -> np.ndarray:
    """Each uint32 packs 32/bits codes, low bits first."""
    per = 32 // bits
    shifts = np.arange(per, dtype=np.uint64) * bits
    vals = (q.astype(np.uint64)[..., None] >> shifts) & ((1 << bits) - 1)
    return vals.reshape(*q.shape[:-1], q.shape[-1] * per)


def dequantize(q: np.ndarray, scales: np.ndarray, biases: np.ndarray | None, group: int = 64,
               bits: int = 4, mode: str = "affine") -> np.ndarray:
    """w = code * scale + bias per group (affine); w = fp_value(code) * 2^(scale - 127) with an
    E8M0 scale byte per group of 32 (mxfp4, mxfp8)."""
    codes = _unpack(q, bits)
    if mode == "affine":
        vals, s = codes.astype(np.float64), _float(scales)
    elif mode in ("mxfp4", "mxfp8"):
        vals = FP4_E2M1[codes] if mode == "mxfp4" else _fp8_e4m3(codes)
        s = np.exp2(scales.astype(np.float64) - 127)
    else:
        raise ValueError(f"no reference for mode {mode!r}")
    g = vals.reshape(*vals.shape[:-1], -1, group) * s[..., None]
    if mode == "affine":
        g = g + _float(biases)[..., None]
    return g.reshape(vals.shape)


def _float(a: np.ndarray) -> np.ndarray:
    """float64 of a float array; uint16 arrays are bfloat16 bit patterns (NumPy has no bf16)."""
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def _activation(g: np.ndarray, u: np.ndarray, name: str) -> np.ndarray:
    if name == "swiglu":  # silu(g) * u
        return g / (1 + np.exp(-g)) * u
    if name == "swiglu_oai":  # gpt_oss: gate clipped above, up clipped both ways, (u + 1)
        g, u = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
        return (u + 1) * g / (1 + np.exp(-1.702 * g))
    raise ValueError(name)


def swiglu_reference(x: np.ndarray, inds: np.ndarray, tensors: dict, group: int = 64,
                     bits: int = 4, mode: str = "affine", activation: str = "swiglu"
                     ) -> np.ndarray:
    """y[t, j] = down_e(act(gate_e(x_t), up_e(x_t))) for e = inds[t, j], in float64, each
    projection plus its bias when the file has one."""
    projs = ("gate_proj", "up_proj", "down_proj")
    w = {p: dequantize(tensors[f"{p}.weight"], tensors[f"{p}.scales"],
                       tensors.get(f"{p}.biases"), group, bits, mode) for p in projs}
    b = {p: _float(tensors[f"{p}.bias"]) if f"{p}.bias" in tensors else None for p in projs}

    def lin(p, e, v):
        y = w[p][e] @ v
        return y if b[p] is None else y + b[p][e]

    x = x.astype(np.float64)
    out = np.zeros((*inds.shape, x.shape[-1]))
    for t in range(inds.shape[0]):
        for j, e in enumerate(inds[t]):
            out[t, j] = lin("down_proj", e, _activation(lin("gate_proj", e, x[t]),
                                                       lin("up_proj", e, x[t]), activation))
    return out


_NP_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U32": np.uint32,
              "U8": np.uint8, "U16": np.uint16}


def read_tensors(path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file from its bytes (bfloat16 as its uint16 bit patterns,
    which `_float` decodes), with nothing but json and NumPy; a bundled layer file's per-expert
    slices stacked back (layer_reference.stack_experts)."""
    import json
    import struct

    from layer_reference import stack_experts

    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        lo, hi = t["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + lo:8 + n + hi],
                                  dtype=_NP_DTYPES[t["dtype"]]).reshape(t["shape"])
    return stack_experts(out)
