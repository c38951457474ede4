"""Training phases 2 and 3 (edge0 paper digest, "Training"): the recovery LoRA on the student
path. The base is frozen at the dequantized int4 weights ("train what you serve": the routed
experts of the converted checkpoint, dequantized once; the resident part as served); the
prerouter heads are frozen too and routing is by their predictions (`forward_prerouted`), as
the engine decodes. The teacher is the unquantized source model, run by mlx-lm as it is.

  phase 2, sft      the teacher samples continuations of corpus prompts; the student learns
                    them (next-token cross-entropy on the generated positions)
  phase 3, distill  the phase-2 student samples continuations (on-policy), the teacher scores
                    them; loss = reverse KL(student || teacher) over the teacher's top-k
                    tokens plus one tail bucket (the rest of the vocabulary), on about a
                    tenth of phase 2's rows

A run is fixed by its identity (phase, seed, base and heads sha, K, config): the data it
generates, its batch order (one numpy generator per step) and its LoRA init all follow from it,
so a run resumed from its checkpoint ends with the same adapter as an uninterrupted one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from contract.errors import BadInput
from engine import lora
from engine.prerouter import Prerouter
from engine.train.heads import PreroutedState, forward_prerouted
from engine.train.lora_checkpoint import Checkpoint, atomic_text

PHASES = ("sft", "distill")
Progress = Callable[[str, int, int, str], None]  # (stage, done, total, note)


@dataclass
class LoraTrainConfig:
    phase: str = "sft"
    rank: int = lora.RANK
    alpha: float = lora.ALPHA
    steps: int = 200
    batch: int = 8
    seq_len: int = 128
    prompt_len: int = 16  # corpus tokens each sample continues
    sequences: int = 1920  # generated sequences (distill: a tenth of sft's)
    temp: float = 1.0  # sampling temperature of the generating model
    lr: float = 1e-3
    teacher_top_k: int = 32  # distill: the teacher's top-k the reverse KL runs over
    seed: int = 0
    checkpoint_every: int = 25

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise BadInput(f"phase {self.phase!r}: one of {', '.join(PHASES)}")
        for name in ("rank", "steps", "batch", "sequences", "checkpoint_every",
                     "teacher_top_k"):
            if getattr(self, name) < 1:
                raise BadInput(f"--{name.replace('_', '-')}: must be >= 1, got "
                               f"{getattr(self, name)}")
        if not 1 <= self.prompt_len < self.seq_len:
            raise BadInput(f"--prompt-len: must be in 1..{self.seq_len - 1}, got "
                           f"{self.prompt_len}")


# ---------------------------------------------------------------- models


def dequantize_experts(model: nn.Module) -> None:
    """Replace each MoE layer's quantized routed experts by float SwitchLinears holding their
    dequantized int4 weights: the same numbers, and a faster gather on CPU for training."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    for layer in model.model.layers:
        sm = getattr(getattr(layer, "mlp", None), "switch_mlp", None)
        if sm is None:
            continue
        for name in ("gate_proj", "up_proj", "down_proj"):
            q = getattr(sm, name)
            if not isinstance(q, QuantizedSwitchLinear):
                continue
            w = mx.dequantize(q.weight, q.scales, q.biases, group_size=q.group_size,
                              bits=q.bits, mode=q.mode)
            lin = SwitchLinear(w.shape[2], w.shape[1], w.shape[0], bias=False)
            lin.weight = w
            setattr(sm, name, lin)
    model.freeze()
    mx.eval(model.parameters())


def load_teacher(path: Path, student: nn.Module) -> nn.Module:
    """The unquantized source model, through mlx-lm's own loader; refuses one whose vocabulary
    or layer count differs from the student's."""
    from mlx_lm.utils import load_model

    path = Path(path)
    if not (path / "config.json").is_file():
        raise BadInput(f"{path}: no config.json (the teacher is the unquantized mlx-lm model "
                       "the converted one came from; give it with --teacher)")
    try:
        teacher, _ = load_model(path)
    except Exception as err:  # noqa: BLE001 - mlx-lm raises many kinds
        raise BadInput(f"{path}: cannot load the teacher ({type(err).__name__}: {err})") from None
    a, b = teacher.args, student.args
    for key in ("vocab_size", "num_hidden_layers", "hidden_size"):
        if getattr(a, key) != getattr(b, key):
            raise BadInput(f"{path}: teacher {key} {getattr(a, key)} differs from the "
                           f"student's {getattr(b, key)}")
    teacher.freeze()
    return teacher


# ---------------------------------------------------------------- data


def prompts_from(tokens: np.ndarray, n: int, prompt_len: int, seed: int, salt: int,
                 where: str) -> np.ndarray:
    """`n` prompts of `prompt_len` tokens, drawn at seeded random offsets of a token stream."""
    if len(tokens) < prompt_len + 1:
        raise BadInput(f"{where}: too short for one prompt ({len(tokens)} tokens, need "
                       f"{prompt_len + 1})")
    rng = np.random.default_rng([seed, salt])
    starts = rng.integers(0, len(tokens) - prompt_len, size=n)
    return np.stack([tokens[s:s + prompt_len] for s in starts]).astype(np.int32)


def sample(forward: Callable, make_cache: Callable, prompts: np.ndarray, total_len: int,
           temp: float, seed: int, batch: int = 64) -> np.ndarray:
    """Continue every prompt to `total_len` tokens by sampling at `temp`, `batch` sequences at
    a time with a KV cache. forward(x [B, L], cache) -> logits [B, L, V]."""
    key = mx.random.key(seed)
    out = []
    for b0 in range(0, len(prompts), batch):
        x = mx.array(prompts[b0:b0 + batch])
        cache = make_cache()
        logits = forward(x, cache)[:, -1]
        seq = [x]
        for _ in range(total_len - x.shape[1]):
            key, sub = mx.random.split(key)
            tok = (mx.random.categorical(logits / temp, key=sub) if temp > 0
                   else logits.argmax(-1))[:, None]
            seq.append(tok)
            logits = forward(tok, cache)[:, -1]
            mx.eval(logits)
        out.append(np.array(mx.concatenate(seq, axis=1)))
    return np.concatenate(out).astype(np.int32)


def student_forward(model: nn.Module, pre: Prerouter):
    """(forward(x, cache), make_cache) of the student with routing by prediction."""
    from mlx_lm.models.cache import make_prompt_cache

    state: list[PreroutedState] = []

    def make_cache():
        state[:] = [PreroutedState()]
        return make_prompt_cache(model)

    return (lambda x, cache: forward_prerouted(model, pre, x, cache, state[0])), make_cache


def teacher_forward(teacher: nn.Module):
    from mlx_lm.models.cache import make_prompt_cache

    return (lambda x, cache: teacher(x, cache=cache)), (lambda: make_prompt_cache(teacher))


# ---------------------------------------------------------------- losses


def reverse_kl_topk(student_logits: mx.array, teacher_logits: mx.array, k: int) -> mx.array:
    """Per position: KL(student || teacher) over the teacher's top-k tokens plus one tail bucket
    (the remaining mass of each), i.e. reverse KL of the two (k+1)-way coarsened distributions.
    Mode seeking: the student is pushed off tokens the teacher finds unlikely."""
    s = student_logits - mx.logsumexp(student_logits, axis=-1, keepdims=True)
    t = teacher_logits - mx.logsumexp(teacher_logits, axis=-1, keepdims=True)
    idx = mx.stop_gradient(mx.argpartition(-t, kth=k - 1, axis=-1)[..., :k])
    s_k, t_k = mx.take_along_axis(s, idx, axis=-1), mx.take_along_axis(t, idx, axis=-1)
    p_k = mx.exp(s_k)
    tail_s = mx.log(mx.maximum(1.0 - p_k.sum(-1), 1e-6))
    tail_t = mx.log(mx.maximum(1.0 - mx.exp(t_k).sum(-1), 1e-6))
    return (p_k * (s_k - t_k)).sum(-1) + mx.exp(tail_s) * (tail_s - tail_t)


# ---------------------------------------------------------------- checkpoint


# ---------------------------------------------------------------- the loop


def train(student: nn.Module, pre: Prerouter, spec: lora.LoraSpec, cfg: LoraTrainConfig,
          data: Callable[[], dict[str, np.ndarray]], ckpt: Checkpoint,
          init: dict[str, mx.array] | None = None, progress: Progress | None = None,
          teacher: nn.Module | None = None) -> tuple[lora.LoraSpec, dict]:
    """Train the adapter of `spec` on `student` (frozen; routing by `pre`). `data()` makes the
    rows (called once per run; kept in the checkpoint): {"tokens": [N, L]} and, for distill,
    the teacher's logits are computed per batch from `teacher`. `init`: adapter arrays to start
    from (phase 3 starts from phase 2). Returns (spec with targets, report)."""
    t0 = time.perf_counter()
    spec = lora.attach(student, spec, seed=cfg.seed)
    if init is not None:
        lora.set_arrays(student, init)
    resumed = ckpt.check()
    ckpt.start()
    rows = ckpt.load_data() if resumed else None
    t_data = 0.0
    if rows is None:
        t1 = time.perf_counter()
        rows = data()
        t_data = time.perf_counter() - t1
        ckpt.save_data(**rows)
    tokens = rows["tokens"]
    if len(tokens) < cfg.batch:
        raise BadInput(f"training data: {len(tokens)} rows, fewer than one batch of "
                       f"{cfg.batch}")
    p = cfg.prompt_len

    def loss_fn(model: nn.Module, x: mx.array, t_logits: mx.array | None) -> mx.array:
        logits = forward_prerouted(model, pre, x[:, :-1])[:, p - 1:]
        if t_logits is None:  # sft: learn the teacher's tokens
            return nn.losses.cross_entropy(logits, x[:, p:]).mean()
        return reverse_kl_topk(logits, t_logits, cfg.teacher_top_k).mean()

    opt = optim.Adam(learning_rate=optim.cosine_decay(cfg.lr, cfg.steps, cfg.lr * 0.1))
    step_fn = nn.value_and_grad(student, loss_fn)
    start, history = ckpt.load_state(student, opt) if resumed else (0, [])
    if progress is not None:
        progress(cfg.phase, start, cfg.steps, "resumed" if start else "")
    t2 = time.perf_counter()
    for i in range(start, cfg.steps):
        rng = np.random.default_rng([cfg.seed, 2, i])
        x = mx.array(tokens[rng.choice(len(tokens), size=cfg.batch, replace=False)])
        t_logits = None
        if cfg.phase == "distill":
            t_logits = mx.stop_gradient(teacher(x[:, :-1])[:, p - 1:])
        loss, grads = step_fn(student, x, t_logits)
        opt.update(student, grads)
        mx.eval(loss, student.trainable_parameters(), opt.state)
        if i % 10 == 0 or i == cfg.steps - 1:
            history.append({"step": i + 1, "loss": round(float(loss.item()), 5)})
        if (i + 1) % cfg.checkpoint_every == 0 or i == cfg.steps - 1:
            ckpt.save_state(student, opt, i + 1, history)
        if progress is not None:
            progress(cfg.phase, i + 1, cfg.steps, f"loss {loss.item():.3f}")
    report = {"phase": cfg.phase, "config": asdict(cfg), "rows": int(tokens.shape[0]),
              "trained_tokens": int(cfg.steps * cfg.batch * (cfg.seq_len + 1 - p)),
              "data_s": round(t_data, 1), "train_s": round(time.perf_counter() - t2, 1),
              "total_s": round(time.perf_counter() - t0, 1), "resumed_at": start,
              "history": history}
    return spec, report


# ---------------------------------------------------------------- a whole phase


def default_out(model_dir: Path, phase: str, top_k: int) -> Path:
    """Where a phase's adapter goes by default: MODEL/lora/k{K}-{phase}."""
    return Path(model_dir) / "lora" / f"k{top_k}-{phase}"


def run_phase(model_dir: Path, cfg: LoraTrainConfig, heads_dir: Path, teacher_dir: Path,
              out: Path, *, text: Path | None = None, top_k: int | None = None,
              init_dir: Path | None = None, restart: bool = False,
              progress: Progress | None = None) -> dict:
    """Train one phase end to end and write `out` (adapter.safetensors + report.json). The
    checkpoint lives in `out`.partial until the phase finishes. -> the report."""
    import shutil

    from engine.loader import load_resident, open_manifest, routed_at
    from engine.manifest import MANIFEST_FILE, sha256_file
    from engine.prerouter import WEIGHTS
    from engine.train.heads import corpus_tokens

    manifest = routed_at(open_manifest(model_dir), top_k)
    k = manifest.top_k
    base_sha = sha256_file(manifest.path(MANIFEST_FILE))
    heads_dir = Path(heads_dir)
    if not (heads_dir / WEIGHTS).is_file():
        raise BadInput(f"{heads_dir}: no prerouter heads; the LoRA trains on the student path, "
                       f"so heads come first: ssdmoe train heads {model_dir}"
                       + (f" --top-k {k}" if k != manifest.native_top_k else ""))
    pre = Prerouter.load_for(heads_dir, manifest)
    pre.freeze()
    student, tok = load_resident(model_dir, top_k=top_k)
    if not all(hasattr(layer, "mlp") and hasattr(layer.mlp, "gate")
               for layer in student.model.layers):
        raise BadInput(f"{model_dir}: LoRA training supports qwen3_moe-style models (every "
                       "layer a MoE block `mlp` with a `gate` router)")
    dequantize_experts(student)
    teacher = load_teacher(teacher_dir, student)
    spec = lora.LoraSpec(cfg.rank, cfg.alpha)
    init, init_sha = None, None
    if cfg.phase == "distill":
        init_dir = Path(init_dir) if init_dir is not None else default_out(model_dir, "sft", k)
        spec0, init = lora.read(init_dir)
        lora.check(spec0, init, student, init_dir, base_sha, k)
        if spec0.provenance.get("phase") != "sft":
            raise BadInput(f"{init_dir}: phase 3 starts from a phase-2 (sft) adapter, this one "
                           f"is {spec0.provenance.get('phase')!r}")
        if spec0.provenance.get("heads_sha256") != sha256_file(heads_dir / WEIGHTS):
            raise BadInput(f"{init_dir}: trained with other heads than {heads_dir}")
        spec = lora.LoraSpec(spec0.rank, spec0.alpha, spec0.targets)
        init_sha = sha256_file(init_dir / lora.ADAPTER_FILE if init_dir.is_dir() else init_dir)
    identity = {"phase": cfg.phase, "seed": cfg.seed, "base_sha256": base_sha,
                "heads_sha256": sha256_file(heads_dir / WEIGHTS), "top_k": k,
                "teacher": str(teacher_dir), "init_sha256": init_sha,
                "text": str(text) if text else "fixture corpus",
                **{key: v for key, v in asdict(cfg).items() if key != "checkpoint_every"}}
    out = Path(out)
    ckpt = Checkpoint(out.with_name(out.name + ".partial"), identity)
    if restart:
        shutil.rmtree(ckpt.root, ignore_errors=True)

    def data() -> dict[str, np.ndarray]:
        train_ids, _ = corpus_tokens(tok, text)
        n = cfg.sequences
        prompts = prompts_from(train_ids, n, cfg.prompt_len, cfg.seed,
                               1 if cfg.phase == "sft" else 3, str(text or "fixture corpus"))
        if cfg.phase == "sft":  # the teacher writes the text
            fwd, make_cache = teacher_forward(teacher)
        else:  # on-policy: the phase-2 student writes it
            fwd, make_cache = student_forward(student, pre)
        if progress is not None:
            progress(f"{cfg.phase}: sampling {n} sequences", 0, cfg.steps, "")
        return {"tokens": sample(fwd, make_cache, prompts, cfg.seq_len + 1, cfg.temp,
                                 cfg.seed)}

    spec, report = train(student, pre, spec, cfg, data, ckpt, init=init, progress=progress,
                         teacher=teacher)
    spec.provenance = {**{key: identity[key] for key in ("phase", "seed", "base_sha256",
                                                         "heads_sha256", "top_k", "teacher",
                                                         "init_sha256", "text")},
                       "rows": report["rows"], "trained_tokens": report["trained_tokens"],
                       "steps": cfg.steps, "data": "teacher-sampled" if cfg.phase == "sft"
                       else "student-sampled, teacher-scored"}
    report["provenance"] = spec.provenance
    lora.save(student, spec, ckpt.root)
    atomic_text(ckpt.root / "report.json", json.dumps(report, indent=1))
    for f in ("state.safetensors", "data.npz", "identity.json"):
        (ckpt.root / f).unlink(missing_ok=True)
    if out.exists():
        shutil.rmtree(out)
    ckpt.root.rename(out)
    return report
