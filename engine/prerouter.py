"""The cross-token prerouter (edge0 paper digest, section 2): prediction used AS the routing.

A head owned by MoE layer N runs at token t on layer N's post-attention-norm output x and
predicts the router logits of layer N+1 at token t+1 (one layer down, one token ahead):

    u = concat(x [D], onehot(top-k of N executed at t) [E], onehot(top-k of N at t-1) [E])
    logits_{N+1}(t+1) = fc2(gelu(fc1(u))) + skip(u)

`skip` is warm-started from layer N+1's router on the x part (zeros on the one-hots) and fc2
from zeros, so an untrained head is "apply the next router to this state". At decode, layer
N+1 does not run its router: the predicted logits go through the same routing math
(engine.routing) with layer N+1's own spec and bias, so the set staged ahead IS the routed set.
Calls of more than one token (prefill) use their own routers; the heads then run on the last
token only, so the first decode token is predicted too.

`PrerouteLink` is the per-request state the MoE blocks share: the owners' executed ids at the
previous token, and the predicted (ids, weights) for the next call. Predictions made while a
call is built are for the NEXT call, so they go to `ahead` and only become `now` when the next
call starts (its first MoE layer flips them): with the decode loop's lookahead the next step
is built while this one computes, and a consumer must never see its own token's prediction.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from contract.errors import BadInput
from engine.first_layer_hint import FirstLayerHint
from engine.routing import RoutingSpec, route

WEIGHTS = "prerouter.safetensors"
META = "prerouter.json"


@dataclass
class PrerouterSpec:
    owners: list[int]  # MoE layer N owns the head predicting layer N+1
    dims: int  # hidden size D
    experts: int  # E
    top_k: int
    hidden: int = 128  # head width (the paper uses 512 at D=2048)
    report: dict = field(default_factory=dict)  # training and held-out figures

    @property
    def consumers(self) -> list[int]:
        return [n + 1 for n in self.owners]


def owners_for(moe_layers: list[int]) -> list[int]:
    """Every MoE layer whose next layer is a MoE layer owns a head."""
    layers = set(moe_layers)
    return [n for n in sorted(layers) if n + 1 in layers]


class PrerouterHead(nn.Module):
    """logits = fc2(gelu(fc1(u))) + skip(u), u = concat(x, onehot(ids at t), onehot(ids at
    t-1)) (no previous token: zeros).

    fc1 and skip share their input, so they are one projection [D + 2E -> H + E]; and a
    matmul of a one-hot set is the sum of the set's rows, so the one-hot parts are a table
    lookup (`ids` rows of `table`, ids at t-1 offset by E) instead of a [2E]-wide matmul: the
    same numbers (tests/test_prerouter.py checks them against the concatenated form) with
    fewer and smaller operations."""

    def __init__(self, dims: int, experts: int, hidden: int):
        super().__init__()
        self.experts, self.hidden = experts, hidden
        self.proj = nn.Linear(dims, hidden + experts)  # [fc1 | skip] on x, one bias for both
        self.fc2 = nn.Linear(hidden, experts)
        scale = (dims + 2 * experts) ** -0.5  # nn.Linear's init for the full input width
        self.proj.weight = mx.random.uniform(-scale, scale, self.proj.weight.shape)
        # [fc1 | skip] on the one-hots: rows 0..E-1 for the ids at t, E..2E-1 for t-1
        self.table = mx.random.uniform(-scale, scale, (2 * experts, hidden + experts))
        self.proj.bias = mx.zeros_like(self.proj.bias)

    def __call__(self, x: mx.array, inds: mx.array, prev: mx.array | None) -> mx.array:
        ids = inds if prev is None else mx.concatenate([inds, prev + self.experts], axis=-1)
        z = self.proj(x) + mx.take(self.table, ids, axis=0).sum(axis=-2)
        h, skip = z[..., :self.hidden], z[..., self.hidden:]
        return self.fc2(nn.gelu(h)) + skip

    def warm_start(self, next_router: mx.array) -> None:
        """skip = [W_router(N+1) | 0 | 0], fc2 = 0: the head starts as the next router."""
        h = self.hidden
        w = self.proj.weight
        self.proj.weight = mx.concatenate([w[:h], next_router.astype(w.dtype)], axis=0)
        self.table = mx.concatenate(
            [self.table[:, :h], mx.zeros((2 * self.experts, self.experts))], axis=1)
        self.fc2.weight = mx.zeros_like(self.fc2.weight)
        self.fc2.bias = mx.zeros_like(self.fc2.bias)


class Prerouter(nn.Module):
    def __init__(self, spec: PrerouterSpec):
        super().__init__()
        self.spec = spec
        self.hint: FirstLayerHint | None = None  # the first MoE layer's token table
        self.heads = {f"layer{n}": PrerouterHead(spec.dims, spec.experts, spec.hidden)
                      for n in spec.owners}

    @classmethod
    def warm_started(cls, spec: PrerouterSpec, routers: dict[int, mx.array],
                     seed: int = 0) -> Prerouter:
        """Fresh heads (seeded fc1) that start as "apply the next router": routers maps each
        consumer layer to its router weight [E, D]."""
        mx.random.seed(seed)
        pre = cls(spec)
        for n in spec.owners:
            pre.head(n).warm_start(routers[n + 1])
        mx.eval(pre.parameters())
        return pre

    def head(self, owner: int) -> PrerouterHead:
        return self.heads[f"layer{owner}"]

    def save(self, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        flat = dict(nn.utils.tree_flatten(self.parameters()))
        mx.save_safetensors(str(out_dir / WEIGHTS), flat)
        (out_dir / META).write_text(json.dumps(asdict(self.spec), indent=1) + "\n")
        if self.hint is not None:
            self.hint.save(out_dir)

    @classmethod
    def load(cls, src: Path) -> Prerouter:
        src = Path(src)
        meta, weights = src / META, src / WEIGHTS
        for f in (meta, weights):
            if not f.is_file():
                raise BadInput(f"{f}: no such file (a prerouter directory holds {META} and "
                               f"{WEIGHTS}; make one with `ssdmoe train heads`)")
        try:
            spec = PrerouterSpec(**json.loads(meta.read_text()))
        except (ValueError, TypeError) as err:
            raise BadInput(f"{meta}: not a prerouter description ({err})") from None
        pre = cls(spec)
        try:
            pre.load_weights(str(weights), strict=True)
        except Exception as err:  # noqa: BLE001 - mlx raises ValueError/RuntimeError
            raise BadInput(f"{weights}: does not match {meta} ({err})") from None
        mx.eval(pre.parameters())
        return pre

    @classmethod
    def load_for(cls, src: Path, manifest) -> Prerouter:
        """`load`, then `check` against a converted model's manifest."""
        pre = cls.load(src)
        pre.check(manifest.moe_layers, manifest.config["hidden_size"], manifest.num_experts,
                  manifest.top_k, Path(src))
        pre.hint = FirstLayerHint.load(Path(src), int(manifest.config["vocab_size"]),
                                       manifest.num_experts)
        return pre

    def check(self, moe_layers: list[int], dims: int, experts: int, top_k: int,
              where: Path) -> None:
        s = self.spec
        got, want = (s.dims, s.experts, s.top_k), (dims, experts, top_k)
        if got != want:
            raise BadInput(f"{where}: heads are for (hidden, experts, K) = {got}, the model "
                           f"has {want}")
        bad = [n for n in s.owners if n not in moe_layers or n + 1 not in moe_layers]
        if bad:
            raise BadInput(f"{where}: head owners {bad} are not MoE layers followed by a MoE "
                           f"layer in this model")


class StackedHeads:
    """All heads as one batched computation (the paper's "one flush per step"): run once per
    call, after the last owner layer, on every owner's last-token input. On a small model a
    step is a few hundred dispatched operations, so O heads of a dozen operations each would
    cost more than the heads' arithmetic; stacked, they are one dozen."""

    def __init__(self, prerouter: Prerouter):
        spec = prerouter.spec
        heads = [prerouter.head(n) for n in spec.owners]
        self.experts, self.hidden = spec.experts, spec.hidden
        e, h = spec.experts, spec.hidden
        self.w_x = mx.stack([hd.proj.weight.T for hd in heads])  # [O, D, H+E]
        self.b_x = mx.stack([hd.proj.bias for hd in heads])  # [O, H+E]
        # all one-hot tables in one [O*2E + 1, H+E] table; the last row (zeros) stands for
        # "no previous token"
        tables = [hd.table for hd in heads] + [mx.zeros((1, h + e))]
        self.table = mx.concatenate(tables, axis=0)
        self.none = len(heads) * 2 * e
        self.offsets = mx.array([[o * 2 * e] for o in range(len(heads))], dtype=mx.uint32)
        self.w_2 = mx.stack([hd.fc2.weight.T for hd in heads])  # [O, H, E]
        self.b_2 = mx.stack([hd.fc2.bias for hd in heads])  # [O, E]
        mx.eval(self.w_x, self.b_x, self.table, self.offsets, self.w_2, self.b_2)

    def __call__(self, x: mx.array, ids: mx.array, prev: mx.array) -> mx.array:
        """x [O, D], ids [O, K], prev [O, K] (ids at t-1; `no_prev(o)` where there is none)
        -> logits [O, E], the heads' outputs in owner order."""
        h = self.hidden
        rows = mx.concatenate([ids + self.offsets, prev + self.offsets + self.experts], axis=-1)
        z = (x[:, None, :] @ self.w_x)[:, 0] + self.b_x + self.table[rows].sum(axis=1)
        return (nn.gelu(z[:, :h])[:, None, :] @ self.w_2)[:, 0] + self.b_2 + z[:, h:]

    def no_prev(self, owner_index: int, k: int) -> mx.array:
        """ids that `__call__` maps to the zero row: head `owner_index` has no token t-1."""
        return mx.full((1, k), self.none - owner_index * 2 * self.experts - self.experts,
                       mx.uint32)


class PrerouteLink:
    """Per-request prerouting state shared by the MoE blocks of one model."""

    same_token = False  # predictions are for the next token (engine.layer_lead: this one)

    def __init__(self, prerouter: Prerouter, first: int, spec: RoutingSpec,
                 bias: Callable[[], mx.array | None]):
        self.heads = StackedHeads(prerouter)
        self.owners = list(prerouter.spec.owners)
        self.last_owner = max(self.owners)
        self.first = first  # the first MoE layer: a new call starts there
        self.spec = spec  # the consumers' routing spec (one for all)
        self.bias = bias  # () -> the consumers' expert biases [O, E], or None
        # heads + routing as one compiled function: fewer dispatched operations per step
        # (weights and biases are fixed once loaded, so they are compiled in as constants)
        self.predict = mx.compile(
            lambda x, ids, prev: route(self.spec, self.heads(x, ids, prev), self.bias()))
        self.reset()

    def reset(self) -> None:
        """A new request: no previous token, nothing predicted."""
        self.prev: dict[int, mx.array] = {}
        self.inputs: dict[int, tuple[mx.array, mx.array, mx.array | None]] = {}
        self.now: dict[int, tuple[mx.array, mx.array]] = {}
        self.ahead: dict[int, tuple[mx.array, mx.array]] = {}

    def routing(self, layer: int, tokens: int) -> tuple[mx.array, mx.array] | None:
        """The predicted (ids, weights) this call of `layer` must use, or None (route)."""
        if layer == self.first:
            self.now, self.ahead = self.ahead, {}
        pred = self.now.pop(layer, None)
        return pred if tokens == 1 else None

    def observe(self, layer: int, x: mx.array, inds: mx.array) -> None:
        """After `layer` routed (x [..., D], executed ids [..., K]): an owner keeps its last
        token's head input; after the last owner all heads run at once and predict the next
        call's routing of every consumer layer."""
        if layer not in self.owners:
            return
        d, k = x.shape[-1], inds.shape[-1]
        x, inds = x.reshape(-1, d), inds.reshape(-1, k)
        prev = inds[-2:-1] if inds.shape[0] > 1 else self.prev.get(layer)
        self.prev[layer] = inds[-1:]
        self.inputs[layer] = (x[-1:], inds[-1:], prev)
        if layer == self.last_owner:
            self._flush()

    def _flush(self) -> None:
        rows = [self.inputs[n] for n in self.owners]
        k = rows[0][1].shape[-1]
        x = mx.concatenate([r[0] for r in rows], axis=0)
        ids = mx.concatenate([r[1] for r in rows], axis=0)
        prev = mx.concatenate([r[2] if r[2] is not None else self.heads.no_prev(o, k)
                               for o, r in enumerate(rows)], axis=0)
        inds, weights = self.predict(x, ids.astype(mx.uint32), prev.astype(mx.uint32))
        self.inputs = {}
        self.ahead = {n + 1: (inds[o:o + 1], weights[o:o + 1])
                      for o, n in enumerate(self.owners)}

    def pending(self) -> dict[int, mx.array]:
        """{consumer layer: predicted ids [1, K]} for the next call (lazy arrays)."""
        return {layer: inds for layer, (inds, _) in self.ahead.items()}


def router_weight(gate: nn.Module) -> mx.array:
    """The [E, D] weight of an mlx-lm router (nn.Linear, or bailing's gate with gate_proj)."""
    lin = getattr(gate, "gate_proj", gate)
    return lin.weight


def install(blocks: dict, prerouter: Prerouter) -> PrerouteLink:
    """Give the streaming MoE blocks ({layer: StreamingMoE}) one shared link to `prerouter`."""
    consumers = [blocks[c] for c in prerouter.spec.consumers]
    specs = {b.spec for b in consumers}
    if len(specs) != 1:
        raise BadInput(f"prerouter: consumer layers route differently ({sorted(map(str, specs))})"
                       "; the stacked heads need one routing spec")
    biases = [b.expert_bias() for b in consumers]
    stacked = None if any(v is None for v in biases) else mx.stack(biases)
    link = PrerouteLink(prerouter, min(blocks), specs.pop(), lambda: stacked)
    for block in blocks.values():
        block.preroute = link
    return link
