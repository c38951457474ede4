"""`sim compare`: replay a measured trace through the simulator with the engine configuration it
was captured with, and put simulated next to measured for every SUMMARY_KEY.

The scenario: `--scenario NAME` if given, else scenarios/this-machine-<model>.toml when it exists
(model = the trace's model name, a trailing "-stream" dropped), else this machine's hardware
profile (scenarios/hardware/this-machine.toml) with the trace's model profile:
scenarios/models/<model>.toml, else derived from the manifest the trace names (run.json
model.path; sim.model_profile). A model whose profile names another's decoder graph
(`graph_of`) and has no scenario of its own takes the [in_decode] figures of
scenarios/this-machine-<graph_of>.toml: validate fitted them inside decode for that graph on
this machine, and only the experts' width differs (not with a named --hardware profile).

The engine configuration in run.json `engine` maps onto scenario keys, in the engine's own
vocabulary (sim.policies):
  decode path exact (preset on-demand)  path exact: every routed expert read on the main thread,
                                        no app cache
  decode path hot                       path hot, lru_bytes = hot_bytes (default 25% of the
                                        expert bytes, contract.engine_config.HOT_FRACTION), readers
  decode path staged                    path staged, staged_headroom as configured (per layer
                                        K + headroom slots, the cache policy's victim), lead none,
                                        no bundle LRU behind the slots, readers
  prerouter true                        path staged, lead token
  first_layer_hint                      first_layer_hint as recorded (traces from before it
                                        existed: off); the trace's hinted sets are replayed
  extra.recorder                        token_host_ms = overhead_ms / steps: the recorder's
                                        per-token work on the main thread (none: 0)
  lead_kind layer                       path staged, lead layer, lead_layers 1, every MoE layer
                                        after the first a consumer, predictor bytes 0 (the next
                                        layer's own router, resident)
  extra.throttle                        throttle_read_mbps / throttle_read_iops, and
                                        throttle_kind blk-throttle (engine.throttle's v1 and v2
                                        mechanisms are both the kernel's blk-throttle,
                                        sim.token_bucket)
  extra.machine (an emulated machine:   cpuset: cpu_cores = its core count; cpu_quota F: cpu_cores =
  engine.machine_limits)                min(cores, F) (CFS bandwidth as a fluid share of a core);
                                        thread_cores = the cores the threads run on (the cpuset's,
                                        else the machine's: a quota keeps them all);
                                        memory: the page cache holds what the group's limit leaves
                                        after the process's own memory (measured at entry, and
                                        what it allocated by exit), as a budget of that size
  lookahead                             lookahead=true when the config has it on (traces from
                                        before it existed have no such key: off) and every decode
                                        path in use is one that does not sync at build (staged,
                                        hot, whole-layer), as engine.generate decides; else false
                                        (exact: the synchronous loop)
  cache_policy                          as recorded (traces from before it existed: lru); with a
                                        page-cache budget it is the budget's policy too
                                        (engine_budget)
  prefill path whole-layer              prefill_stacks_held=true: its two full-layer stacks are
  (presets hot, staged)                 allocated when the engine is built and held (memory)
  k, o_direct, help_reads               as recorded (help_reads: the main thread reads a needed
                                        bundle no reader has started; traces without it: on)
  readers_kind                          native_reads=true where the engine's queued reads ran
                                        on native threads (engine.native_reads); else, and in
                                        traces from before them, false (Python readers)
  page_cache_budget                     the simulated page cache holds as many bundles as the
                                        engine's budget does (it charges each bundle its ranges
                                        rounded out to pages); the OS reserve is set so that
                                        RAM - unreclaimable = that
  build_ms_per_layer                    the scenario's [in_decode] "build_ms_per_layer.<path>" when
                                        present (per-path main-thread CPU, from calibrate)
  fill_ms_per_layer                     the scenario's [in_decode] "fill_ms_per_layer.<path>" when
                                        present (the lookahead loop's dispatch per layer, fitted
                                        per path by ssdmoe validate; the layer lead's
                                        "fill_ms_per_layer.staged-layer", else the staged path's)
  compute_factor, load_overhead_ms,     the scenario's [in_decode] "compute_factor",
  handoff_ms, reader_wake_ms,           "load_overhead_ms.in_decode", "handoff_ms.in_decode",
  ssd_latency_ms, cold_overhead_ms      "reader_wake_ms.in_decode", "ssd_latency_ms.in_decode"
                                        and (buffered reads) "cold_overhead_ms.in_decode" when
                                        present (fitted inside decode by ssdmoe validate's
                                        calibration subset)
  head_build_ms (traces with heads)     the scenario's [in_decode] "head_build_ms.in_decode" when
                                        ssdmoe validate fitted it
  cold_overhead_ms (O_DIRECT traces)    the scenario's [in_decode] "cold_overhead_ms.o_direct" when
                                        present (an O_DIRECT bundle read, from calibrate)
Routing (and the step plan: prefill chunks, decode steps, requests) comes from the trace.

Build/eval split of a decode row, measured and simulated alike: in the synchronous loop a row is
[build start, token on host], build = its own graph building (and the path's main-thread work),
eval = waiting on the accelerator; in the lookahead loop a row is a window [previous token,
this token], build = the NEXT step's graph building inside it, eval = the rest net of blocked.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contract.engine_config import DEFAULT_READERS, HOT_FRACTION, SYNC_AT_BUILD, EngineConfig
from contract.errors import BadInput
from contract.thresholds import PAGE
from sim.in_decode import InDecode
from sim.scenario import GIB, Scenario
from traces.reader import Trace
from traces.schema import SUMMARY_KEYS

DEFAULT_HARDWARE = "this-machine"
# The figures the validation report looks at first.
HEADLINE = ("decode_tok_s", "blocked_ms_per_step", "cold_fraction", "loads_per_step")


@dataclass
class Comparison:
    trace: str
    scenario: Scenario
    settings: list[str]  # the --set items derived from run.json
    measured: dict[str, Any]
    simulated: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def ratio(self, key: str) -> float | None:
        m, s = self.measured.get(key), self.simulated.get(key)
        if m is None or s is None or m == 0:
            return None
        return s / m

    def error_pct(self, key: str) -> float | None:
        r = self.ratio(key)
        return None if r is None else (r - 1.0) * 100.0

    def to_dict(self) -> dict[str, Any]:
        sc = self.scenario
        return {
            "trace": self.trace,
            "scenario": sc.name,
            "hardware": sc.hardware.name,
            "model": sc.model.name,
            "settings": self.settings,
            "metrics": {k: {"measured": self.measured.get(k), "simulated": self.simulated.get(k),
                            "ratio": self.ratio(k), "error_pct": self.error_pct(k)}
                        for k in SUMMARY_KEYS},
            "notes": self.notes,
            "sim": self.extra,
        }


def profile_name(model: str) -> str:
    """The profile name of a converted model's directory name (a trailing "-stream" dropped)."""
    return model[: -len("-stream")] if model.endswith("-stream") else model


def model_name(trace: Trace | PlannedRun) -> str:
    return profile_name(str((trace.run.get("model") or {}).get("name") or ""))


def trace_model(trace: Trace | PlannedRun, notes: list[str]):
    """The model profile for a trace: scenarios/models/<name>.toml, else from its manifest."""
    from sim.model_profile import profile_from_manifest
    from sim.profiles import ROOT, load_model
    from sim.scenario import ModelProfile

    name = model_name(trace)
    info = trace.run.get("model") or {}
    if name and (ROOT / "models" / f"{name}.toml").is_file():
        model = load_model(name)
        for key in ("layers", "experts", "bundle_bytes"):
            got = info.get(key)
            if got is not None and int(got) != getattr(model, key):
                raise BadInput(f"{trace.path}: run.json model.{key}={got} but scenarios/models/"
                               f"{name}.toml has {getattr(model, key)}")
        return model
    path = info.get("path")
    if path and Path(path, "manifest.json").is_file():
        values = profile_from_manifest(Path(path))
        notes.append(f"model profile derived from {path}/manifest.json (no scenarios/models/"
                     f"{name}.toml; build_ms_per_layer is machine-notes' figure, not measured)")
        return ModelProfile(name=name or Path(path).name, **{k: v for k, (v, _) in values.items()})
    raise BadInput(f"{trace.path}: no model profile for model {name!r}: no scenarios/models/"
                   f"{name}.toml and run.json model.path has no manifest (run ssdmoe sim "
                   "profile-model MODEL_DIR --out scenarios/models/NAME.toml, or --scenario)")


def decode_paths(engine: dict[str, Any]) -> set[str]:
    """The decode paths the trace's engine ran: paths_in_use when recorded, else the config's
    decode path and per-layer overrides."""
    in_use = (engine.get("paths_in_use") or {}).get("decode") or {}
    if in_use:
        return set(in_use)
    cfg = EngineConfig.from_run(engine)
    return cfg.decode_paths(cfg.layers)


def looked_ahead(engine: dict[str, Any]) -> bool:
    """Whether the trace's decode loop looked ahead (engine.generate): on in the config and no
    decode layer syncing at build."""
    return EngineConfig.from_run(engine).lookahead and not decode_paths(engine) & SYNC_AT_BUILD


def staged_headroom(cfg: EngineConfig, k: int) -> int:
    """The staged slots beyond K per layer (EngineConfig.staged_headroom; None means K)."""
    return k if cfg.staged_headroom is None else int(cfg.staged_headroom)


def engine_settings(engine: dict[str, Any], sc: Scenario) -> tuple[list[str], str, list[str]]:
    """(--set items, decode path name, notes) reproducing the trace's engine configuration
    (run.json `engine`, read as the contract's EngineConfig, plus what the run observed: the K
    it routed at, the paths in use, whether O_DIRECT took effect)."""
    m = sc.model
    notes: list[str] = []
    cfg = EngineConfig.from_run(engine)
    k = int(engine.get("k") or cfg.top_k or m.k)
    path = cfg.decode
    in_use = (engine.get("paths_in_use") or {}).get("decode") or {}
    if len(in_use) == 1:
        path = next(iter(in_use))
    elif len(in_use) > 1:
        notes.append(f"decode paths differ per layer ({', '.join(in_use)}); simulated as {path}")
    readers = cfg.readers if cfg.readers is not None else DEFAULT_READERS
    sets = [f"k={k}"]
    staged = [f"staged_headroom={staged_headroom(cfg, k)}", f"readers={readers}", "lru_bytes=0"]
    if cfg.lead_kind == "layer":
        sets += ["path=staged", "lead=layer", "lead_layers=1", *staged, "model.consumer_first=1",
                 f"model.consumer_last={m.layers - 1}", f"model.heads={m.layers - 1}",
                 "model.head_bytes=0", "model.head_read_bytes=0"]
    elif cfg.prerouter:
        sets += ["path=staged", "lead=token", *staged]
        if path != "staged":
            notes.append(f"prerouter heads on decode path {path}: simulated as staged")
    elif path == "exact":
        sets += ["path=exact", "lead=none", "lru_bytes=0", "readers=0"]
    elif path == "hot":
        hot = cfg.hot_bytes if cfg.hot_bytes is not None else int(m.expert_bytes * HOT_FRACTION)
        sets += ["path=hot", "lead=none", f"lru_bytes={max(hot, m.bundle_bytes)}",
                 f"readers={readers}"]
    elif path == "staged":
        sets += ["path=staged", "lead=none", *staged]
    else:
        raise BadInput(f"run.json engine: decode path {path!r} has no simulator mapping")
    if cfg.cache_policy is not None:
        sets.append(f"cache_policy={cfg.cache_policy}")
    sets.append(f"lookahead={'true' if looked_ahead(engine) else 'false'}")
    whole = cfg.prefill == "whole-layer" or any(
        d.get("prefill") == "whole-layer" for d in cfg.layers.values())
    sets.append(f"prefill_stacks_held={'true' if whole else 'false'}")
    sets.append(f"help_reads={'true' if cfg.help_reads else 'false'}")
    sets.append(f"native_reads={'true' if cfg.readers_kind == 'native' else 'false'}")
    sets.append("gil=true")  # this engine's threads are Python threads (sim.gil)
    sets.append(f"lora={'true' if cfg.lora else 'false'}")
    sets.append(f"first_layer_hint={'true' if cfg.first_layer_hint else 'false'}")
    o_direct = engine.get("o_direct_effective", cfg.o_direct)
    sets.append(f"o_direct={'true' if o_direct else 'false'}")
    fits = InDecode.from_table(sc.source or sc.name, sc.in_decode)  # fitted inside decode
    sets += [f"{key}={value}" for key, value in fits.settings(
        path, cfg.lead_kind, looked_ahead(engine), bool(cfg.prerouter), bool(o_direct))]
    return sets, path, notes


def paged_bundle_bytes(trace: Trace | PlannedRun) -> float | None:
    """Mean bytes the engine's page-cache budget charges per bundle (its ranges rounded out to
    whole pages: sim.model_profile.paged_bundle_bytes), from the manifest the trace names;
    None if unknown."""
    from sim.model_profile import paged_bundle_bytes as paged
    from sim.model_profile import read_manifest_json

    path = (trace.run.get("model") or {}).get("path")
    if not path or not Path(path, "manifest.json").is_file():
        return None
    return paged(read_manifest_json(Path(path)))


def with_page_cache(sc: Scenario, budget_bytes: int, notes: list[str],
                    paged: float | None = None, kernel: bool = False) -> Scenario:
    """The scenario with its page cache set to hold what the engine's budget holds: the budget
    in bundles of page-rounded size `paged` (or of bundle_bytes), through the OS reserve. The
    engine's budget drops the bundles its cache policy names itself (engine_budget: the
    scenario's cache_policy); with `kernel` the room is a memory limit's, and the kernel's own
    policy (the hardware's) decides."""
    if not kernel:
        sc = dataclasses.replace(sc, engine_budget=True)
    from sim.memory_budget import budget

    if paged and paged > sc.model.bundle_bytes:
        bundles = int(budget_bytes // paged)
        notes.append(f"page-cache budget {budget_bytes} bytes holds {bundles} bundles: the "
                     f"engine charges {paged:.0f} bytes per bundle (ranges rounded to pages)")
        budget_bytes = bundles * sc.model.bundle_bytes
    mem = budget(sc)
    reserve = mem.ram - mem.engine - budget_bytes
    if reserve < 0:
        notes.append(f"page-cache budget {budget_bytes} bytes is more than RAM leaves; using the "
                     "RAM-derived page cache")
        return sc
    # the page cache is the budget: nothing else gives way
    hw = dataclasses.replace(sc.hardware, os_reserve_gib=reserve / GIB, os_floor_gib=-1.0)
    return dataclasses.replace(sc, hardware=hw)


def with_trace_heads(sc: Scenario, trace: Trace | PlannedRun, notes: list[str]) -> Scenario:
    """A trace taken with prerouter heads (run.json engine.prerouter: their directory) on a
    model profile without heads: the heads' layers and bytes from their prerouter.json."""
    from sim.model_profile import heads_profile

    where = (trace.run.get("engine") or {}).get("prerouter")
    if not where or sc.model.consumer_count > 0:
        return sc
    meta = Path(str(where)) / "prerouter.json"
    if not meta.is_file():
        raise BadInput(f"{trace.path}: run.json engine.prerouter: cannot read {meta}")
    values = {k: v for k, (v, _) in heads_profile(meta).items() if k != "head_build_ms"}
    notes.append(f"prediction heads from {meta}: owners {values['consumer_first'] - 1}-"
                 f"{values['consumer_last'] - 1}, {values['head_bytes']} bytes each; "
                 "head_build_ms the scenario's [in_decode] head_build_ms.in_decode (ssdmoe "
                 "validate) if fitted, else the profile's")
    return dataclasses.replace(sc, model=dataclasses.replace(sc.model, **values))


def with_trace_lora(sc: Scenario, trace: Trace | PlannedRun, notes: list[str]) -> Scenario:
    """A trace served with a recovery LoRA (run.json engine.lora: its directory) on a model
    profile without one: the adapter's bytes from its file."""
    from sim.model_profile import LORA_FILE, lora_profile

    where = (trace.run.get("engine") or {}).get("lora")
    if not where or sc.model.lora_bytes > 0:
        return sc
    if not (Path(str(where)) / LORA_FILE).is_file():
        raise BadInput(f"{trace.path}: run.json engine.lora: cannot read "
                       f"{Path(str(where)) / LORA_FILE}")
    values = {k: v for k, (v, _) in lora_profile(Path(str(where))).items()
              if k != "lora_build_ms"}
    notes.append(f"recovery LoRA from {where}: {values['lora_bytes']} bytes; lora_build_ms "
                 "stays the profile's (not measured)")
    return dataclasses.replace(sc, model=dataclasses.replace(sc.model, **values))


@dataclass
class PlannedRun:
    """A run not captured yet, as the engine would record it: run.json's `model`, `engine` and
    `extra` (throttle, machine). `scenario_for` reads it as it reads a trace (ssdmoe advise
    predicts configurations through the same mapping that `sim compare` replays them with)."""

    run: dict[str, Any]
    path: str = "planned run"


def scenario_for(trace: Trace | PlannedRun, scenario: str | None = None,
                 sets: list[str] | None = None,
                 hardware: str | None = None) -> tuple[Scenario, list[str], list[str]]:
    """(scenario, derived --set items, notes) for replaying `trace`. `hardware`: a hardware
    profile instead of this machine's (then no this-machine scenario is looked for)."""
    from sim.profiles import ROOT, apply_overrides, check_scenario, load_hardware, load_scenario

    notes: list[str] = []
    default = f"{DEFAULT_HARDWARE}-{model_name(trace)}"
    if scenario is None and hardware is None and (ROOT / f"{default}.toml").is_file():
        scenario = default
        notes.append(f"scenario {default} (this machine's profile, the trace's model profile and "
                     "the engine's per-path main-thread costs)")
    if scenario is not None:
        sc = load_scenario(scenario)
    else:
        sc = Scenario(name=f"compare-{model_name(trace) or 'trace'}",
                      hardware=load_hardware(hardware or DEFAULT_HARDWARE),
                      model=trace_model(trace, notes),
                      source=f"sim compare {trace.path}")
        graph = f"{DEFAULT_HARDWARE}-{sc.model.graph_of}"
        if hardware is None and sc.model.graph_of and (ROOT / f"{graph}.toml").is_file():
            # the same decoder graph on the same machine: what validate fitted inside decode
            # for the model that owns the graph is this engine's, not that model's experts'
            sc.in_decode = dict(load_scenario(graph).in_decode)
            notes.append(f"in-decode figures of scenario {graph} (the model's graph_of, on "
                         "this machine)")
    sc = with_trace_lora(with_trace_heads(sc, trace, notes), trace, notes)
    derived, _, more = engine_settings(trace.run.get("engine") or {}, sc)
    notes += more
    throttle = (trace.run.get("extra") or {}).get("throttle") or {}
    if throttle.get("read_mbps"):
        derived.append(f"throttle_read_mbps={throttle['read_mbps']}")
    if throttle.get("read_iops"):
        derived.append(f"throttle_read_iops={throttle['read_iops']}")
    if throttle.get("burst_s") is not None:
        derived.append(f"throttle_burst_s={throttle['burst_s']}")
    if throttle.get("read_mbps") or throttle.get("read_iops"):
        derived.append("throttle_kind=blk-throttle")
    recorder = (trace.run.get("extra") or {}).get("recorder") or {}
    if recorder.get("steps"):
        derived.append(f"token_host_ms={recorder['overhead_ms'] / recorder['steps']:.4f}")
    machine = (trace.run.get("extra") or {}).get("machine") or {}
    cores = len((machine.get("cpuset") or {}).get("cores") or []) or None
    quota = (machine.get("cpu_quota") or {}).get("cores")
    if cores or quota:
        spanned = cores or sc.hardware.cpu_cores  # a quota spreads its time over them all
        have = spanned or quota
        derived.append(f"cpu_cores={min(have, quota or have):g}")
        if spanned:
            derived.append(f"thread_cores={spanned:g}")
    sc = apply_overrides(sc, derived + list(sets or []))
    engine = trace.run.get("engine") or {}
    budget_bytes = engine.get("page_cache_budget")
    memory = machine.get("memory") or {}
    if memory and budget_bytes is None:  # the kernel's limit is the budget: what it leaves
        # what the process allocated inside the group (measured at exit) is not page cache
        grown = max(memory.get("own_bytes_at_exit", 0) - memory["own_bytes_at_entry"], 0)
        budget_bytes = memory["group_limit_bytes"] - grown
        notes.append(f"memory limit {memory['limit_bytes']} bytes less the process's own "
                     f"{memory['own_bytes_at_entry']} bytes at entry and {grown} allocated "
                     f"after: a page cache of {budget_bytes} bytes")
    # the manifest the trace names, else the model profile's figure from the same manifest (a
    # trace moved to another machine: the page cache must not depend on where it is replayed)
    paged = paged_bundle_bytes(trace) or sc.model.device_bundle_bytes or None
    if paged is not None and not sc.model.device_bundle_bytes:
        sc.model.device_bundle_bytes = int(round(paged))  # what a cold read moves
    if budget_bytes is not None and not engine.get("o_direct_effective", engine.get("o_direct")):
        sc = with_page_cache(sc, int(budget_bytes), notes, paged, kernel=bool(memory))
        if not memory:  # (under a memory limit the kernel reclaims)
            # the drops' kernel work per page, and what validate fitted inside decode beside it
            evict = InDecode.from_table(sc.source or sc.name, sc.in_decode).budget_evict_ms
            pages = -(-int(round(paged or sc.model.bundle_bytes)) // PAGE)
            drops = pages * sc.hardware.page_drop_us_per_page / 1e3
            if evict is not None or drops:
                sc.budget_evict_ms = float(evict or 0.0) + drops
        derived.append(f"page cache = {int(budget_bytes)} bytes")
        if memory:  # a memory group at its limit reclaims in the allocating thread
            sc = dataclasses.replace(sc, direct_reclaim=True)
            derived.append("direct_reclaim=true")
    sc.source = f"{sc.source} (sim compare {trace.path})"
    check_scenario(sc)
    return sc, derived, notes


def compare(trace: Trace, scenario: str | None = None, sets: list[str] | None = None,
            out: str | Path | None = None) -> Comparison:
    from sim.replay import run_scenario
    from traces.summary import summarize

    sc, derived, notes = scenario_for(trace, scenario, sets)
    if not trace.complete:
        notes.append("the measured trace is incomplete (complete=false): compared on what it "
                     "holds")
    measured = summarize(trace)
    result = run_scenario(sc, trace=trace, out=out)
    notes += result.figures.warnings
    if measured.get("peak_rss_bytes") is not None:
        notes.append("peak_rss_bytes is not simulated; peak_mlx_bytes is the engine allocation "
                     "model (resident + caches), not MLX's allocator peak")
    engine = trace.run.get("engine") or {}
    if engine.get("o_direct_effective", engine.get("o_direct")):
        notes.append("cold_fraction: under O_DIRECT the engine still classes a load by page-cache "
                     "residency (mincore), while every read goes to the device; the simulator "
                     "counts device reads as cold")
    if "prefill" in trace.steps["phase"].to_list():
        notes.append("prefill: the simulator always loads whole layers; the on-demand engine "
                     "reads only the prompt's experts (prefill_tok_s is indicative)")
    figures = result.figures.as_dict()
    extra = {k: figures[k] for k in ("build_ms_per_step", "eval_ms_per_step",
                                     "page_cache_capacity_bytes", "page_cache_hit_rate",
                                     "lru_hit_rate", "sim_wall_s", "decode_steps",
                                     "decode_cpu_ms_by_thread", "decode_main_cpu_ms_by_part")}
    extra.update({f"measured_{k}": v for k, v in measured_split(trace).items()})
    # the same figures off the simulated trace; build and eval are the simulator's own
    extra.update({k: v for k, v in measured_split(result.trace).items() if k not in extra})
    return Comparison(str(trace.path), sc, derived, measured, result.metrics, notes, extra)


def measured_split(trace: Trace) -> dict[str, float | None]:
    """What a trace measured beyond its summary, per decode step: graph building and
    evaluation, the waits on reader threads' loads, an idle reader's start delay, the build
    time a cold read adds, a cold read's duration and the main thread's blocked time past a
    fill's loads (each reads off a simulated trace alike)."""
    build, evaluate = _build_eval_split(trace)
    return {"build_ms_per_step": build, "eval_ms_per_step": evaluate,
            "reader_waits_per_step": reader_waits_per_step(trace),
            "reader_start_ms": reader_start_ms(trace),
            "build_per_cold_read_ms": build_per_cold_read_ms(trace),
            "cold_read_ms": cold_read_ms(trace),
            "blocked_past_loads_ms": blocked_past_loads_ms(trace),
            "cold_fills_per_step": cold_fills_per_step(trace)}


def _decode_loads(trace: Trace):
    """(the decode steps, the loads of those steps)."""
    import polars as pl

    decode = trace.steps.filter(pl.col("phase") == "decode")
    return decode, trace.loads.filter(pl.col("step").is_in(decode["step"].implode()))


def cold_read_ms(trace: Trace) -> float | None:
    """Mean ms of a decode step's cold expert read, on any thread (a load row's start to
    finish: the read, before the budget's drops). None without any."""
    _, loads = _decode_loads(trace)
    cold = loads.filter(loads["cold"] & (loads["expert"] >= 0))
    if not cold.height:
        return None
    return float((cold["finished_ns"] - cold["started_ns"]).mean()) / 1e6


def cold_fills_per_step(trace: Trace) -> float | None:
    """Fills (a decode step's layer) per decode step whose main thread waited on a cold expert
    load. None without decode steps."""
    decode, loads = _decode_loads(trace)
    if not decode.height:
        return None
    stalled = loads.filter(loads["cold"] & loads["waited"] & (loads["expert"] >= 0))
    return stalled.select(["step", "layer"]).unique().height / decode.height


def blocked_past_loads_ms(trace: Trace) -> float | None:
    """Mean ms per fill (a decode step's layer with expert loads) of the main thread's blocked
    time beyond the span of the fill's loads, first issue to last finish: its wake-up and
    hand-off after the last load, the budget's drops after it, the asks before it hands
    misses out. What it says holds where a fill's loads are issued as the main thread
    blocks on them (no lead; a lead's loads were issued a layer or a token before, so there
    it is negative). None without loads."""
    import polars as pl

    decode, loads = _decode_loads(trace)
    loads = loads.filter(loads["expert"] >= 0)
    if not loads.height:
        return None
    fills = loads.group_by(["step", "layer"]).agg(
        (pl.col("finished_ns").max() - pl.col("issued_ns").min()).alias("span"))
    blocked = float(decode["blocked_ns"].sum())
    return (blocked - float(fills["span"].sum())) / fills.height / 1e6


def _reader_decode_loads(trace: Trace):
    """(decode steps, the loads of those steps that a reader thread did)."""
    decode, loads = _decode_loads(trace)
    return decode.height, loads.filter(loads["thread"] != "main")


def reader_waits_per_step(trace: Trace) -> float:
    """Loads per decode step that the main thread waited for while a reader thread read them
    (each pays the thread hand-off: sim.reader_threads)."""
    steps, loads = _reader_decode_loads(trace)
    return loads.filter(loads["waited"]).height / steps if steps else 0.0


def reader_start_ms(trace: Trace) -> float | None:
    """Median ms from a decode load's issue to its start on a reader thread that was idle when
    it was issued (its previous load had finished): the wake-up sim.reader_threads models, plus what
    the main thread did between creating the ticket and queueing it. None without such loads."""
    import numpy as np

    _, loads = _reader_decode_loads(trace)
    delays = []
    for _, rows in loads.sort("started_ns").group_by("thread"):
        issued = rows["issued_ns"].to_numpy()
        started = rows["started_ns"].to_numpy()
        before = np.r_[np.iinfo(np.int64).min, rows["finished_ns"].to_numpy()[:-1]]
        idle = before < issued
        delays.append((started - issued)[idle])
    joined = np.concatenate(delays) if delays else np.array([])
    return float(np.median(joined)) / 1e6 if joined.size else None


def build_per_cold_read_ms(trace: Trace) -> float | None:
    """The main thread's extra graph-building time per cold read (ms): the least-squares slope
    of a decode step's build time over its cold loads. Under the engine's page-cache budget a
    cold read drops the pages it pushed out after the read (engine.page_cache_budget,
    sim.loads._drop_evicted), which is building time, not time blocked on the read. A slope
    within one capture is what a cold read adds at that capture's speed: a build-time
    difference between two configurations, captured minutes apart on a shared machine, is
    not. None when the steps' cold loads do not vary."""
    import numpy as np
    import polars as pl

    d = trace.steps.filter((pl.col("phase") == "decode") & pl.col("cold_loads").is_not_null()
                           & pl.col("build_ns").is_not_null())
    cold = d["cold_loads"].to_numpy().astype(np.float64)
    if d.height < 2 or np.ptp(cold) == 0:
        return None
    build = d["build_ns"].to_numpy().astype(np.float64) / 1e6
    return float(np.polyfit(cold, build, 1)[0])


def _build_eval_split(trace: Trace) -> tuple[float | None, float | None]:
    import polars as pl

    d = trace.steps.filter(pl.col("phase") == "decode")
    if not d.height:
        return None, None
    return float(d["build_ns"].mean()) / 1e6, float(d["eval_ns"].mean()) / 1e6
