"""The `ssdmoe` command line. Engine commands import MLX lazily, inside the command body,
so `ssdmoe sim ...` and `ssdmoe trace ...` work on machines without MLX."""

from __future__ import annotations

import sys

import typer

from contract.errors import BadInput, IOFault
from ssdmoe_cli import (
    advise_cmd,
    bench_cmd,
    calibrate_cmd,
    capture_cmd,
    demo_cmd,
    eval_cmd,
    fixture_cmd,
    loadtest_cmd,
    lora_cmds,
    model_cmds,
    serve_cmd,
    sim_cmds,
    trace_cmds,
    train_cmds,
    validate_cmd,
)

app = typer.Typer(
    name="ssdmoe",
    help="Serve MoE models from SSD, record traces, and simulate other hardware.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode="markdown",
)



@app.callback()
def root(device: str | None = typer.Option(
        None, "--device", envvar="SSDMOE_DEVICE",
        help="MLX backend for engine commands: cpu or gpu (Metal, CUDA) [default: MLX's].")
         ) -> None:
    """Serve MoE models from SSD, record traces, and simulate other hardware."""
    if device is not None:  # imports MLX only when asked: sim and trace run without it
        from engine.device import select

        select(device)


for module in (demo_cmd, fixture_cmd, model_cmds, capture_cmd, bench_cmd, calibrate_cmd,
               validate_cmd, eval_cmd, serve_cmd, loadtest_cmd, advise_cmd):
    module.register(app)
app.add_typer(trace_cmds.app, name="trace")
app.add_typer(sim_cmds.app, name="sim")
app.add_typer(train_cmds.app, name="train")
app.add_typer(lora_cmds.app, name="lora")


def main() -> None:
    try:
        app()
    except (BadInput, IOFault) as err:  # one line, never a traceback
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
