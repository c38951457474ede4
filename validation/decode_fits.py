"""The calibration subset's named configurations fit the profile: each runs one decode path
with every expert in the page cache (no storage effects), measured inside real decode
(concurrent with compute, on this machine's cores), and sets figures `sim compare` uses (the
scenario's [in_decode] table, read by sim.in_decode); `ssdmoe calibrate` measures the same
figures in isolated loops, and in decode they are larger, which is what the held-out
configurations then test. How each fit came to be, with the runs that shaped it:
reports/validation/history.md.
  build_ms_per_layer.<path>   per path, the main-thread cost per layer:
                              new = old + (measured build/step - simulated build/step) / layers
  dispatch_cpu_ms_per_layer.in_decode  machine-wide, MLX's dispatch on the main thread per
                              layer inside decode: old + median((measured - simulated
                              main-thread CPU per step) / layers) over the warm configurations
                              of the lookahead loop (the layer lead's left out); calibrate's
                              probe hands each walk over alone, and the main thread's CPU by
                              part puts the decode's gap there (reports/cross-machine)
  compute_factor              machine-wide, the accelerator's time inside decode against the
                              microbenchmarks': old x median(measured / simulated eval per step)
                              over the configurations that decode in the synchronous loop
                              (on-demand), where eval is the compute and its syncs alone. Kept
                              apart from the next: one factor for both charged the synchronous
                              loop the lookahead paths' hand-over
  fill_ms_per_layer.<path>    per lookahead path (hot, staged, staged-layer), the main-thread
                              work per layer as it hands work over (MLX's dispatch on the
                              calling thread, which compute waits on, and the fill's host work:
                              an LRU lookup on the hot path, slot tables on the staged one; the
                              layer lead's fill points also bring the next layer's predicted ids
                              to the host, queue their reads and hand the gather over): old +
                              median((measured - simulated eval per step) / layers) over that
                              path's warm configurations (staged: with and without heads; the
                              layer lead: its own, which fits nothing machine-wide); old starts
                              at calibrate's isolated figure (the model profile's)
  load_overhead_ms.in_decode  machine-wide, a warm load's CPU inside decode: old + median((measured
                              - simulated blocked per step) / loads per step)
  ssd_latency_ms.in_decode    machine-wide, the device's time per read request inside decode,
                              from the one calibration configuration that reads cold on the
                              main thread (on-demand, 1/2 page cache): old + median(measured -
                              simulated mean cold read, a load row's start to finish on the
                              main thread, sim.compare.cold_read_ms) / the bundle's preads. The
                              storage probes are a snapshot of a shared device, so the run's own
                              cold reads set it. It alone takes a cold read's gap: a cold
                              overhead fitted from the same configuration's blocked time would
                              correct it twice (fit_budget_evict)
  budget_evict_ms.in_decode   the main-thread work per cold read under the engine's emulated
                              budget (its page drops after the read, engine.page_cache_budget,
                              and what else a cold read leaves the main thread), from the same
                              configuration: old + measured - simulated slope of a decode
                              step's build time over its cold loads
                              (sim.compare.build_per_cold_read_ms): a slope within one capture,
                              as a difference from the warm configuration's build time, captured
                              minutes apart, moves with the machine's load
  head_build_ms.in_decode     the prerouter heads' graph building per head, from the staged
                              path with heads (lead token), every expert in the page cache:
                              old + (measured - simulated build/step) / heads
  handoff_ms.in_decode        machine-wide, the thread hand-off of a load a reader thread reads
                              and the main thread waits for, inside decode (the event set and
                              the main thread's wake-up; the reader's own wake-up is
                              reader_wake_ms), from the one calibration configuration whose
                              readers read cold (hot, 1/2 page cache): old + measured -
                              simulated blocked time per fill beyond the span of the fill's
                              loads, first issue to last finish
                              (sim.compare.blocked_past_loads_ms): past the loads, so that it
                              does not absorb how much shorter the simulated reads are
  cold_fill_compute_ms.in_decode  machine-wide, the lookahead loop's compute thread runs its
                              next work this much later after a fill that waited on a cold
                              load: old + median((measured -
                              simulated eval per step) / measured such fills per step) over its
                              cold calibration configuration (hot, 1/2 page cache); .sync the
                              same for the synchronous loop (on-demand, 1/2)
  reader_wake_ms.in_decode    machine-wide, how late an idle reader thread starts a load handed
                              to it, inside decode (its wake-up waits for a core beside the main
                              and compute threads, and for the GIL), from every calibration
                              configuration whose reader threads read: old + median(measured -
                              simulated median delay from a load's issue to its start on a
                              reader that was idle, sim.compare.reader_start_ms); calibrate's
                              no-op requests measure it in isolation, where it is much shorter,
                              and without it the simulated readers would claim at once what the
                              engine's main thread reads itself
With several rounds each measured figure is its median over the rounds (validation.matrix_run).
validation.matrix_run repeats the fit (FIT_ROUNDS): with shared cores the simulated times are not
linear in these figures. Device figures (latency, bandwidth, queue depth, throttle) are never
fitted here but the latency (above); the held-out configurations (other page caches, paths,
throttles, K) predict them.
No MLX here."""

from __future__ import annotations

import re
import statistics
import tomllib
from pathlib import Path
from typing import Any

# validation.matrix path -> the engine decode path whose cost it measures
DECODE_PATH = {"on-demand": "exact", "hot": "hot", "staged": "staged"}
# the staged path with the same-token lead: its calibration configuration fits its own
# hand-over (fill_ms_per_layer.staged-layer) and nothing machine-wide
LAYER_LEAD = "staged-layer"
FILL_PATHS = ("hot", "staged", LAYER_LEAD)


def fill_path(config: dict[str, Any]) -> str | None:
    """The fill_ms_per_layer key a configuration's lookahead loop reads: the layer lead has
    its own (each fill point also brings the next layer's ids to the host and queues their
    reads), the token lead shares the staged path's."""
    if config["path"] == LAYER_LEAD:
        return LAYER_LEAD
    return DECODE_PATH.get(config["path"].split("-")[0])


def fitted_build(result: dict[str, Any], layers: int, old: float) -> float:
    m = result["measured"]["build_ms_per_step"]
    s = result["simulated"]["build_ms_per_step"]
    return max(old + (m - s) / layers, 0.0)


def current_fit(scenario: Path, key: str) -> float | None:
    """The scenario's [in_decode] figure `key` (None when it has none)."""
    value = tomllib.loads(scenario.read_text()).get("in_decode", {}).get(key)
    return None if value is None else float(value)


def write_fit(scenario: Path, key: str, value: float, why: str) -> None:
    """Set `"key" = value  # why` in the scenario's [in_decode] table (replacing the line if
    any, else at the table's end). Only figures sim.in_decode reads: a fit written under a name
    the replay does not read would be silently unused."""
    from sim.in_decode import is_fitted

    if not is_fitted(key):
        raise ValueError(f"{key}: not a figure sim.in_decode reads (SINGLE, PER_VARIANT)")
    lines = scenario.read_text().splitlines()
    line = f'"{key}" = {value:.4f}  # {why}'
    header = next((i for i, t in enumerate(lines) if re.match(r"\[in_decode\]", t)), None)
    if header is None:
        lines += ["", "[in_decode]", line]
    else:
        end = next((i for i in range(header + 1, len(lines)) if re.match(r"\[", lines[i])),
                   len(lines))
        mine = re.compile(rf'^"{re.escape(key)}"\s*=')
        at = next((i for i in range(header + 1, end) if mine.match(lines[i])), None)
        if at is not None:
            lines[at] = line
        else:
            while end > header + 1 and not lines[end - 1].strip():
                end -= 1  # after the table's last line, before blank lines
            lines.insert(end, line)
    scenario.write_text("\n".join(lines) + "\n")


def fit(results: list[dict[str, Any]], scenario: Path) -> dict[str, dict[str, float]]:
    """Fit build_ms_per_layer.<path> from each calibration result; returns what was set."""
    out = {}
    for r in results:
        path = DECODE_PATH.get(r["config"]["path"])
        if path is None or r["config"]["page_cache"] != "all":
            continue
        key = f"build_ms_per_layer.{path}"
        old = current_fit(scenario, key)
        if old is None:
            continue
        layers = int(r["layers"])
        new = fitted_build(r, layers, old)
        write_fit(scenario, key, new,
                  f"fitted by ssdmoe validate: {r['config']['name']} measured "
                  f"{r['measured']['build_ms_per_step']:.2f} ms of graph building per decode "
                  f"step inside decode (before this fit: {old:.4f} ms/layer)")
        out[key] = {"before": old, "after": new,
                    "measured_build_ms_per_step": r["measured"]["build_ms_per_step"]}
    out.update(fit_heads(results, scenario))
    out.update(fit_machine(results, scenario))
    return out


def fit_heads(results: list[dict[str, Any]], scenario: Path) -> dict[str, dict[str, float]]:
    """head_build_ms.in_decode from the warm calibration configurations that ran heads."""
    with_heads = [r for r in results if r["config"]["page_cache"] == "all"
                  and (r.get("heads") or 0) > 0 and r["config"]["path"] == "staged-token"]
    deltas = [(r["measured"]["build_ms_per_step"] - r["simulated"]["build_ms_per_step"])
              / r["heads"] for r in with_heads]
    return _shift(
        scenario, "head_build_ms.in_decode",
        current_fit(scenario, "head_build_ms.in_decode") or 0.0, deltas,
        "fitted by ssdmoe validate: the prerouter heads' graph building per head inside decode, "
        "from the build time of {n} calibration configuration(s) with heads (the model "
        "profile has none: the heads run as one batched flush per step)")


def _per_load(results: list[dict[str, Any]], metric: str) -> list[float]:
    """(measured - simulated `metric` per step) / loads per step, for each result that has both
    figures and any loads."""
    out = []
    for r in results:
        m, s = r["measured"], r["simulated"]
        per_step = m.get("loads_per_step") or 0
        if per_step > 0 and s.get(metric) is not None:
            out.append((m[metric] - s[metric]) / per_step)
    return out


def _differences(results: list[dict[str, Any]], metric: str) -> list[float]:
    """measured - simulated `metric` for each result that has both."""
    return [r["measured"][metric] - r["simulated"][metric] for r in results
            if r["measured"].get(metric) is not None and r["simulated"].get(metric) is not None]


def _shift(scenario: Path, key: str, old: float, deltas: list[float],
           why: str) -> dict[str, dict[str, float]]:
    """Set note `key` to old + the median delta (floored at 0); {} when there is no delta."""
    if not deltas:
        return {}
    new = max(old + statistics.median(deltas), 0.0)
    write_fit(scenario, key, new, why.format(n=len(deltas)))
    return {key: {"before": old, "after": new}}


def fit_machine(results: list[dict[str, Any]], scenario: Path) -> dict[str, dict[str, float]]:
    """The machine-wide figures, each the median over the calibration configurations:
    compute_factor (the accelerator's time inside decode against the isolated microbenchmarks':
    old x measured eval / simulated eval) and load_overhead_ms.in_decode (a warm load's CPU
    inside decode: old + (measured - simulated blocked) / loads per step), from the warm ones;
    then the cold ones' (fit_budget_evict, fit_latency). The layer lead's configuration fits
    its own hand-over only: it is left out of every machine-wide figure."""
    from sim.profiles import load_scenario

    warm = [r for r in results if r["config"]["page_cache"] == "all"]
    machine_wide = [r for r in results if r["config"].get("path") != LAYER_LEAD]
    cal = [r for r in machine_wide if r["config"]["page_cache"] == "all"]
    if not cal:
        return {}
    sc = load_scenario(str(scenario))
    hw = sc.hardware
    out: dict[str, dict[str, float]] = {}
    old_cf = current_fit(scenario, "compute_factor") or hw.compute_factor
    ratios = [r["measured"]["eval_ms_per_step"] / r["simulated"]["eval_ms_per_step"]
              for r in cal if not looks_ahead(r)
              and (r["simulated"].get("eval_ms_per_step") or 0) > 0
              and r["measured"].get("eval_ms_per_step") is not None]
    if ratios:
        new_cf = max(old_cf * statistics.median(ratios), 0.05)
        write_fit(scenario, "compute_factor", new_cf,
                  f"fitted by ssdmoe validate: median measured / simulated eval per decode step "
                  f"over {len(ratios)} calibration configuration(s) of the synchronous decode "
                  f"loop (before this fit: {old_cf:.4f})")
        out["compute_factor"] = {"before": old_cf, "after": new_cf}
    out.update(fit_dispatch(cal, scenario, sc.model.dispatch_cpu_ms_per_layer))
    for path in FILL_PATHS:
        key = f"fill_ms_per_layer.{path}"
        old_fill = current_fit(scenario, key)
        out.update(_shift(
            scenario, key, sc.model.fill_ms_per_layer if old_fill is None else old_fill,
            [(r["measured"]["eval_ms_per_step"] - r["simulated"]["eval_ms_per_step"])
             / r["layers"] for r in warm if looks_ahead(r) and fill_path(r["config"]) == path
             and r["simulated"].get("eval_ms_per_step") is not None
             and r["measured"].get("eval_ms_per_step") is not None],
            f"fitted by ssdmoe validate: the {path} path's main-thread work per layer as the "
            "lookahead loop hands work over, from eval ms over layers of {n} calibration "
            "configuration(s) (isolated calibrate probe, CPU inside async_eval: "
            f"{sc.model.fill_ms_per_layer:.4f} ms)"))
    out.update(_shift(
        scenario, "load_overhead_ms.in_decode",
        current_fit(scenario, "load_overhead_ms.in_decode") or hw.load_overhead_ms,
        _per_load(cal, "blocked_ms_per_step"),
        "fitted by ssdmoe validate: a warm load's main-thread cost inside decode, from blocked "
        "ms over loads per step of {n} calibration configurations (isolated calibrate loop: "
        f"{hw.load_overhead_ms:.4f} ms)"))
    out.update(fit_budget_evict(machine_wide, scenario))
    out.update(fit_latency(machine_wide, scenario, hw.ssd_latency_ms, sc.model.bundle_reads))
    out.update(fit_handoff(machine_wide, scenario, hw.handoff_ms))
    out.update(fit_reader_wake(machine_wide, scenario, hw.reader_wake_ms))
    out.update(fit_cold_fill(machine_wide, scenario, lookahead=True))
    out.update(fit_cold_fill(machine_wide, scenario, lookahead=False))
    return out


def fit_dispatch(warm: list[dict[str, Any]], scenario: Path,
                 isolated: float) -> dict[str, dict[str, float]]:
    """dispatch_cpu_ms_per_layer.in_decode from the warm calibration configurations of the
    lookahead loop (machine-wide: the layer lead's left out by the caller): old +
    median((measured - simulated main-thread CPU per step) / layers).
    The main thread's CPU by part (reports/cross-machine, "The main thread by part") puts
    its gap in MLX's dispatch: calibrate's probe hands the resident walk to each router over
    alone, decode hands its walks over beside a busy compute thread."""
    deltas = [(r["measured"]["main_cpu_ms_per_step"] - r["simulated"]["main_cpu_ms_per_step"])
              / r["layers"] for r in warm if looks_ahead(r)
              and r["measured"].get("main_cpu_ms_per_step") is not None
              and r["simulated"].get("main_cpu_ms_per_step") is not None]
    return _shift(
        scenario, "dispatch_cpu_ms_per_layer.in_decode",
        current_fit(scenario, "dispatch_cpu_ms_per_layer.in_decode") or isolated, deltas,
        "fitted by ssdmoe validate: MLX's dispatch on the main thread per layer inside decode, "
        "from its measured CPU less the simulated over layers in {n} warm calibration "
        f"configuration(s) of the lookahead loop (calibrate's probe: {isolated:.4f} ms)")


def fit_cold_fill(results: list[dict[str, Any]], scenario: Path,
                  lookahead: bool = True) -> dict[str, dict[str, float]]:
    """cold_fill_compute_ms.in_decode (the lookahead loop; .sync the synchronous one) from the
    calibration configurations of that loop that read cold (a page-cache budget, unthrottled;
    the layer lead's is left out by the caller): old + median((measured - simulated eval per
    step) / measured fills per step that waited on a cold load). Calibrate's stall probes stand
    for it, but they move from run to run; this is what such a fill cost inside the run being
    predicted."""
    cold = [r for r in _reads_cold(results) if looks_ahead(r) == lookahead]
    deltas = [(r["measured"]["eval_ms_per_step"] - r["simulated"]["eval_ms_per_step"])
              / r["measured"]["cold_fills_per_step"] for r in cold
              if (r["measured"].get("cold_fills_per_step") or 0) > 0
              and r["simulated"].get("eval_ms_per_step") is not None]
    key = "cold_fill_compute_ms." + ("in_decode" if lookahead else "sync")
    old = current_fit(scenario, key) or 0.0
    loop = "lookahead" if lookahead else "synchronous"
    return _shift(
        scenario, key, old, deltas,
        "fitted by ssdmoe validate: the compute thread's next work after a fill that waited on "
        "a cold load, from eval ms over such fills per step in {n} calibration "
        f"configuration(s) of the {loop} loop (before this fit: {old:.4f} ms)")


def looks_ahead(result: dict[str, Any]) -> bool:
    """The configuration decoded in the lookahead loop (the setting sim compare derived from
    its trace's run.json)."""
    return "lookahead=true" in result.get("settings", [])


def fit_handoff(results: list[dict[str, Any]], scenario: Path,
                isolated: float) -> dict[str, dict[str, float]]:
    """handoff_ms.in_decode from the calibration configurations whose reader threads read cold
    (a path with readers under a page-cache budget, unthrottled): the main thread's blocked
    time per fill past its loads' span, measured - simulated. Not the whole blocked time: that
    holds the reads too, and a fit to it turned their miss into a hand-off."""
    readers = [r for r in _reads_cold(results) if r["config"]["path"] != "on-demand"]
    deltas = _differences(readers, "blocked_past_loads_ms")
    return _shift(
        scenario, "handoff_ms.in_decode",
        current_fit(scenario, "handoff_ms.in_decode") or isolated, deltas,
        "fitted by ssdmoe validate: the hand-off of a reader's load the main thread waits for, "
        "inside decode, from the blocked ms per fill past its loads' span in {n} calibration "
        f"configuration(s) (isolated calibrate loop: {isolated:.4f} ms)")


def fit_reader_wake(results: list[dict[str, Any]], scenario: Path,
                    isolated: float) -> dict[str, dict[str, float]]:
    """reader_wake_ms.in_decode from the calibration configurations whose reader threads read
    (measured and simulated both have loads started by an idle reader)."""
    deltas = _differences([r for r in results
                           if r["config"].get("role", "calibration") == "calibration"],
                          "reader_start_ms")
    return _shift(
        scenario, "reader_wake_ms.in_decode",
        current_fit(scenario, "reader_wake_ms.in_decode") or isolated, deltas,
        "fitted by ssdmoe validate: how late an idle reader thread starts a load handed to it "
        "inside decode, from the delay between a load's issue and its start on such a reader "
        "in {n} calibration configuration(s) (isolated calibrate loop: "
        f"{isolated:.4f} ms)")


def _reads_cold(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calibration configurations that read cold at the device's own speed: a page-cache
    budget, unthrottled."""
    return [r for r in results if r["config"].get("role", "calibration") == "calibration"
            and r["config"]["page_cache"] != "all"
            and r["config"].get("storage") == "unthrottled"]


def _reads_cold_on_main(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calibration configurations that read cold on the main thread only: on-demand under
    a page-cache budget, unthrottled."""
    return [r for r in _reads_cold(results) if r["config"]["path"] == "on-demand"]


def fit_latency(results: list[dict[str, Any]], scenario: Path, isolated: float,
                bundle_reads: int) -> dict[str, dict[str, float]]:
    """ssd_latency_ms.in_decode = old + median(measured - simulated mean cold read ms) /
    bundle_reads, over the configurations that read cold on the main thread (a read there
    is the device's and the store's alone: the main thread does nothing else meanwhile)."""
    cold = _reads_cold_on_main(results)
    return _shift(
        scenario, "ssd_latency_ms.in_decode",
        current_fit(scenario, "ssd_latency_ms.in_decode") or isolated,
        [(d / max(bundle_reads, 1)) for d in _differences(cold, "cold_read_ms")],
        "fitted by ssdmoe validate: the device's time per read request inside decode, from the "
        "mean cold read on the main thread of {n} calibration configuration(s) over "
        f"{bundle_reads} preads a bundle (isolated calibrate probe: {isolated:.4f} ms)")


def fit_budget_evict(results: list[dict[str, Any]],
                     scenario: Path) -> dict[str, dict[str, float]]:
    """budget_evict_ms.in_decode from the calibration configurations that read cold on the main
    thread only (on-demand under a page-cache budget): the main-thread work the engine's
    emulated page-cache budget adds per cold read (it drops an evicted bundle's pages after the
    read, outside the read's wait), old + median(measured - simulated slope of build time over
    cold loads across one capture's decode steps).
    A cold read's own time is fit_latency's alone: a cold overhead fitted from the same
    configuration's blocked time per cold load (mostly that read) would correct the read's gap a
    second time, and the repeated fit (validation.matrix_run.FIT_ROUNDS) would swing instead of
    settling (reports/validation/history.md). Both sit inside the read, so one configuration
    cannot split them; the device's latency takes the gap and the cold overhead stays
    calibrate's isolated figure."""
    cold = _reads_cold_on_main(results)
    old = current_fit(scenario, "budget_evict_ms.in_decode") or 0.0
    return _shift(
        scenario, "budget_evict_ms.in_decode", old,
        _differences(cold, "build_per_cold_read_ms"),
        "fitted by ssdmoe validate: main-thread work per cold read under the engine's page-cache "
        "budget (dropping the evicted bundle's pages, and what else a cold read leaves the main "
        "thread), from the slope of build time over cold loads across the decode steps of {n} "
        f"calibration configuration(s) (before this fit: {old:.4f} ms)")
