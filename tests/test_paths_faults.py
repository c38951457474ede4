"""Bad input for the streaming paths: budgets below one layer's working set name the minimum;
a read error (EIO at the syscall, or a file truncated under a running engine) fails the
request with an error naming layer, expert and file, and the next request works."""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from pathlib import Path

import pytest

from contract.engine_config import EngineConfig
from contract.errors import BadInput
from engine.generate import generate
from engine.loader import load_streaming
from engine.manifest import read_manifest
from engine.store import ExpertReadError

PROMPT = "import os\nimport sys\n\ndef main(argv):"


class Fault:
    """os.preadv (and libc's preadv, the store's copy of a small warm bundle holding the GIL)
    that fails with EIO on the first read of one file once armed."""

    def __init__(self, monkeypatch, path: Path):
        self.ino = os.stat(path).st_ino
        self.armed = False
        self.fired = 0
        real = os.preadv

        lock = threading.Lock()  # reader threads and the main thread read concurrently

        def preadv(fd, buffers, offset, *args):
            if self.armed and os.fstat(fd).st_ino == self.ino:
                with lock:
                    fire, self.armed = self.armed, False
                    self.fired += fire
                if fire:
                    raise OSError(errno.EIO, os.strerror(errno.EIO))
            return real(fd, buffers, offset, *args)

        monkeypatch.setattr(os, "preadv", preadv)
        from engine import range_reads

        libc = range_reads._preadv_holding_gil

        def libc_preadv(fd, iov, n, offset):
            if self.armed and os.fstat(fd).st_ino == self.ino:
                with lock:
                    fire, self.armed = self.armed, False
                    self.fired += fire
                if fire:
                    ctypes.set_errno(errno.EIO)
                    return -1
            return libc(fd, iov, n, offset)

        monkeypatch.setattr(range_reads, "_preadv_holding_gil", libc_preadv)


@pytest.mark.parametrize("preset,phase", [
    ("on-demand", "decode"), ("hot", "decode"), ("staged", "decode"), ("staged", "prefill"),
])
def test_eio_fails_request_names_it_engine_survives(preset, phase, tiny_random_converted,
                                                    monkeypatch):
    m = read_manifest(tiny_random_converted)
    layer = m.moe_layers[2]
    file = tiny_random_converted / m.layers[layer].file
    eng = load_streaming(tiny_random_converted, config=EngineConfig.from_preset(preset))
    model, tok, store = eng.model, eng.tokenizer, eng.store
    ref = generate(model, tok, PROMPT, 12, stop_at_eos=False, runtime=eng.runtime).tokens
    fault = Fault(monkeypatch, file)
    store.drop_page_cache()  # so that warm slots / LRU rows are not the only copy read

    def arm(step, ph, tokens):
        if ph == phase and (phase == "prefill" or step > 3):
            fault.armed = fault.fired == 0

    if preset == "hot":  # a fresh, empty LRU would not read on decode otherwise: make room
        eng.runtime.hot.clear()
    with pytest.raises(ExpertReadError) as err:
        for _ in range(3):  # slots / LRU rows may be warm for a while: keep decoding
            generate(model, tok, PROMPT + " " * _, 24, stop_at_eos=False, runtime=eng.runtime,
                     on_step_start=arm)
    msg = str(err.value)
    assert str(file) in msg and f"layer {layer}" in msg and "Input/output error" in msg
    assert ("whole layer" if phase == "prefill" and preset != "on-demand" else "expert ") in msg
    assert fault.fired == 1
    again = generate(model, tok, PROMPT, 12, stop_at_eos=False, runtime=eng.runtime).tokens
    assert again == ref
    eng.close()


def test_truncated_file_under_running_engine(tiny_random_converted, model_copy):
    root = model_copy(tiny_random_converted)
    m = read_manifest(root)
    layer = m.moe_layers[1]
    file = root / m.layers[layer].file
    eng = load_streaming(root, config=EngineConfig.from_preset("staged"))
    model, tok = eng.model, eng.tokenizer
    ref = generate(model, tok, PROMPT, 8, stop_at_eos=False, runtime=eng.runtime).tokens
    data = file.read_bytes()
    os.truncate(file, len(data) // 3)
    try:
        with pytest.raises(ExpertReadError, match=rf"{file}: read of layer {layer} .*short read"):
            generate(model, tok, PROMPT, 8, stop_at_eos=False, runtime=eng.runtime)
    finally:
        file.write_bytes(data)
    assert generate(model, tok, PROMPT, 8, stop_at_eos=False, runtime=eng.runtime).tokens == ref
    eng.close()


def test_budgets_below_working_set_name_the_minimum(tiny_random_converted):
    m = read_manifest(tiny_random_converted)
    need = m.top_k * m.bundle_bytes
    with pytest.raises(BadInput, match=f"page-cache budget {need - 1} bytes .*minimum {need}"):
        load_streaming(tiny_random_converted,
                       config=EngineConfig.from_preset("staged", page_cache_budget=need - 1))
    with pytest.raises(BadInput, match=f"hot LRU budget 100 bytes .*minimum {need} bytes"):
        load_streaming(tiny_random_converted, config=EngineConfig.from_preset("hot",
                                                                             hot_bytes=100))
    with pytest.raises(BadInput, match="staged headroom 1 is too small for lead 1: minimum 4"):
        load_streaming(tiny_random_converted,
                       config=EngineConfig.from_preset("staged", lead=1, staged_headroom=1))


def test_cli_budget_error_is_one_line(tiny_random_converted, ssdmoe):
    r = ssdmoe("generate", str(tiny_random_converted), "--prompt", "x", "--preset", "hot",
               "--page-cache-mb", "0.01")
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "minimum" in r.stderr and "Traceback" not in r.stderr
