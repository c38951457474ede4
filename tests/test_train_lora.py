"""Training phases 2 and 3 (engine.train.recovery_lora) and the merge loss
(engine.train.merge_loss): the reverse-KL loss against numpy, the cached student forward
against the whole-sequence one, deterministic and resumable runs, refusals that keep
checkpoints, and the merge survival's closed forms (a delta far below the int4 step is
erased, one far above survives)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.tuner.lora import LoRALinear

from contract.errors import BadInput
from engine import lora
from engine.loader import load_resident
from engine.prerouter import Prerouter
from engine.train import merge_loss as ml
from engine.train.heads import PreroutedState, forward_prerouted
from engine.train.recovery_lora import LoraTrainConfig, reverse_kl_topk, run_phase

SMALL = dict(steps=4, batch=2, seq_len=24, prompt_len=4, sequences=4, checkpoint_every=2)


def _np_log_softmax(a: np.ndarray) -> np.ndarray:
    a = a - a.max(-1, keepdims=True)
    return a - np.log(np.exp(a).sum(-1, keepdims=True))


def test_reverse_kl_topk_against_numpy():
    rng = np.random.default_rng(0)
    s, t = rng.normal(size=(3, 10)) * 2, rng.normal(size=(3, 10)) * 2
    k = 3
    got = np.array(reverse_kl_topk(mx.array(s, mx.float32), mx.array(t, mx.float32), k))
    ls, lt = _np_log_softmax(s), _np_log_softmax(t)
    for row in range(3):
        top = np.argsort(-lt[row])[:k]
        ps, pt = np.exp(ls[row, top]), np.exp(lt[row, top])
        ps_tail, pt_tail = 1 - ps.sum(), 1 - pt.sum()
        want = (ps * np.log(ps / pt)).sum() + ps_tail * np.log(ps_tail / pt_tail)
        assert got[row] == pytest.approx(want, rel=1e-4)
    # k = V: the full reverse KL, the tail is empty
    full = np.array(reverse_kl_topk(mx.array(s, mx.float32), mx.array(t, mx.float32), 10))
    want = (np.exp(ls) * (ls - lt)).sum(-1)
    assert np.allclose(full, want, rtol=1e-3, atol=1e-5)


def test_cached_student_forward_equals_the_whole_sequence(tiny_random_converted, tmp_path):
    """Incremental calls with a KV cache and PreroutedState route each position as one call
    over the whole sequence does (the predictions cross call boundaries)."""
    from mlx_lm.models.cache import make_prompt_cache
    from prerouter_helpers import _heads

    pre = Prerouter.load(_heads(tiny_random_converted, tmp_path / "pre", seed=3))
    model, _ = load_resident(tiny_random_converted)
    ids = mx.array([[3, 17, 5, 9, 11, 2, 40, 7, 8, 1]])
    whole = np.array(forward_prerouted(model, pre, ids))
    cache, state = make_prompt_cache(model), PreroutedState()
    parts = [forward_prerouted(model, pre, ids[:, :4], cache, state)]
    parts += [forward_prerouted(model, pre, ids[:, i:i + 1], cache, state) for i in range(4, 10)]
    step = np.array(mx.concatenate(parts, axis=1))
    assert np.allclose(step, whole, atol=1e-4)
    own = np.array(model(ids))
    assert not np.allclose(own[0, 5:], whole[0, 5:], atol=1e-2)  # prediction did route


@pytest.fixture
def setup(tiny_random_converted, tiny_random_dir, tmp_path):
    from prerouter_helpers import _heads

    heads = _heads(tiny_random_converted, tmp_path / "pre", seed=1)
    text = tmp_path / "t.txt"
    text.write_text("\n\n".join(f"def f{i}(x):\n    return x * {i} + {i % 7}" for i in range(300)))
    return {"model": tiny_random_converted, "heads": heads, "teacher": tiny_random_dir,
            "text": text, "tmp": tmp_path}


def _run(s: dict, out: str, phase: str = "sft", progress=None, **cfg):
    return run_phase(s["model"], LoraTrainConfig(phase=phase, **{**SMALL, **cfg}), s["heads"],
                     s["teacher"], s["tmp"] / out, text=s["text"], progress=progress,
                     init_dir=s["tmp"] / "a" if phase == "distill" else None)


def _arrays(d: Path) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in lora.read(d)[1].items()}


def test_sft_is_deterministic_and_resumes_to_the_same_adapter(setup):
    rep = _run(setup, "a")
    assert rep["history"][-1]["loss"] < rep["history"][0]["loss"] + 1.0
    assert rep["provenance"]["phase"] == "sft" and rep["provenance"]["heads_sha256"]
    assert not (setup["tmp"] / "a.partial").exists()
    a = _arrays(setup["tmp"] / "a")
    assert any(np.abs(v).max() > 0 for k, v in a.items() if k.endswith("lora_b"))  # it trained

    def stop_at_2(stage, done, total, note):
        if stage == "sft" and done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _run(setup, "b", progress=stop_at_2)
    assert (setup["tmp"] / "b.partial" / "state.safetensors").is_file()
    rep_b = _run(setup, "b")
    assert rep_b["resumed_at"] == 2
    b = _arrays(setup["tmp"] / "b")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_a_checkpoint_of_another_run_is_refused_and_kept(setup):
    def stop(stage, done, total, note):
        if stage == "sft" and done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _run(setup, "c", progress=stop)
    part = setup["tmp"] / "c.partial"
    before = {f.name: f.read_bytes() for f in part.iterdir()}
    with pytest.raises(BadInput, match="checkpoint of another run .seed"):
        _run(setup, "c", seed=1)
    assert {f.name: f.read_bytes() for f in part.iterdir()} == before


def test_distill_starts_from_sft_and_moves(setup):
    _run(setup, "a")
    rep = _run(setup, "d", phase="distill", steps=2, sequences=2)
    assert rep["provenance"]["phase"] == "distill" and rep["provenance"]["init_sha256"]
    a, d = _arrays(setup["tmp"] / "a"), _arrays(setup["tmp"] / "d")
    assert a.keys() == d.keys() and any(not np.array_equal(a[k], d[k]) for k in a)
    with pytest.raises(BadInput, match="starts from a phase-2"):  # distill from distill
        run_phase(setup["model"], LoraTrainConfig(phase="distill", **SMALL), setup["heads"],
                  setup["teacher"], setup["tmp"] / "e", text=setup["text"],
                  init_dir=setup["tmp"] / "d")


def test_bad_training_input(setup, tmp_path, ssdmoe):
    with pytest.raises(BadInput, match="heads come first"):
        run_phase(setup["model"], LoraTrainConfig(**SMALL), tmp_path / "none", setup["teacher"],
                  tmp_path / "x", text=setup["text"])
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(BadInput, match="too short"):
        run_phase(setup["model"], LoraTrainConfig(**SMALL), setup["heads"], setup["teacher"],
                  tmp_path / "y", text=empty)
    with pytest.raises(BadInput, match="fewer than one batch"):
        _run(setup, "z", sequences=1, batch=2)
    r = ssdmoe("train", "sft", str(setup["model"]), "--prerouter", str(tmp_path / "none"),
               "--out", str(tmp_path / "w"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "heads come first" in r.stderr


# ---------------------------------------------------------------- merge loss


def _adapted(root: Path, delta_over_step: float):
    """The model with int4 bases and a rank-16 delta of RMS `delta_over_step` x the RMS int4
    step of its module."""
    model, _ = load_resident(root)
    lora.attach(model, lora.LoraSpec())
    ml.quantize_bases(model, 4, 64)
    rng = np.random.default_rng(0)
    for _, m in model.named_modules():
        if isinstance(m, LoRALinear):
            step = float(np.sqrt((np.array(m.linear.scales) ** 2).mean()))
            a = np.array(m.lora_a)
            b = rng.normal(size=m.lora_b.shape)
            rms = np.sqrt(((m.scale * a @ b) ** 2).mean())
            m.lora_b = mx.array((b * delta_over_step * step / rms).astype(np.float32))
    return model


def test_merge_survival_closed_forms(tiny_random_converted):
    tiny = ml.weight_survival(_adapted(tiny_random_converted, 1e-3))
    big = ml.weight_survival(_adapted(tiny_random_converted, 30.0))
    for kind in tiny:
        assert tiny[kind]["delta_rms"] == pytest.approx(1e-3 * tiny[kind]["step_rms"], rel=0.2)
        assert tiny[kind]["survival"] < 0.25, kind  # rounds back to the base grid
        assert big[kind]["survival"] > 0.9, kind  # quantization error << the delta


def test_logit_survival_is_the_formula():
    x = [mx.zeros((1, 2))]
    base, delta = np.array([[1.0, -2.0, 3.0]]), np.array([[0.4, 0.2, -0.4]])
    logits = {"u": base + delta, "m": base + 0.25 * delta, "b": base}
    got = ml.logit_survival("u", "m", "b", lambda m, _: mx.array(logits[m]), x)
    assert got == pytest.approx(0.25, abs=1e-6)


def test_merge_then_fuse_is_the_requantized_weight(tiny_random_converted):
    """merge() serves deq(Q(B + delta)) at the base's bits and group (mlx-lm's fuse)."""
    model = _adapted(tiny_random_converted, 5.0)
    m = next(m for _, m in model.named_modules() if isinstance(m, LoRALinear))
    base = ml._dequantized(m.linear)
    u = base + m.scale * (np.array(m.lora_a, np.float64) @ np.array(m.lora_b, np.float64)).T
    wq, s, z = mx.quantize(mx.array(u.astype(np.float32)), group_size=64, bits=4)
    want = np.array(mx.dequantize(wq, s, z, group_size=64, bits=4))
    path = next(p for p, mm in model.named_modules() if mm is m)
    ml.merge(model)
    merged = dict(model.named_modules())[path]
    assert np.allclose(ml._dequantized(merged), want, atol=1e-5)


def test_cli_merge_loss_and_eval(setup, ssdmoe, tmp_path):
    _run(setup, "a")
    out = tmp_path / "reports"
    r = ssdmoe("lora", "merge-loss", str(setup["model"]), "--lora", str(setup["tmp"] / "a"),
               "--prerouter", str(setup["heads"]), "--windows", "2", "--out-dir", str(out))
    assert r.returncode == 0, r.stderr
    rep = json.loads(next(out.glob("merge-loss-*.json")).read_text())
    assert set(rep["weights"]) == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                   "self_attn.o_proj"}
    assert -1.0 < rep["logit_survival"] < 1.0
    r = ssdmoe("eval", str(setup["model"]), "--prerouter", str(setup["heads"]), "--lora",
               str(setup["tmp"] / "a"), "--windows", "2", "--prompts", "2", "--out-dir",
               str(out), "--name", "q")
    assert r.returncode == 0, r.stderr
    q = json.loads((out / "q.json").read_text())
    rows = q["rows"]
    assert list(rows) == ["teacher (fp32)", "int4, own routers", "int4 prerouted, no LoRA",
                          "int4 prerouted + LoRA sft"]
    t = rows["teacher (fp32)"]
    assert t["top1"] == 1.0 and t["top5"] == pytest.approx(1.0)
    own = rows["int4, own routers"]
    assert abs(own["ce"] - t["ce"]) < 0.1 and own["routing_mean"] is None
    pre = rows["int4 prerouted, no LoRA"]
    assert 0 <= pre["routing_mean"] <= 1 and pre["routing_per_layer"]
    assert pre["ppl"] == pytest.approx(np.exp(pre["ce"]))
    assert "| int4 prerouted + LoRA sft |" in (out / "q.md").read_text()
