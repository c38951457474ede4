"""A candidate on a machine as a simulator scenario, and many of them run in parallel.

The scenario is what `sim compare` would build from a capture of the candidate on that
machine (sim.compare.scenario_for on a PlannedRun): the engine configuration's mapping, the
machine's record, this machine's fits inside decode where its calibrated scenario has them.
Routing is the model profile's statistics fitted to traces at each K (routing_stats = model),
or a captured trace's routing replayed (`--routing`, per K)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from advise.machine import Machine
from advise.model import ModelInfo
from advise.space import Candidate
from contract.errors import BadInput
from sim.scenario import Scenario


@dataclass
class Setting:
    """What every candidate shares: the model, the machine, the hardware profile (None: this
    machine's calibrated one), and how the run is simulated."""

    model: ModelInfo
    machine: Machine
    hardware: str | None = None
    sets: list[str] = field(default_factory=list)  # --set overrides, applied last
    prompt_tokens: int = 64
    decode_steps: int | None = None  # None: the base scenario's
    routing: dict[int, str] = field(default_factory=dict)  # K -> a trace whose routing replays

    def routing_note(self, k: int) -> str:
        if k in self.routing:
            return f"routing replayed from {self.routing[k]}"
        if self.model.routing_k:
            return (f"routing statistics of scenarios/models/{self.model.profile}.toml (fitted "
                    f"at K={', '.join(map(str, self.model.routing_k))})")
        return "synthetic routing with the scenario's overlap and skew (no fitted statistics)"


def scenario(setting: Setting, cand: Candidate) -> Scenario:
    """The scenario for one candidate (BadInput: the profile or a value is wrong)."""
    from sim.compare import PlannedRun, scenario_for

    m = setting.model
    heads = m.heads.get(cand.k)
    if cand.arm == "staged-token" and heads is None:
        raise BadInput(f"K={cand.k}: no prerouter heads for {m.where} (it has them for K="
                       f"{', '.join(map(str, sorted(m.heads))) or 'none'}); the token lead "
                       f"needs them (ssdmoe train heads {m.where} --top-k {cand.k})")
    cfg = cand.engine_config(m.expert_bytes, heads,
                             setting.machine.page_cache_budget(m.expert_bytes))
    run = {"model": m.run_model(), "engine": {**cfg.to_dict(), "k": cand.k},
           "extra": setting.machine.run_extra()}
    sets = [f"prefill_tokens={setting.prompt_tokens}"]
    if setting.decode_steps is not None:
        sets.append(f"decode_steps={setting.decode_steps}")
    if cand.k not in setting.routing and m.routing_k:
        sets.append("routing_stats=model")
    sc, _, _ = scenario_for(PlannedRun(run, f"advise: {cand.label}"), sets=setting.sets + sets,
                            hardware=setting.hardware)
    sc.name = cand.label
    return sc


def predict(setting: Setting, cands: list[Candidate], workers: int | None = None,
            backend: str = "local", address: str | None = None,
            progress: Callable[[int, int], None] | None = None) -> list[dict[str, Any]]:
    """Simulated figures per candidate (sim.sweep's row: status, error, SUMMARY_KEYS and the
    simulator's own), in order."""
    from sim.sweep import STATUS_FAILED, one_line, run_calls, run_scenario_point

    args: list[tuple] = []
    built: list[dict[str, Any] | None] = []
    for cand in cands:
        try:
            args.append((scenario(setting, cand), setting.routing.get(cand.k)))
            built.append(None)
        except BadInput as err:  # this candidate cannot be built: a failed row, not the search
            built.append({"status": STATUS_FAILED, "error": one_line(err)})
    rows = iter(run_calls(run_scenario_point, args, workers, progress, backend, address)
                if args else [])
    return [b if b is not None else next(rows) for b in built]
