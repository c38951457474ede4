"""Sweep points on a Ray cluster (`sim sweep --backend ray`): the same grid, the same
`run_point` per point, so the rows are the local backend's, only computed elsewhere.

Ray is an optional extra (`uv sync --extra ray`). With no cluster address, `ray.init()` starts
a local one for the sweep and shuts it down afterwards; with RAY_ADDRESS (or `address`) the
sweep joins that cluster and leaves it running. No MLX here."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from contract.errors import BadInput, IOFault


def ray_module():
    # Under `uv run`, Ray by default re-creates the project's environment for its workers with
    # `uv run` (without the ray extra, so they die at `import ray` and the sweep hangs). The
    # workers should use this interpreter's environment, as they do without uv. Read at import.
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    try:
        import ray
    except ImportError:
        raise BadInput("--backend ray: Ray is not installed (install the extra: uv sync "
                       "--extra ray)") from None
    return ray


def run_points(point_args: list[tuple], run_point: Callable[..., dict[str, Any]],
               one_line: Callable[[BaseException], str], address: str | None = None,
               progress: Callable[[int, int], None] | None = None,
               stall_s: float = 600.0) -> list[dict[str, Any]]:
    """run_point(*args) for every args on Ray; results in the order of `point_args`."""
    ray = ray_module()
    started = not ray.is_initialized()
    if started:
        ray.init(address=address, include_dashboard=False, logging_level="ERROR",
                 log_to_driver=False)
    try:
        remote = ray.remote(num_cpus=1)(run_point)
        pending = {remote.remote(*a): i for i, a in enumerate(point_args)}
        results: list[dict[str, Any] | None] = [None] * len(point_args)
        done = 0
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=stall_s)
            if not ready:
                raise IOFault(f"--backend ray: no point finished in {stall_s:.0f} s (Ray's workers "
                              "may not start: see /tmp/ray/session_latest/logs)")
            for ref in ready:
                i = pending.pop(ref)
                try:
                    results[i] = ray.get(ref)
                except Exception as err:  # noqa: BLE001 - a worker died: that point failed
                    results[i] = {"status": "failed", "error": one_line(err)}
                done += 1
                if progress:
                    progress(done, len(point_args))
        return [r or {} for r in results]
    finally:
        if started:
            ray.shutdown()
