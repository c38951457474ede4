"""What tests of the expert store share: destination rows for one expert, and a skip where the
filesystem cannot drop file pages (so no read there can be cold)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.store import ExpertStore


def expert_buffers(store: ExpertStore, layer: int) -> dict[str, np.ndarray]:
    """Zeroed rows for one expert of `layer`, one per tensor slice."""
    return {n: np.zeros(s, dtype=dt) for n, (s, dt) in store.expert_shapes(layer).items()}


def needs_real_page_cache(store: ExpertStore) -> None:
    """Drop the store's pages; skip the test where they stay resident."""
    store.drop_page_cache()
    if store.page_cache_bytes() != 0:
        pytest.skip("this filesystem keeps file pages resident (tmpfs?): fadvise cannot drop")
