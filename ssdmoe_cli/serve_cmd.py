"""`ssdmoe serve MODEL` (the OpenAI-compatible HTTP API, server/) and `ssdmoe chat MODEL` (an
interactive terminal chat). MLX is imported inside the command bodies only."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from contract.errors import BadInput
from ssdmoe_cli.options import (
    CachePolicy,
    HotMb,
    Lead,
    LoraDir,
    NoLora,
    Readers,
    StagedHeadroom,
    check_engine_options,
    served_lora,
)

LOOPBACK = ("127.0.0.1", "localhost", "::1")

Model = Annotated[Path, typer.Argument(help="Converted model directory (ssdmoe convert).")]
Preset = Annotated[str, typer.Option(
    "--preset", help="Engine preset: on-demand (exact), hot, staged.")]
Heads = Annotated[Path | None, typer.Option(
    "--prerouter", help="Prerouter heads (default: MODEL/prerouter when present).")]
NoHeads = Annotated[bool, typer.Option("--no-prerouter", help="Route with the model's routers.")]
TopK = Annotated[int | None, typer.Option(
    "--top-k", help="Route at K experts per token (heads and adapter trained for that K).")]


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
    app.command("chat")(chat)


def load_served(model: Path, preset: str, prerouter: Path | None, no_prerouter: bool,
                lora: Path | None, no_lora: bool, top_k: int | None, trace: Path | None = None,
                force: bool = False, on_load=None, readers: int | None = None,
                cache_policy: str | None = None, hot_mb: float | None = None,
                lead: str = "none", staged_headroom: int | None = None):
    """-> the Engine as `serve` and `chat` run it (the model's heads by default, unless
    --no-prerouter or the layer lead)."""
    from contract.engine_config import EngineConfig
    from engine.loader import load_streaming
    from ssdmoe_cli.train_cmds import heads_dir

    if prerouter is not None and no_prerouter:
        raise BadInput("--prerouter and --no-prerouter exclude each other")
    check_engine_options(hot_mb, staged_headroom)
    if prerouter is None and not no_prerouter and lead != "layer":
        default = heads_dir(Path(model), top_k)
        prerouter = default if (default / "prerouter.json").is_file() else None
    if trace is not None:
        from engine.capture import prepare_out_dir

        trace = prepare_out_dir(trace, force, "--trace")
    config = EngineConfig.from_preset(
        preset, top_k=top_k, readers=readers, cache_policy=cache_policy,
        lead_kind="token" if prerouter is not None and lead == "none" else lead,
        hot_bytes=None if hot_mb is None else int(hot_mb * 2**20),
        staged_headroom=staged_headroom,
        prerouter=None if prerouter is None else str(prerouter),
        lora=served_lora(model, lora, no_lora, prerouter, top_k))
    return load_streaming(model, config=config, on_load=on_load)


def serve(
    model: Model,
    host: Annotated[str, typer.Option("--host", help="Address to bind (loopback by default).")]
        = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port.")] = 8000,
    preset: Preset = "staged",
    prerouter: Heads = None,
    no_prerouter: NoHeads = False,
    lora: LoraDir = None,
    no_lora: NoLora = False,
    top_k: TopK = None,
    trace: Annotated[Path | None, typer.Option(
        "--trace", help="Record every request into this new trace directory (request = the "
        "number in the response id).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing --trace.")] = False,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar="SSDMOE_API_KEY",
        help="Require Authorization: Bearer KEY on /v1/ (default: none).")] = None,
    max_tokens: Annotated[int, typer.Option(
        "--max-tokens-limit", help="The most tokens one request may ask for.")] = 512,
    max_body: Annotated[int, typer.Option(
        "--max-body-bytes", help="Largest request body accepted.")] = 1 << 20,
    name: Annotated[str | None, typer.Option(
        "--model-id", help="Model name clients ask for (default: MODEL's directory name).")]
        = None,
    readers: Readers = None,
    cache_policy: CachePolicy = None,
    hot_mb: HotMb = None,
    lead: Lead = "none",
    staged_headroom: StagedHeadroom = None,
    max_queue: Annotated[int, typer.Option(
        "--max-queue", help="Requests that may wait for the engine; beyond, 503 with "
        "Retry-After.")] = 64,
    request_timeout: Annotated[float, typer.Option(
        "--request-timeout", help="Seconds from a request's arrival to its last token; "
        "beyond, it ends with a 408.")] = 600.0,
    body_timeout: Annotated[float, typer.Option(
        "--body-timeout", help="Seconds to receive a request's body.")] = 30.0,
    verify_reads: Annotated[bool, typer.Option(
        "--verify-reads/--no-verify-reads", help="Check every cold expert read against the "
        "manifest's crc32 (models converted with checksums).")] = True,
    cors_origins: Annotated[list[str] | None, typer.Option(
        "--cors-origin", help="Origin allowed to call from a browser (repeat it; default: "
        "any, '*'; 'none' turns CORS off).")] = None,
) -> None:
    """Serve MODEL over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models,
    /tokenize, /detokenize, /health, /metrics; streaming as Server-Sent Events), one request at
    a time in FIFO order."""
    if not 0 < port < 65536:
        raise BadInput(f"--port: must be in 1..65535, got {port}")
    if max_tokens < 1 or max_body < 1 or max_queue < 1:
        raise BadInput("--max-tokens-limit, --max-body-bytes and --max-queue must be >= 1")
    if not (request_timeout > 0 and body_timeout > 0):
        raise BadInput("--request-timeout and --body-timeout must be > 0 seconds")
    check_api_key(api_key)
    origins = ["*"] if cors_origins is None else [o for o in cors_origins if o != "none"]
    if host not in LOOPBACK and api_key is None:
        typer.echo(f"warning: serving on {host}, reachable from other machines, with no "
                   "authentication: anyone who can connect can use it (give --api-key)",
                   err=True)
    import uvicorn

    from engine.capture import start_recorder
    from engine.manifest import MANIFEST_FILE, sha256_file
    from server.app import ServeConfig, create_app
    from server.worker import Worker

    engine = load_served(model, preset, prerouter, no_prerouter, lora, no_lora, top_k, trace,
                         force, readers=readers, cache_policy=cache_policy, hot_mb=hot_mb,
                         lead=lead, staged_headroom=staged_headroom)
    config = engine.config
    engine.store.verify_cold = verify_reads
    rec = None if trace is None else start_recorder(trace, engine)
    m = engine.manifest
    cfg = ServeConfig(
        model_id=name or Path(model).resolve().name, max_tokens=max_tokens,
        context=int(m.config.get("max_position_embeddings") or 4096), max_body_bytes=max_body,
        api_key=api_key, max_queue=max_queue, request_timeout_s=request_timeout,
        body_timeout_s=body_timeout, cors_origins=origins,
        created=int(m.path(MANIFEST_FILE).stat().st_mtime),
        metadata={"preset": config.preset, "prerouter": config.prerouter, "lora": config.lora,
                  "verify_reads": verify_reads,
                  "top_k": m.top_k,
                  "fingerprint": sha256_file(m.path(MANIFEST_FILE))[:12]})
    worker = Worker(engine, rec, max_queue=max_queue)
    app = create_app(worker, cfg)
    typer.echo(f"serving {cfg.model_id} on http://{host}:{port}/v1 (preset {config.preset}, "
               f"heads {config.prerouter or 'none'}, lora {config.lora or 'none'})", err=True)
    import signal

    from server.http_errors import JSONErrorsProtocol

    stopped_by: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        # uvicorn shuts down gracefully on these, then re-raises the signal under the handler
        # it found: this one, so the process ends through the cleanup below with status 0
        signal.signal(sig, lambda s, frame: stopped_by.append(s))

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            app.state.begin_shutdown()  # every stream gets its error event and [DONE]
            super().handle_exit(sig, frame)

    try:
        Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                              http=JSONErrorsProtocol, timeout_graceful_shutdown=10)).run()
    finally:
        worker.close()
        if rec is not None:
            rec.close()  # the trace keeps every finished step
        engine.close()
    typer.echo("server stopped", err=True)
    # Everything is closed and the trace flushed. The engine ran MLX on the worker thread, and
    # MLX can abort in its exit-time destructors when used from a sub-thread
    # (ml-explore/mlx#3126: "terminate called without an active exception", SIGABRT, here
    # about one shutdown in seven): leave without running them.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def check_api_key(key: str | None) -> None:
    """An API key must be something a client can send in a header: not empty, printable
    ASCII."""
    if key is None:
        return
    if not key:
        raise BadInput("--api-key: empty (an empty key would turn authentication off; omit "
                       "the option for none)")
    if not all(" " < c <= "~" for c in key):
        raise BadInput("--api-key: only printable ASCII without spaces can be sent in an "
                       "Authorization header")


def chat(
    model: Model,
    preset: Preset = "staged",
    prerouter: Heads = None,
    no_prerouter: NoHeads = False,
    lora: LoraDir = None,
    no_lora: NoLora = False,
    top_k: TopK = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens per reply.")] = 128,
    temp: Annotated[float, typer.Option("--temp", help="Sampling temperature.")] = 0.8,
    seed: Annotated[int, typer.Option("--seed", help="Sampling seed.")] = 0,
    readers: Readers = None,
    cache_policy: CachePolicy = None,
) -> None:
    """Chat in the terminal through the chat template; replies stream as they come. Line
    editing and history; Ctrl-C stops a reply; /help lists the commands (/reset, /stats,
    /quit)."""
    if max_tokens < 1 or temp < 0:
        raise BadInput("--max-tokens must be >= 1 and --temp >= 0")
    from server import chat_terminal
    from server.chat_session import ChatSession

    loads: list[dict] = []
    engine = load_served(model, preset, prerouter, no_prerouter, lora, no_lora, top_k,
                         on_load=loads.append, readers=readers, cache_policy=cache_policy)
    try:
        config = engine.config
        session = ChatSession(engine, loads, max_tokens=max_tokens, temp=temp, seed=seed)
        chat_terminal.run(session, f"ssdmoe chat: {Path(model).name} (preset {config.preset}, "
                          f"heads {config.prerouter or 'none'}, lora {config.lora or 'none'}, "
                          f"context {session.context}); /help for commands")
    finally:
        engine.close()
