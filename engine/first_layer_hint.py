"""The first MoE layer's reads, started when the step's token is on the host.

No prerouter head predicts the first MoE layer (a head sits one layer above the layer it
predicts), so on the token lead that layer's experts are read after its own router, on the
critical path: at a 1/4 page cache most of the step's blocked time (reports/io/token-lead).
Its router reads the token's embedding plus the first attention's output, and most of its
choice follows the token alone (first_layer_probe.py there: 0.81 of the routed set from the
embedding). So a table [vocab, K] maps each token id to the K experts that a linear map of
its embedding ranks highest: ridge regression onto the router's logits, fitted by `ssdmoe
train heads` on the records the heads are fitted on, saved beside them.

When a decode step's token reaches the host (engine.fill_points.begin), its row's experts
start reading into the first layer's free slots as prefetches. The router still decides:
this is a hint, not the routing, so a wrong hint costs a read and a slot, never the output.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from contract.errors import BadInput

HINT_FILE = "first_layer_hint.npy"
RIDGE = 1.0  # the probe's regularisation: the map is well determined at this data size


def fit_table(embeddings: np.ndarray, tokens: np.ndarray, logits: np.ndarray, k: int,
              lam: float = RIDGE) -> np.ndarray:
    """[vocab, K] int16: per token id, the top-K of a ridge map (with an intercept) from the
    token's embedding [D] to the first MoE layer's router logits [E], fitted on the positions
    (`tokens` [N] input ids, `logits` [N, E] the router's logits there). Float64 throughout."""
    emb = np.asarray(embeddings, dtype=np.float64)
    x = np.concatenate([emb[np.asarray(tokens)], np.ones((len(tokens), 1))], axis=1)
    w = np.linalg.solve(x.T @ x + lam * np.eye(x.shape[1]),
                        x.T @ np.asarray(logits, dtype=np.float64))
    scores = np.concatenate([emb, np.ones((len(emb), 1))], axis=1) @ w
    return np.argsort(-scores, axis=1, kind="stable")[:, :k].astype(np.int16)


@dataclass
class FirstLayerHint:
    table: np.ndarray  # int16 [vocab, K]

    def experts(self, token: int) -> list[int]:
        """The experts to start reading for `token` (an id outside the table: none)."""
        if 0 <= token < len(self.table):
            return self.table[token].tolist()
        return []

    def save(self, out_dir: Path) -> None:
        np.save(Path(out_dir) / HINT_FILE, self.table, allow_pickle=False)

    @classmethod
    def load(cls, prerouter_dir: Path, vocab: int, experts: int) -> FirstLayerHint | None:
        """The table in a prerouter directory, checked against the model; None when the
        directory has none (heads trained before the hint existed)."""
        path = Path(prerouter_dir) / HINT_FILE
        if not path.is_file():
            return None
        try:
            table = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as err:
            raise BadInput(f"{path}: not a first-layer hint table ({err}); fit it again "
                           "with `ssdmoe train hint`") from None
        if table.ndim != 2 or table.shape[0] != vocab or not np.issubdtype(table.dtype,
                                                                           np.integer):
            raise BadInput(f"{path}: a first-layer hint table must be integer [vocab={vocab}, "
                           f"K], got {table.dtype} {list(table.shape)}")
        if table.size and (table.min() < 0 or table.max() >= experts):
            raise BadInput(f"{path}: expert ids outside 0..{experts - 1}")
        return cls(table.astype(np.int16))
