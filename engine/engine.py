"""What loading a streaming model gives (`engine.loader.load_streaming`): the mlx-lm model with
its streaming MoE blocks, the tokenizer, the expert store (I/O only) and the runtime (config,
readers, paths, fill points, step clock, counters, prerouter, adapter). generate, capture,
bench, the recorder and the server take it; closing it closes the readers, then the files."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from contract.engine_config import EngineConfig
    from engine.generate import GenerationResult
    from engine.manifest import Manifest
    from engine.paths.stats import PathStats
    from engine.runtime import Runtime
    from engine.store import ExpertStore


@dataclass
class Engine:
    model: Any  # an mlx-lm model whose MoE blocks are engine.moe.StreamingMoE
    tokenizer: Any  # mlx-lm's TokenizerWrapper
    store: ExpertStore
    runtime: Runtime

    @property
    def config(self) -> EngineConfig:
        return self.runtime.config

    @property
    def stats(self) -> PathStats:
        """The counters every path of this engine adds to (hits, misses, syncs, blocked)."""
        return self.runtime.stats

    @property
    def manifest(self) -> Manifest:
        return self.store.manifest

    def generate(self, prompt: str | list[int], max_tokens: int = 64, **options: Any
                 ) -> GenerationResult:
        """engine.generate.generate on this engine (options: its keyword arguments)."""
        from engine.generate import generate

        return generate(self.model, self.tokenizer, prompt, max_tokens, runtime=self.runtime,
                        **options)

    def close(self) -> None:
        self.runtime.close()
        self.store.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
