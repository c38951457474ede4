"""`ssdmoe eval`: where quality is lost and how much each training phase recovers, on held-out
text, against the unquantized teacher.

Rows (each a way of running the same base):
  teacher            the unquantized source model (fp32), run by mlx-lm
  int4 own routers   the converted model as `load_resident` serves it, every layer routing
                     itself
  int4 prerouted     routing of the consumer layers by the heads' predictions one token ahead
                     (`forward_prerouted`, as the engine decodes), no adapter
  + LoRA <phase>     the same with a recovery adapter (phase 2 sft, phase 3 distill, or any
                     adapter given)

Per row, on `windows` held-out windows of `seq_len` tokens (teacher forcing):
  ce, ppl            next-token cross-entropy (nats/token) and its exponential
  top1, top5         agreement of the logits with the teacher's: same argmax; |top-5 sets'
                     intersection| / 5
  greedy             free-running agreement: from `prompts` held-out prompts each row
                     greedily continues `greedy_tokens` tokens; the share of positions whose
                     token equals the teacher's continuation there
  routing            prerouted rows: recall of the routed (predicted) sets against the sets the
                     layer's own router picks on the same hidden state, per consumer layer
And once: the heads' held-out recall@K of the next layer's true routing (the base model's own
hidden states, as `train heads` reports it), the reuse baseline beside it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.fixtures.train_loop import set_recall, window_batches
from engine.prerouter import Prerouter
from engine.train.heads import forward_prerouted


@dataclass
class EvalConfig:
    seq_len: int = 128
    windows: int = 64
    prompts: int = 32
    prompt_len: int = 16
    greedy_tokens: int = 32
    batch: int = 16


@dataclass
class Row:
    name: str
    model: nn.Module
    pre: Prerouter | None = None  # routing by prediction when set
    adapter: dict = field(default_factory=dict)  # provenance of its LoRA, if any


def logits_of(row: Row, x: mx.array, log: list | None = None) -> mx.array:
    if row.pre is None:
        return row.model(x)
    return forward_prerouted(row.model, row.pre, x, routing_log=log)


def _topk(a: mx.array, k: int) -> np.ndarray:
    return np.array(mx.argpartition(-a, k - 1, axis=-1)[..., :k])


def teacher_forced(rows: list[Row], teacher: Row, tokens: np.ndarray, cfg: EvalConfig
                   ) -> dict[str, dict]:
    """ce / top-1 / top-5 against the teacher, and routing agreement, per row."""
    acc = {r.name: {"ce": 0.0, "top1": 0.0, "top5": 0.0, "routing": {}} for r in rows}
    n = 0
    for batch in window_batches(tokens, cfg.seq_len, cfg.windows, cfg.batch):
        x, y = mx.array(batch[:, :-1]), mx.array(batch[:, 1:])
        t_logits = teacher.model(x)
        t1, t5 = np.array(t_logits.argmax(-1)), _topk(t_logits, 5)
        n += y.size
        for r in rows:
            log: list = []
            lg = t_logits if r is teacher else logits_of(r, x, log)
            ce = nn.losses.cross_entropy(lg, y, reduction="sum")
            mx.eval(ce, lg)
            a = acc[r.name]
            a["ce"] += ce.item()
            a["top1"] += float((np.array(lg.argmax(-1)) == t1).sum())
            a["top5"] += set_recall(_topk(lg, 5), t5) * y.size
            for layer, used, own in log:
                a["routing"].setdefault(layer, []).append(set_recall(np.array(used),
                                                                     np.array(own)))
    out = {}
    for r in rows:
        a = acc[r.name]
        per_layer = {str(k): float(np.mean(v)) for k, v in sorted(a["routing"].items())}
        out[r.name] = {"ce": a["ce"] / n, "ppl": math.exp(a["ce"] / n), "top1": a["top1"] / n,
                       "top5": a["top5"] / n, "routing_per_layer": per_layer,
                       "routing_mean": float(np.mean(list(per_layer.values())))
                       if per_layer else None}
    return out


def greedy_agreement(rows: list[Row], teacher: Row, tokens: np.ndarray,
                     cfg: EvalConfig) -> dict[str, float]:
    """Each row's greedy continuation of held-out prompts against the teacher's."""
    from engine.train.recovery_lora import prompts_from, sample, student_forward, teacher_forward

    prompts = prompts_from(tokens, cfg.prompts, cfg.prompt_len, 0, 5, "held-out text")
    total = cfg.prompt_len + cfg.greedy_tokens

    def continuation(r: Row) -> np.ndarray:
        fwd, make = (teacher_forward(r.model) if r.pre is None
                     else student_forward(r.model, r.pre))
        return sample(fwd, make, prompts, total, 0.0, 0)[:, cfg.prompt_len:]

    ref = continuation(teacher)
    return {r.name: float((continuation(r) == ref).mean()) if r is not teacher else 1.0
            for r in rows}


def evaluate(rows: list[Row], teacher: Row, tokens: np.ndarray, cfg: EvalConfig) -> dict:
    forced = teacher_forced(rows, teacher, tokens, cfg)
    greedy = greedy_agreement(rows, teacher, tokens, cfg)
    return {r.name: {**forced[r.name], "greedy": greedy[r.name], "adapter": r.adapter}
            for r in rows}


def recovery(results: dict, own: str, prerouted: str, recovered: str) -> float | None:
    """Share of the cross-entropy gap (prerouted - own routers) that `recovered` closes."""
    gap = results[prerouted]["ce"] - results[own]["ce"]
    if gap <= 0:
        return None
    return (results[prerouted]["ce"] - results[recovered]["ce"]) / gap


def heads_recall(model: nn.Module, pre: Prerouter, tokens: np.ndarray, cfg: EvalConfig) -> dict:
    """The heads' held-out recall@K of the next layer's true routing on the base model's own
    hidden states, with the reuse baseline (as `train heads` reports it)."""
    from engine.prerouter import router_weight
    from engine.train.heads import evaluate as evaluate_heads
    from engine.train.heads import record

    data = record(model, tokens, cfg.seq_len, cfg.windows, cfg.batch)
    layers = model.model.layers
    routers = {o + 1: router_weight(layers[o + 1].mlp.gate) for o in pre.spec.owners}
    rep = evaluate_heads(pre, data, routers)
    return {"per_head": [{k: r[k] for k in ("owner", "consumer", "head_recall", "reuse_recall")}
                         for r in rep["per_head"]],
            "head_recall_mean": rep["head_recall_mean"],
            "reuse_recall_mean": rep["reuse_recall_mean"]}


def markdown(report: dict) -> str:
    rows = report["rows"]
    consumers = sorted({int(k) for r in rows.values() for k in r["routing_per_layer"]})
    head = ("| row | ce | ppl | greedy | top-1 | top-5 | routing | "
            + " | ".join(f"L{c}" for c in consumers) + " | gap recovered |")
    lines = [f"# Quality: {report['model']} at K={report['top_k']}", "",
             f"`{report['command']}` (model manifest sha {report['manifest_sha256'][:12]}); "
             f"teacher {report['teacher']}, heads {report['heads']}; "
             f"{report['config']['windows']} held-out windows of {report['config']['seq_len']} "
             f"tokens; greedy over {report['config']['prompts']} prompts x "
             f"{report['config']['greedy_tokens']} tokens. Agreement is with the teacher; "
             "routing is the recall of the routed (predicted) sets against the layer's own "
             "router on the same state.", "", head,
             "|" + "---|" * (8 + len(consumers))]
    for name, r in rows.items():
        per = [f"{r['routing_per_layer'][str(c)]:.3f}" if str(c) in r["routing_per_layer"]
               else "" for c in consumers]
        rec = report["gap_recovered"].get(name)
        routing = "" if r["routing_mean"] is None else f"{r['routing_mean']:.3f}"
        lines.append(f"| {name} | {r['ce']:.4f} | {r['ppl']:.2f} | {r['greedy']:.3f} | "
                     f"{r['top1']:.3f} | {r['top5']:.3f} | {routing} | " + " | ".join(per)
                     + f" | {'' if rec is None else f'{100 * rec:.0f}%'} |")
    h = report["heads_recall"]
    lines += ["", f"Heads' held-out recall@K of the next layer's true routing: "
              f"{h['head_recall_mean']:.3f} (reuse baseline {h['reuse_recall_mean']:.3f}); per "
              "head: " + ", ".join(f"{r['owner']}->{r['consumer']} {r['head_recall']:.3f}"
                                   for r in h["per_head"]) + "."]
    return "\n".join(lines)
