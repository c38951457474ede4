"""Load and validate TOML profiles (scenarios/hardware/*.toml, scenarios/models/*.toml) and
scenarios (scenarios/*.toml), and apply `--set key=value` overrides with type checking.

A scenario file names a hardware and a model profile and sets engine/run keys; optional
[hardware_overrides] and [model_overrides] tables override profile values. Every problem is a
BadInput naming the file (or --set), the key and what is wrong, in one line.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from pathlib import Path
from typing import Any

from contract.engine_config import LEADS
from contract.errors import BadInput
from contract.eviction import DEFAULT as DEFAULT_POLICY
from contract.eviction import POLICIES
from sim.in_decode import InDecode, check_notes
from sim.page_cache import PAGE_CACHE_POLICIES
from sim.scenario import (
    DECODE_PATHS,
    HARDWARE_KEYS,
    HARDWARE_OPTIONAL,
    MODEL_KEYS,
    RENAMED,
    RETIRED,
    ROUTING_KEYS,
    SCENARIO_KEYS,
    Hardware,
    ModelProfile,
    Scenario,
)
from sim.token_bucket import THROTTLE_KINDS

ROOT = Path(__file__).resolve().parents[1] / "scenarios"
OPTIONAL = {"description", "whole_layer_reads", "bundle_reads", "unembed_bytes",
            "device_bundle_bytes", "shared_page_reads", "page_group", "head_read_bytes",
            "lora_bytes", "lora_build_ms", "fill_ms_per_layer", "primitives_per_layer",
            "dispatch_cpu_ms_per_layer", "compute_wait_ms_per_layer", "graph_of",
            *ROUTING_KEYS, *(f"prerouted_{k}" for k in ROUTING_KEYS),
            *HARDWARE_OPTIONAL}

_SIZE = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def _positive(v: Any) -> bool:
    return v > 0


def _nonneg(v: Any) -> bool:
    return v >= 0


def _all_positive(v: list[Any]) -> bool:
    return all(x > 0 for x in v)


def _ascending_sizes(v: list[Any]) -> bool:
    """Distinct sizes > 0 in ascending order: where a rate curve was measured."""
    return _all_positive(v) and v == sorted(set(v))


def _fraction(v: Any) -> bool:
    return 0.0 <= v <= 1.0


# key -> (check, what it must be)
RULES: dict[str, tuple[typing.Callable[[Any], bool], str]] = {
    "ram_gib": (_positive, "must be > 0"),
    "os_reserve_gib": (_nonneg, "must be >= 0"),
    "ssd_bandwidth_gbps": (_positive, "must be > 0"),
    "ssd_latency_ms": (_nonneg, "must be >= 0"),
    "queue_depth": (_positive, "must be >= 1"),
    "load_overhead_ms": (_nonneg, "must be >= 0"),
    "cold_overhead_ms": (_nonneg, "must be >= 0"),
    "memcpy_gbps": (_nonneg, "must be >= 0 (0 = free)"),
    "cpu_factor": (_positive, "must be > 0"),
    "mem_bandwidth_gbps": (_positive, "must be > 0"),
    "compute_tflops": (_positive, "must be > 0"),
    "slot_update_ms": (_nonneg, "must be >= 0"),
    "expert_gbps": (_nonneg, "must be >= 0 (0 = mem_bandwidth_gbps)"),
    "expert_size_bytes": (_ascending_sizes, "must list distinct sizes > 0 in ascending order"),
    "expert_size_gbps": (_all_positive, "must be > 0"),
    "expert_overhead_ms": (_nonneg, "must be >= 0"),
    "sync_overhead_ms": (_nonneg, "must be >= 0"),
    "handoff_ms": (_nonneg, "must be >= 0"),
    "gil_handoff_ms": (_nonneg, "must be >= 0"),
    "cold_read_cpu_ms": (_nonneg, "must be >= 0"),
    "cold_read_cpu_us_per_page": (_nonneg, "must be >= 0"),
    "reader_wake_ms": (_nonneg, "must be >= 0"),
    "compute_factor": (_positive, "must be > 0"),
    "cpu_cores": (_nonneg, "must be >= 0 (0 = not modelled)"),
    "background_cores": (_nonneg, "must be >= 0"),
    "page_cache_floor_gib": (_nonneg, "must be >= 0"),
    "os_floor_gib": (lambda v: v == -1 or v >= 0, "must be -1 (does not give way) or >= 0"),
    "queue_ahead_ms": (_nonneg, "must be >= 0 (inf = the host never waits)"),
    "gather_queue_ahead_ms": (lambda v: v == -1 or v >= 0,
                              "must be -1 (not measured) or >= 0"),
    "refused_warm_ms": (_nonneg, "must be >= 0"),
    "zero_fill_gbps": (_nonneg, "must be >= 0 (0 = not charged)"),
    "zero_fill_rotation_mib": (_ascending_sizes, "must list distinct MiB > 0 in ascending order"),
    "zero_fill_rotation_gbps": (_all_positive, "must be > 0"),
    "page_drop_us_per_page": (_nonneg, "must be >= 0 (0 = not charged)"),
    "reclaim_us_per_page": (_nonneg, "must be >= 0 (0 = page_drop_us_per_page stands in)"),
    "thread_cores": (_nonneg, "must be >= 0 (0 = cpu_cores)"),
    "cross_core_op_us": (_nonneg, "must be >= 0 (0 = not charged)"),
    "fill_host_ms_per_load": (_nonneg, "must be >= 0 (0 = not charged)"),
    "cross_core_op_main_us": (_nonneg, "must be >= 0 (0 = not charged)"),
    "throttle_read_mbps": (_nonneg, "must be >= 0 (0 = no throttle)"),
    "throttle_read_iops": (_nonneg, "must be >= 0 (0 = no throttle)"),
    "throttle_burst_s": (_nonneg, "must be >= 0"),
    "throttle_kind": (lambda v: v in THROTTLE_KINDS, f"must be one of {', '.join(THROTTLE_KINDS)}"),
    "page_cache_policy": (lambda v: v in PAGE_CACHE_POLICIES,
                          f"must be one of {', '.join(PAGE_CACHE_POLICIES)}"),
    "layers": (_positive, "must be >= 1"),
    "experts": (lambda v: v >= 2, "must be >= 2"),
    "bundle_bytes": (_positive, "must be > 0"),
    "resident_bytes": (_nonneg, "must be >= 0"),
    "active_params": (_positive, "must be > 0"),
    "kv_bytes_per_token": (_nonneg, "must be >= 0"),
    "heads": (_nonneg, "must be >= 0"),
    "head_bytes": (_nonneg, "must be >= 0"),
    "head_read_bytes": (_nonneg, "must be >= 0 (0 = head_bytes)"),
    "build_ms_per_layer": (_nonneg, "must be >= 0"),
    "head_build_ms": (_nonneg, "must be >= 0"),
    "lora_bytes": (_nonneg, "must be >= 0"),
    "lora_build_ms": (_nonneg, "must be >= 0"),
    "fill_ms_per_layer": (_nonneg, "must be >= 0"),
    "primitives_per_layer": (_nonneg, "must be >= 0"),
    "dispatch_cpu_ms_per_layer": (_nonneg, "must be >= 0"),
    "compute_wait_ms_per_layer": (_nonneg, "must be >= 0"),
    "whole_layer_reads": (_positive, "must be >= 1"),
    "bundle_reads": (_positive, "must be >= 1"),
    "unembed_bytes": (_nonneg, "must be >= 0"),
    "device_bundle_bytes": (_nonneg, "must be >= 0 (0 = bundle_bytes)"),
    "shared_page_reads": (_nonneg, "must be >= 0 (0 = no slice shares a page)"),
    "page_group": (_positive, "must be >= 1 (1 = no page shared between experts)"),
    "routing_k": (lambda v: all(k >= 1 for k in v) and v == sorted(set(v)),
                  "must list distinct K >= 1 in ascending order"),
    "routing_reuse": (lambda v: all(0 <= x <= 1 for x in v), "must be in [0, 1]"),
    "routing_skew": (lambda v: all(x >= 0 for x in v), "must be >= 0"),
    "routing_recall": (lambda v: all(0 <= x <= 1 for x in v), "must be in [0, 1]"),
    "routing_recall_window": (lambda v: all(x >= 1 for x in v), "must be >= 1"),
    "path": (lambda v: v in DECODE_PATHS, f"must be one of {', '.join(DECODE_PATHS)} (the "
             "engine's decode paths; whole-layer is simulated at prefill)"),
    "k": (_nonneg, "must be >= 1 (0 = the model's K)"),
    "lead": (lambda v: v in LEADS, f"must be one of {', '.join(LEADS)}"),
    "lead_layers": (_positive, "must be >= 1"),
    "decode_steps": (_nonneg, "must be >= 0"),
    "prefill_tokens": (_nonneg, "must be >= 0"),
    "context_tokens": (_nonneg, "must be >= 0"),
    "lru_bytes": (_nonneg, "must be >= 0"),
    "cache_policy": (lambda v: v in POLICIES, f"must be one of {', '.join(POLICIES)}"),
    "readers": (_nonneg, "must be >= 0"),
    "demand_pieces": (_positive, "must be >= 1"),
    "prefetch_pieces": (_positive, "must be >= 1"),
    "prediction_accuracy": (_fraction, "must be in [0, 1]"),
    "stager_dup_views": (lambda v: True, ""),
    "help_reads": (lambda v: True, ""),
    "native_reads": (lambda v: True, ""),
    "gil": (lambda v: True, ""),
    "lora": (lambda v: True, ""),
    "budget_evict_ms": (_nonneg, "must be >= 0"),
    "read_hold_ms": (_nonneg, "must be >= 0"),
    "cold_fill_compute_ms": (_nonneg, "must be >= 0"),
    "staged_headroom": (lambda v: v >= -1, "must be >= 0 (-1 = K)"),
    "runtime_gib": (_nonneg, "must be >= 0"),
    "overlap": (_fraction, "must be in [0, 1]"),
    "routing_stats": (lambda v: v in ("scenario", "model"), 'must be "scenario" or "model"'),
    "skew": (_nonneg, "must be >= 0"),
    "recall": (_fraction, "must be in [0, 1]"),
    "recall_window": (_positive, "must be >= 1"),
    "seed": (_nonneg, "must be >= 0"),
}
RULES.update({f"prerouted_{k}": RULES[k] for k in ROUTING_KEYS})  # the same checks


def _types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def coerce(where: str, key: str, value: Any, typ: Any) -> Any:
    """Check a TOML value against a field type (ints are accepted where floats are)."""
    if typ is bool:
        if not isinstance(value, bool):
            raise BadInput(f"{where}: {key}: expected true or false, got {value!r}")
        return value
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadInput(f"{where}: {key}: expected an integer, got {value!r}")
        return value
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise BadInput(f"{where}: {key}: expected a number, got {value!r}")
        return float(value)
    if typ is str:
        if not isinstance(value, str):
            raise BadInput(f"{where}: {key}: expected a string, got {value!r}")
        return value
    if typing.get_origin(typ) is list:
        (item,) = typing.get_args(typ)
        if not isinstance(value, list):
            raise BadInput(f"{where}: {key}: expected a list, got {value!r}")
        return [coerce(where, key, v, item) for v in value]
    return value


def parse_text(where: str, key: str, text: str, typ: Any) -> Any:
    """Parse a --set value for a field of type `typ` (sizes like 0.75GiB for *_bytes)."""
    raw = text.strip()
    try:
        if typ is bool:
            low = raw.lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if typ is int:
            low = raw.lower().replace("_", "")
            for suffix, scale in _SIZE.items():
                if key.endswith("_bytes") and low.endswith(suffix):
                    return int(round(float(low[: -len(suffix)]) * scale))
            return int(low)
        if typ is float:
            return float(raw)
        if typing.get_origin(typ) is list:  # comma separated
            (item,) = typing.get_args(typ)
            return [parse_text(where, key, part, item) for part in raw.split(",") if part.strip()]
    except ValueError:
        kind = {bool: "true or false", int: "an integer", float: "a number"}[typ]
        extra = " (sizes like 512MiB allowed)" if typ is int and key.endswith("_bytes") else ""
        raise BadInput(f"{where}: {key}: expected {kind}{extra}, got {raw!r}") from None
    return raw


def check_value(where: str, key: str, value: Any) -> None:
    rule = RULES.get(key)
    if rule and not rule[0](value):
        raise BadInput(f"{where}: {key}: {value!r} {rule[1]}")


def _fields(where: str, data: dict[str, Any], cls: type, keys: tuple[str, ...],
            required: bool) -> dict[str, Any]:
    types = _types(cls)
    allowed = set(keys) | {"name", "description"}
    data = {k: v for k, v in data.items() if k not in RETIRED}
    for key in data:
        if key in RENAMED and key not in allowed:
            raise BadInput(f"{where}: {key}: renamed to {RENAMED[key]}")
        if key not in allowed:
            raise BadInput(f"{where}: {key}: unknown key (known: {', '.join(sorted(allowed))})")
    if required:
        for key in keys:
            if key not in data and key not in OPTIONAL:
                raise BadInput(f"{where}: {key}: missing")
    out = {}
    for key, value in data.items():
        out[key] = coerce(where, key, value, types[key])
        check_value(where, key, out[key])
    return out


def read_toml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise BadInput(f"{path}: no such profile")
    try:
        return tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise BadInput(f"{path}: not valid TOML ({err})") from None


def _resolve(name_or_path: str, sub: str) -> Path:
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        return path
    return ROOT / sub / f"{name_or_path}.toml"


def load_hardware(name_or_path: str, overrides: dict[str, Any] | None = None,
                  where: str | None = None) -> Hardware:
    path = _resolve(name_or_path, "hardware")
    data = read_toml(path)
    data.setdefault("name", path.stem)
    values = _fields(str(path), data, Hardware, HARDWARE_KEYS, required=True)
    if overrides:
        values.update(_fields(where or str(path), overrides, Hardware, HARDWARE_KEYS, False))
    hw = Hardware(**values)
    check_hardware(where or str(path), hw)
    return hw


def check_hardware(where: str, hw: Hardware) -> None:
    for xs, ys, what in (("zero_fill_rotation_mib", "zero_fill_rotation_gbps", "rotation"),
                         ("expert_size_bytes", "expert_size_gbps", "size")):
        n, rates = len(getattr(hw, xs)), len(getattr(hw, ys))
        if n != rates:
            raise BadInput(f"{where}: {ys}: {rates} values for {n} {what}s in {xs} (one per "
                           f"{what})")


def hardware_from_values(name: str, values: dict[str, tuple[Any, str]]) -> Hardware:
    """A Hardware from calibrate's (value, how it was measured) pairs, checked as a profile file
    is; keys that are not Hardware's are left out (a partial set: what is missing keeps its
    default)."""
    data = {k: v for k, (v, _) in values.items() if k in HARDWARE_KEYS}
    hw = Hardware(name=name, **_fields(f"hardware {name}", data, Hardware, HARDWARE_KEYS,
                                       required=False))
    check_hardware(f"hardware {name}", hw)
    return hw


# a model profile's figures that belong to its decoder graph, not its experts (graph_of); not
# fill_ms_per_layer, whose figure is fitted inside decode on the calibration model's traces
GRAPH_KEYS = ("build_ms_per_layer", "primitives_per_layer", "dispatch_cpu_ms_per_layer",
              "compute_wait_ms_per_layer", "lora_build_ms")


def load_model(name_or_path: str, overrides: dict[str, Any] | None = None,
               where: str | None = None) -> ModelProfile:
    path = _resolve(name_or_path, "models")
    data = read_toml(path)
    data.setdefault("name", path.stem)
    if data.get("graph_of"):
        data = _with_graph_of(path, data)
    values = _fields(str(path), data, ModelProfile, MODEL_KEYS, required=True)
    if overrides:
        values.update(_fields(where or str(path), overrides, ModelProfile, MODEL_KEYS, False))
    model = ModelProfile(**values)
    check_model(where or str(path), model)
    return model


def _with_graph_of(path: Path, data: dict[str, Any]) -> dict[str, Any]:
    """`data` with the graph's figures it does not set taken from its graph_of profile (a
    profile in the same folder, or a path), which must not itself name one."""
    other = str(data["graph_of"])
    source = Path(other) if other.endswith(".toml") else path.with_name(f"{other}.toml")
    if not source.is_file():
        raise BadInput(f"{path}: graph_of: {other!r}: no such model profile ({source})")
    graph = read_toml(source)
    if graph.get("graph_of"):
        raise BadInput(f"{path}: graph_of: {other!r} names a graph_of profile itself "
                       f"({graph['graph_of']!r}): name the model that holds the figures")
    return {**{k: graph[k] for k in GRAPH_KEYS if k in graph}, **data}


def check_model(where: str, m: ModelProfile) -> None:
    if m.unembed_bytes > m.resident_bytes:
        raise BadInput(f"{where}: unembed_bytes: {m.unembed_bytes} is more than resident_bytes "
                       f"({m.resident_bytes}), of which it is a part")
    if m.shared_page_reads and m.shared_page_reads >= m.bundle_reads:
        raise BadInput(f"{where}: shared_page_reads: {m.shared_page_reads} must be less than "
                       f"bundle_reads ({m.bundle_reads}), of which they are a part (a bundle "
                       "of shared slices alone is not modelled)")
    if not 1 <= m.k <= m.experts:
        raise BadInput(f"{where}: k: {m.k} must be in 1..experts ({m.experts})")
    no_heads = (m.consumer_first, m.consumer_last) == (-1, -1)
    if not no_heads and not 0 <= m.consumer_first <= m.consumer_last < m.layers:
        raise BadInput(f"{where}: consumer_first/consumer_last: ({m.consumer_first}, "
                       f"{m.consumer_last}) must be (-1, -1) or within 0..{m.layers - 1}")
    if not no_heads and m.consumer_first < 1:
        raise BadInput(f"{where}: consumer_first: layer 0 has no owner layer before it")
    for prefix in ("", "prerouted_"):
        ks = getattr(m, f"{prefix}routing_k")
        for key in ROUTING_KEYS[1:]:
            if len(getattr(m, prefix + key)) != len(ks):
                raise BadInput(f"{where}: {prefix}{key}: {len(getattr(m, prefix + key))} "
                               f"values for {len(ks)} K in {prefix}routing_k (one per K)")


def check_scenario(sc: Scenario) -> None:
    where = sc.source or sc.name
    for key in SCENARIO_KEYS:
        check_value(where, key, getattr(sc, key))
    check_model(where, sc.model)
    hw = sc.hardware
    check_hardware(where, hw)
    if hw.os_floor_gib > hw.os_reserve_gib:
        raise BadInput(f"{where}: os_floor_gib: {hw.os_floor_gib} GiB is above os_reserve_gib "
                       f"({hw.os_reserve_gib} GiB): what the OS gives way down to cannot be more "
                       "than what it holds")
    if not 1 <= sc.k <= sc.model.experts // 2:
        raise BadInput(f"{where}: k: {sc.k} must be in 1..experts/2 ({sc.model.experts // 2})")
    if sc.routing_stats == "model" and not sc.model.routing_k:
        raise BadInput(f"{where}: routing_stats: \"model\" but model {sc.model.name!r} has no "
                       "fitted routing statistics (ssdmoe sim profile-model --trace TRACE)")
    if sc.lead != "none" and sc.path != "staged":
        raise BadInput(f"{where}: lead: {sc.lead!r} stages routing ahead, which only the staged "
                       f"path does (path is {sc.path!r}; use lead = \"none\")")
    if sc.predicts and sc.model.consumer_count == 0:
        raise BadInput(f"{where}: lead: model {sc.model.name!r} has no prediction heads "
                       "(consumer_first = -1), so a lead cannot run")
    if sc.predicts and sc.headroom < sc.k:
        raise BadInput(f"{where}: staged_headroom: {sc.headroom} < K ({sc.k}): staging the next "
                       "call's set while the last call's is in use needs K slots of headroom "
                       "(the engine raises StagingError)")
    if sc.path == "exact" and sc.lru_bytes:
        raise BadInput(f"{where}: lru_bytes: the exact path keeps no app cache (set it to 0, or "
                       "path = \"hot\")")
    if sc.cache_policy != DEFAULT_POLICY and sc.path == "exact" and not sc.engine_budget:
        raise BadInput(f"{where}: cache_policy: {sc.cache_policy!r} on the exact path, which "
                       "has no cache to evict from (path = \"hot\" or \"staged\", or an "
                       "engine page-cache budget)")
    if sc.cache_policy == "belady" and (sc.path != "hot" or sc.engine_budget):
        budget = ", with an engine page-cache budget" if sc.engine_budget else ""
        raise BadInput(f"{where}: cache_policy: belady runs on the hot path's shared cache only "
                       f"(path is {sc.path!r}{budget}): the slot tables' sets are staged before "
                       "their use, and the budget's reads come from the threads' order")


def load_scenario(name_or_path: str, sets: list[str] | None = None) -> Scenario:
    """Scenario from scenarios/NAME.toml (or a path), with `--set key=value` overrides
    (`hardware=NAME` and `model=NAME` replace a whole profile before the other keys apply)."""
    path = _resolve(name_or_path, "")
    data = read_toml(path)
    where = str(path)
    for key in ("hardware", "model"):
        if key not in data:
            raise BadInput(f"{where}: {key}: missing (name of a scenarios/{key}"
                           f"{'' if key == 'hardware' else 's'}/*.toml profile)")
    hw_name, model_name = data.pop("hardware"), data.pop("model")
    rest = []
    for item in sets or []:  # --set hardware=NAME / model=NAME swap a whole profile
        key, value = _split(item)
        if key == "hardware":
            hw_name = value.strip()
        elif key == "model":
            model_name = value.strip()
        else:
            rest.append(item)
    hw_over = data.pop("hardware_overrides", {})
    model_over = data.pop("model_overrides", {})
    if not isinstance(hw_name, str) or not isinstance(model_name, str):
        raise BadInput(f"{where}: hardware/model: expected profile names (strings)")
    description = data.pop("description", "")
    notes = data.pop("notes", {})
    check_notes(where, notes)
    in_decode = data.pop("in_decode", {})
    InDecode.from_table(where, in_decode)  # checked here: one line naming the file
    values = _fields(where, data, Scenario, SCENARIO_KEYS, required=False)
    hardware = load_hardware(hw_name, hw_over, where)
    model = load_model(model_name, model_over, where)
    sc = Scenario(name=path.stem, hardware=hardware, model=model, source=where,
                  notes={"description": description, **notes},
                  in_decode={k: float(v) for k, v in in_decode.items()}, **values)
    if sets:
        sc = apply_overrides(sc, rest)
        sc.source = f"{where} (with --set {' '.join(sets)})"
    check_scenario(sc)
    return sc


def _split(item: str) -> tuple[str, str]:
    if "=" not in item:
        raise BadInput(f"--set {item}: expected key=value")
    key, value = item.split("=", 1)
    return key.strip(), value


def apply_overrides(sc: Scenario, sets: list[str]) -> Scenario:
    """Return a copy of `sc` with each key=value applied. A bare key is looked up in the
    scenario, then the hardware profile, then the model profile; `hardware.X` / `model.X`
    address a profile explicitly."""
    sc = dataclasses.replace(sc, hardware=dataclasses.replace(sc.hardware),
                             model=dataclasses.replace(sc.model), notes=dict(sc.notes),
                             in_decode=dict(sc.in_decode))
    targets = {"scenario": (sc, SCENARIO_KEYS), "hardware": (sc.hardware, HARDWARE_KEYS),
               "model": (sc.model, MODEL_KEYS)}
    for item in sets:
        key, text = _split(item)
        where = "--set"
        section, _, field = key.rpartition(".")
        if section and section not in targets:
            raise BadInput(f"--set {key}: unknown section {section!r} (hardware or model)")
        order = [section] if section else ["scenario", "hardware", "model"]
        for name in order:
            obj, keys = targets[name]
            if field in keys:
                typ = _types(type(obj))[field]
                value = parse_text(where, field, text, typ)
                check_value(where, field, value)
                setattr(obj, field, value)
                break
        else:
            if field in RENAMED:
                raise BadInput(f"--set {key}: renamed to {RENAMED[field]}")
            known = sorted(set(SCENARIO_KEYS) | set(HARDWARE_KEYS) | set(MODEL_KEYS))
            raise BadInput(f"--set {key}: unknown key (known: {', '.join(known)})")
    if sc.k == 0:
        sc.k = sc.model.k
    return sc


def write_checked(path: Path, text: str, load: typing.Callable[[str], Any]) -> Path:
    """Write a profile TOML atomically, and only if `load` accepts it: a profile that the
    simulator would reject never replaces a good one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".toml.tmp")
    tmp.write_text(text)
    try:
        load(str(tmp))
    except Exception:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(path)
    return path
