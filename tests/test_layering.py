"""Layers point one way: the error types live in a leaf (`contract`) that imports nothing of
ours, every package imports only the layers below it (the CLI at the top), no module imports
one that imports it back (the import graph of every module has no circle), the server sits
above the engine (nothing below imports it)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = ("contract", "engine", "sim", "traces", "ssdmoe_cli", "validation", "server",
        "calibration", "advise")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module.split(".")[0])
    return out


# What each package may import of ours (itself included): the layers below it.
ALLOWED = {
    "contract": {"contract"},
    "traces": {"contract", "traces"},
    "engine": {"contract", "traces", "engine"},
    "sim": {"contract", "traces", "sim"},
    "server": {"contract", "traces", "engine", "server"},
    "calibration": {"contract", "traces", "engine", "sim", "calibration"},
    "validation": {"contract", "traces", "engine", "sim", "calibration", "validation"},
    "advise": {"contract", "traces", "sim", "advise"},  # the simulator's user: no MLX
    "ssdmoe_cli": set(OURS),
}


def _modules() -> dict[str, Path]:
    out = {}
    for package in OURS:
        for f in (ROOT / package).rglob("*.py"):
            parts = f.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _module_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ours that `name` imports anywhere in it (inside functions and
    TYPE_CHECKING blocks too): each import resolved to the deepest module that exists."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    wanted = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            wanted |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            wanted.add(base)
            wanted |= {f"{base}.{a.name}" for a in node.names}
    found = set()
    for w in wanted:
        while w and w not in modules:
            w = w.rpartition(".")[0]
        if w and w != name:
            found.add(w)
    return found


def test_every_package_imports_only_the_layers_below_it():
    assert set(ALLOWED) == set(OURS)
    for package in OURS:
        for f in sorted((ROOT / package).rglob("*.py")):
            mine = _imports(f) & set(OURS)
            assert mine <= ALLOWED[package], (f, mine - ALLOWED[package])


def test_the_import_graph_has_no_circle():
    modules = _modules()
    graph = {m: _module_imports(m, f, modules) for m, f in modules.items()}
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        if m in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(m):] + [m]))
        if m in done:
            return
        for n in sorted(graph[m]):
            if not (m.startswith(n + ".") and n in modules):  # a module's own package
                visit(n, path + [m])
        done.add(m)

    for m in sorted(graph):
        visit(m, [])


def test_contract_is_a_leaf():
    """The contract (errors, thresholds, EngineConfig) imports nothing of ours but itself, and
    no MLX or SimPy: engine and simulator both stand on it."""
    files = sorted((ROOT / "contract").glob("*.py"))
    assert files
    for f in files:
        assert not _imports(f) & (set(OURS) - {"contract"} | {"mlx", "simpy"}), f


def test_engine_and_simulator_share_one_vocabulary():
    """What both sides must agree on is defined once: the sim's load sources are the trace
    schema's, the hot budget fraction and the paths that sync at build are the contract's,
    and the sim holds no copy of either."""
    import contract.engine_config as contract_config
    import sim.compare
    import sim.main_thread
    import traces.schema as schema

    sources = (sim.main_thread.DEMAND, sim.main_thread.PREFETCH, sim.main_thread.WHOLE_LAYER)
    assert sources == schema.LOAD_SOURCES
    assert sim.compare.HOT_FRACTION is contract_config.HOT_FRACTION
    assert sim.compare.SYNC_AT_BUILD is contract_config.SYNC_AT_BUILD
    source = (ROOT / "sim" / "compare.py").read_text()
    assert "HOT_FRACTION = " not in source and "frozenset(" not in source
    import contract.thresholds as thresholds
    import engine.safetensors_io
    import sim.model_profile

    assert engine.safetensors_io.ALIGN is thresholds.ALIGN  # the layout's alignment, once
    assert sim.model_profile.PAGE is thresholds.PAGE


def test_nothing_below_the_cli_imports_it():
    for package in ("contract", "engine", "sim", "traces", "validation", "server"):
        for f in sorted((ROOT / package).rglob("*.py")):
            assert "ssdmoe_cli" not in _imports(f), f


def test_the_server_sits_above_the_engine():
    for package in ("contract", "engine", "sim", "traces", "validation"):
        for f in sorted((ROOT / package).rglob("*.py")):
            assert "server" not in _imports(f), f
    protocol = _imports(ROOT / "server" / "protocol.py")
    assert not protocol & {"mlx", "engine"}  # the API's shapes need no MLX


def test_an_io_fault_is_not_bad_input():
    from contract.errors import BadInput, IOFault
    from engine.store import ExpertReadError

    assert issubclass(ExpertReadError, IOFault) and not issubclass(ExpertReadError, BadInput)


def test_io_fault_during_capture_is_one_line_and_keeps_the_trace(tiny_random_converted,
                                                                 tmp_path, ssdmoe, monkeypatch):
    import errno
    import json
    import os

    real = os.preadv
    calls = [0]

    def failing(fd, buffers, offset, *flags):
        calls[0] += 1
        if calls[0] > 40:  # some reads succeed first: a fault mid-run
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "preadv", failing)
    out = tmp_path / "t"
    r = ssdmoe("capture", str(tiny_random_converted), "--out", str(out), "--max-tokens", "8",
               "--no-progress")
    assert r.returncode == 2, r.stderr
    assert "read of layer" in r.stderr and os.strerror(errno.EIO) in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    run = json.loads((out / "run.json").read_text())
    assert run["complete"] is False  # what was captured is kept, marked incomplete


def test_engine_and_simulator_import_neither_each_other():
    """The engine and the simulator share the contract, not each other's modules. What needs
    both (calibration, validation, the CLI) sits above them, and the simulator does no I/O of
    its own measuring: the storage probes are calibration's."""
    for package, other in (("engine", "sim"), ("sim", "engine"), ("sim", "mlx")):
        importers = [f.relative_to(ROOT).as_posix() for f in (ROOT / package).rglob("*.py")
                     if other in _imports(f)]
        assert importers == [], (package, other, importers)
    for package in ("contract", "engine", "sim", "traces", "server"):
        for f in sorted((ROOT / package).rglob("*.py")):
            assert not _imports(f) & {"calibration", "validation"}, f
    assert not _imports(ROOT / "calibration" / "profile_values.py") & {"os", "mmap", "threading"}
