"""Training phase 1, head distillation (edge0 paper digest, "Training"): only the prerouter
heads train; the base model is frozen as it is served (the converted int4 checkpoint: "train
what you serve"). Each head N learns to imitate layer N+1's true router one token ahead:

    loss = KL(softmax(router_{N+1}(x_{N+1}(t+1))) || softmax(head_N(x_N(t), ids_N(t), ids_N(t-1))))

Data: windows of the model's own training text (for the fixtures, the same Python-stdlib
corpus; any UTF-8 text file otherwise), run once through the served model to record, per
owner layer, the head inputs and the next layer's router logits one token later. Then heads
train on those records (cheap: the base model does not run again).

Held-out report, per head and averaged: recall of the next token's top-K (how many of the K
routed experts the prediction got), against two baselines the head must beat
(reference/machine-notes.md): reuse (the next layer's set at the current token) and the warm
start (the next router applied to this layer's state, what an untrained head predicts).

And the price: held-out next-token cross-entropy with the model's own routing and with the
heads' predictions as routing (`forward_prerouted`), and how often the greedy tokens agree.
Recovering that loss is the later phases' work (the recovery LoRA), not this one's."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from engine.first_layer_hint import FirstLayerHint, fit_table
from engine.fixtures.train_loop import forward_with_taps, set_recall, window_batches
from engine.fixtures.two_stream_training import two_stream_training
from engine.prerouter import Prerouter, PrerouterSpec, owners_for, router_weight
from engine.routing import RoutingSpec, route


@dataclass
class HeadData:
    """Records of one owner layer N: rows are positions t with a previous token."""
    x: np.ndarray  # [R, D] layer N's MoE input at t
    ids: np.ndarray  # [R, K] layer N's routed ids at t
    prev: np.ndarray  # [R, K] layer N's routed ids at t-1
    target: np.ndarray  # [R, E] layer N+1's router logits at t+1
    reuse: np.ndarray  # [R, K] layer N+1's routed ids at t (the reuse baseline)


@dataclass
class HeadsConfig:
    hidden: int = 128
    steps: int = 600
    batch: int = 512
    lr: float = 2e-3
    weight_decay: float = 0.01
    seq_len: int = 128
    train_windows: int = 256
    eval_windows: int = 64
    seed: int = 0


@dataclass
class FirstLayerData:
    """Records of the first MoE layer (no head predicts it: engine.first_layer_hint)."""
    tokens: np.ndarray  # [R] the input token ids
    logits: np.ndarray  # [R, E] the layer's router logits there
    routed: np.ndarray  # [R, K] its routed ids


def record(model: nn.Module, tokens: np.ndarray, seq_len: int, windows: int,
           batch: int = 16, first: list[tuple] | None = None) -> dict[int, HeadData]:
    """Run `windows` windows of `tokens` (spread evenly) through the model; return each owner
    layer's head records. `first`: also appends the first layer's (tokens, router logits,
    routed ids) per batch (`first_layer_data` joins them)."""
    layers = model.model.layers
    owners = owners_for(list(range(len(layers))))
    parts: dict[int, list[list[np.ndarray]]] = {o: [[], [], [], [], []] for o in owners}
    for rows in window_batches(tokens, seq_len, windows, batch):
        w = mx.array(rows[:, :-1])
        _, taps = forward_with_taps(model, w)
        logits = {o + 1: layers[o + 1].mlp.gate(taps[o + 1].x) for o in owners}
        first_logits = layers[0].mlp.gate(taps[0].x) if first is not None else None
        mx.eval([t.x for t in taps], [t.inds for t in taps], list(logits.values()),
                [] if first_logits is None else [first_logits])
        if first_logits is not None:
            e, k = first_logits.shape[-1], taps[0].inds.shape[-1]
            first.append((rows[:, :-1].reshape(-1), np.array(first_logits).reshape(-1, e),
                          np.array(taps[0].inds).reshape(-1, k)))
        for o in owners:
            x, ids = np.array(taps[o].x), np.array(taps[o].inds)
            nxt_ids, nxt_logits = np.array(taps[o + 1].inds), np.array(logits[o + 1])
            p = parts[o]
            # t runs over 1 .. L-2: a previous token and a next one inside the window
            p[0].append(x[:, 1:-1].reshape(-1, x.shape[-1]))
            p[1].append(ids[:, 1:-1].reshape(-1, ids.shape[-1]))
            p[2].append(ids[:, :-2].reshape(-1, ids.shape[-1]))
            p[3].append(nxt_logits[:, 2:].reshape(-1, nxt_logits.shape[-1]))
            p[4].append(nxt_ids[:, 1:-1].reshape(-1, ids.shape[-1]))
    return {o: HeadData(*(np.concatenate(a) for a in parts[o])) for o in owners}


def first_layer_data(parts: list[tuple]) -> FirstLayerData:
    return FirstLayerData(*(np.concatenate([p[i] for p in parts]) for i in range(3)))


def fit_first_layer_hint(model: nn.Module, train: FirstLayerData, held: FirstLayerData,
                         k: int) -> tuple[FirstLayerHint, dict]:
    """The first layer's token table (engine.first_layer_hint) fitted on `train`; its
    held-out recall beside the previous position's routed set (what reusing it would get)."""
    embeddings = np.array(model.model.embed_tokens(mx.arange(model.args.vocab_size)))
    table = fit_table(embeddings, train.tokens, train.logits, k)
    previous = set_recall(held.routed[:-1], held.routed[1:])
    report = {"heldout_recall": set_recall(table[held.tokens], held.routed),
              "previous_position_recall": previous, "train_rows": int(len(train.tokens)),
              "heldout_rows": int(len(held.tokens))}
    return FirstLayerHint(table), report


def train_first_layer_hint(model: nn.Module, train_tokens: np.ndarray,
                           eval_tokens: np.ndarray, cfg: HeadsConfig | None = None
                           ) -> tuple[FirstLayerHint, dict]:
    """The first layer's token table alone (for heads trained before it existed): the same
    records `train_heads` fits it on."""
    cfg = cfg or HeadsConfig()
    train: list[tuple] = []
    held: list[tuple] = []
    with two_stream_training(model):
        record(model, train_tokens, cfg.seq_len, cfg.train_windows, first=train)
        record(model, eval_tokens, cfg.seq_len, cfg.eval_windows, first=held)
    return fit_first_layer_hint(model, first_layer_data(train), first_layer_data(held),
                                model.model.layers[0].mlp.top_k)


def kl_loss(pred_logits: mx.array, target_logits: mx.array) -> mx.array:
    """Mean KL(teacher || student) over rows."""
    t = target_logits - mx.logsumexp(target_logits, axis=-1, keepdims=True)
    s = pred_logits - mx.logsumexp(pred_logits, axis=-1, keepdims=True)
    return (mx.exp(t) * (t - s)).sum(axis=-1).mean()


def topk_ids(logits: np.ndarray, k: int) -> np.ndarray:
    return np.argpartition(-logits, k - 1, axis=-1)[..., :k]


def evaluate(pre: Prerouter, data: dict[int, HeadData], routers: dict[int, mx.array]) -> dict:
    """Held-out recall of the next token's top-K: trained head, reuse, warm start."""
    rows = []
    k = pre.spec.top_k
    for o, d in data.items():
        truth = topk_ids(d.target, k)
        logits = pre.head(o)(mx.array(d.x), mx.array(d.ids), mx.array(d.prev))
        warm = mx.array(d.x) @ routers[o + 1].T
        mx.eval(logits, warm)
        rows.append({"owner": o, "consumer": o + 1, "rows": int(len(d.x)),
                     "head_recall": set_recall(topk_ids(np.array(logits), k), truth),
                     "reuse_recall": set_recall(d.reuse, truth),
                     "warm_start_recall": set_recall(topk_ids(np.array(warm), k), truth),
                     "kl": float(kl_loss(logits, mx.array(d.target)).item())})
    mean = {key: float(np.mean([r[key] for r in rows]))
            for key in ("head_recall", "reuse_recall", "warm_start_recall", "kl")}
    return {"per_head": rows, **{f"{key}_mean": v for key, v in mean.items()}}


@dataclass
class PreroutedState:
    """What incremental calls of `forward_prerouted` (with a KV cache) carry across calls: per
    owner layer its executed ids at the last position, per consumer layer the prediction its
    owner made there (for the next position)."""
    prev_ids: dict[int, mx.array] = field(default_factory=dict)
    pred: dict[int, mx.array] = field(default_factory=dict)


def forward_prerouted(model: nn.Module, pre: Prerouter, inputs: mx.array, cache=None,
                      state: PreroutedState | None = None,
                      routing_log: list | None = None) -> mx.array:
    """Logits of a qwen3_moe-style model when each consumer layer routes position t >= 1 by
    its owner's head at position t-1 (prediction as routing, as the engine decodes; position
    0 routes itself, as a prompt does). The heads' one-hot inputs are the ids each owner layer
    EXECUTED, predicted ones included: the feature drift the engine has at decode.
    With `cache` (mlx-lm's KV cache) and `state`, calls continue a sequence: the first
    position of a call is routed by the prediction the previous call made.
    `routing_log` collects (consumer layer, predicted ids, own router's ids) [B, L, K] at the
    positions routed by prediction: how far prediction and the layer's own choice agree."""
    from mlx_lm.models.base import create_attention_mask

    inner = model.model
    h = inner.embed_tokens(inputs)
    caches = cache if cache is not None else [None] * len(inner.layers)
    mask = create_attention_mask(h, caches[0])
    owners = set(pre.spec.owners)
    pred = None  # [B, L, E]: this layer's logits for position t+1, made at position t
    for i, (layer, c) in enumerate(zip(inner.layers, caches, strict=True)):
        h = h + layer.self_attn(layer.input_layernorm(h), mask, c)
        x = layer.post_attention_layernorm(h)
        moe = layer.mlp
        logits = moe.gate(x)
        if pred is not None:
            first = state.pred.get(i) if state is not None else None
            first = logits[:, :1] if first is None else first
            own = logits
            logits = mx.concatenate([first, pred[:, :-1]], axis=1)
            if state is not None:
                state.pred[i] = pred[:, -1:]
            if routing_log is not None:
                k = moe.top_k
                routing_log.append((i, mx.argpartition(-logits[:, 1:], k - 1, axis=-1)[..., :k],
                                    mx.argpartition(-own[:, 1:], k - 1, axis=-1)[..., :k]))
        spec = RoutingSpec("softmax_topk", moe.top_k, bool(moe.norm_topk_prob))
        inds, weights = route(spec, logits)
        y = moe.switch_mlp(x, inds)
        h = h + (y * weights[..., None]).sum(axis=-2)
        pred = None
        if i in owners:
            head = pre.head(i)
            before = state.prev_ids.get(i) if state is not None else None
            # no previous token at a sequence's first position
            first = head(x[:, :1], inds[:, :1], before)
            rest = head(x[:, 1:], inds[:, 1:], inds[:, :-1])
            pred = mx.concatenate([first, rest], axis=1)
            if state is not None:
                state.prev_ids[i] = inds[:, -1:]
    h = inner.norm(h)
    if model.args.tie_word_embeddings:
        return inner.embed_tokens.as_linear(h)
    return model.lm_head(h)


def lm_quality(model: nn.Module, pre: Prerouter, tokens: np.ndarray, seq_len: int,
               windows: int, batch: int = 16) -> dict:
    """Held-out next-token cross-entropy with the model's own routing and with predicted
    routing, and how often their greedy next tokens agree."""
    ce_base = ce_pre = agree = 0.0
    n = 0
    for rows in window_batches(tokens, seq_len, windows, batch):
        n += len(rows)
        w = mx.array(rows)
        base = model(w[:, :-1])
        routed = forward_prerouted(model, pre, w[:, :-1])
        a = nn.losses.cross_entropy(base, w[:, 1:], reduction="sum")
        b = nn.losses.cross_entropy(routed, w[:, 1:], reduction="sum")
        same = (base.argmax(-1) == routed.argmax(-1)).sum()
        mx.eval(a, b, same)
        ce_base, ce_pre, agree = ce_base + a.item(), ce_pre + b.item(), agree + same.item()
    count = n * seq_len
    return {"windows": int(n), "ce_base": ce_base / count, "ce_prerouted": ce_pre / count,
            "greedy_agreement": agree / count}


def train_heads(model: nn.Module, train_tokens: np.ndarray, eval_tokens: np.ndarray,
                cfg: HeadsConfig | None = None, progress=None) -> Prerouter:
    """Distill one head per owner layer from the frozen model; returns the heads with the
    training and held-out figures in `spec.report`."""
    cfg = cfg or HeadsConfig()
    t0 = time.perf_counter()
    layers = model.model.layers
    moe = layers[0].mlp
    owners = owners_for(list(range(len(layers))))
    if not owners:
        raise ValueError("the model has no pair of consecutive MoE layers: nothing to predict")
    spec = PrerouterSpec(owners=owners, dims=model.args.hidden_size, experts=moe.num_experts,
                         top_k=moe.top_k, hidden=cfg.hidden)
    routers = {o + 1: router_weight(layers[o + 1].mlp.gate) for o in owners}
    pre = Prerouter.warm_started(spec, routers, seed=cfg.seed)
    with two_stream_training(model):  # the same records, two cores (its module doc)
        first_train: list[tuple] = []
        first_held: list[tuple] = []
        train = record(model, train_tokens, cfg.seq_len, cfg.train_windows,
                       first=first_train)
        held = record(model, eval_tokens, cfg.seq_len, cfg.eval_windows, first=first_held)
    t_record = time.perf_counter() - t0
    hint, hint_report = fit_first_layer_hint(model, first_layer_data(first_train),
                                             first_layer_data(first_held), spec.top_k)
    before = evaluate(pre, held, routers)

    arrays = {o: tuple(mx.array(a) for a in (d.x, d.ids, d.prev, d.target))
              for o, d in train.items()}

    def loss_fn(pre: Prerouter, picks: mx.array) -> mx.array:
        total = mx.array(0.0)
        for o, (x, ids, prev, target) in arrays.items():
            logits = pre.head(o)(x[picks], ids[picks], prev[picks])
            total = total + kl_loss(logits, target[picks])
        return total / len(arrays)

    opt = optim.AdamW(learning_rate=optim.cosine_decay(cfg.lr, cfg.steps, cfg.lr * 0.1),
                      weight_decay=cfg.weight_decay)
    step = nn.value_and_grad(pre, loss_fn)
    rng = np.random.default_rng(cfg.seed)
    rows = len(next(iter(train.values())).x)
    history = []
    t1 = time.perf_counter()
    for i in range(cfg.steps):
        picks = mx.array(rng.integers(0, rows, size=min(cfg.batch, rows)))
        loss, grads = step(pre, picks)
        opt.update(pre, grads)
        mx.eval(loss, pre.parameters(), opt.state)
        if i % 50 == 0 or i == cfg.steps - 1:
            history.append({"step": i + 1, "loss": float(loss.item())})
        if progress is not None:
            progress(i + 1, float(loss.item()))
    t_train = time.perf_counter() - t1
    after = evaluate(pre, held, routers)
    with two_stream_training(model):
        quality = lm_quality(model, pre, eval_tokens, cfg.seq_len, cfg.eval_windows)
    spec.report = {
        "phase": "head distillation (phase 1)", "config": cfg.__dict__,
        "train_rows_per_head": rows, "heldout_rows_per_head": len(next(iter(held.values())).x),
        "record_s": round(t_record, 1), "train_s": round(t_train, 1),
        "heldout_before": before, "heldout": after, "lm_heldout": quality, "history": history,
        "first_layer_hint": hint_report,
    }
    pre.hint = hint
    return pre


def corpus_tokens(tokenizer, text_file: Path | None, heldout_mod: int = 20
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) token streams: the fixtures' stdlib corpus by default, else a UTF-8
    text file split 19:1 by paragraph blocks."""
    from engine.fixtures.corpus import CorpusConfig, assemble_corpus

    if text_file is None:
        corpus = assemble_corpus(CorpusConfig(heldout_mod=heldout_mod))
        train_docs = [t for _, t in corpus.train]
        held_docs = [t for _, t in corpus.heldout]
    else:
        blocks = Path(text_file).read_text(encoding="utf-8").split("\n\n")
        train_docs = [b for i, b in enumerate(blocks) if i % heldout_mod]
        held_docs = [b for i, b in enumerate(blocks) if not i % heldout_mod]

    def encode(docs: list[str]) -> np.ndarray:
        return np.asarray(tokenizer.encode("\n\n".join(docs)), dtype=np.int32)

    return encode(train_docs), encode(held_docs)
