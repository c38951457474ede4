"""The unmerged recovery LoRA (engine.lora): its math against a float64 merged-weight reference
built on mlx-lm's own model, the same tokens on every path and preset with and without heads,
the adapted modules (attention and shared experts, never routers or streamed experts) on
every architecture, provenance in the file, and refusal of mismatched or damaged adapters."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.tuner.lora import LoRALinear

from contract.engine_config import EngineConfig
from engine import lora
from engine.archs import ARCHS as ARCH_SPECS
from engine.generate import generate
from engine.loader import load_resident, load_streaming
from engine.manifest import MANIFEST_FILE, sha256_file

PROMPT = "Adapters stay unmerged: def f(x): return x + 1"
ARCHS = tuple(ARCH_SPECS)  # every supported architecture


def make_adapter(root: Path, out: Path, seed: int = 0, top_k: int | None = None,
                 scale_b: float = 0.05) -> Path:
    """A random adapter with nonzero B (a fresh one is zero and changes nothing)."""
    model, _ = load_resident(root, top_k=top_k)
    m_sha = sha256_file(root / MANIFEST_FILE)
    k = top_k or json.loads((root / MANIFEST_FILE).read_text())["top_k"]
    spec = lora.attach(model, lora.LoraSpec(provenance={"base_sha256": m_sha, "top_k": k,
                                                        "phase": "sft"}), seed=seed)
    rng = np.random.default_rng(seed)
    for _, m in model.named_modules():
        if isinstance(m, LoRALinear):
            m.lora_b = mx.array(rng.normal(0, scale_b, m.lora_b.shape).astype(np.float32))
    lora.save(model, spec, out)
    return out


def _logits(model, ids: list[int]) -> np.ndarray:
    return np.array(model(mx.array([ids])), dtype=np.float64)


def test_adapter_equals_the_merged_float64_reference(tiny_random_converted, tmp_path):
    """Reference: mlx-lm's own model with each adapted weight replaced by W + (alpha/r)(AB)^T
    computed in float64 (a plain Linear, no parallel delta)."""
    ad = make_adapter(tiny_random_converted, tmp_path / "ad")
    adapted, tok = load_resident(tiny_random_converted, lora=ad)
    spec, arrays = lora.read(ad)
    assert spec.scale == 2.0 and spec.rank == 16
    ref, _ = load_resident(tiny_random_converted)
    mods = dict(ref.named_modules())
    merged = []
    for t in spec.targets:
        w = np.array(mods[t].weight, np.float64)
        a, b = (np.array(arrays[f"{t}.{k}"], np.float64) for k in ("lora_a", "lora_b"))
        lin = nn.Linear(w.shape[1], w.shape[0], bias="bias" in mods[t])
        lin.weight = mx.array((w + spec.scale * (a @ b).T).astype(np.float32))
        if "bias" in mods[t]:
            lin.bias = mods[t].bias
        merged.append((t, lin))
    from mlx.utils import tree_unflatten

    ref.update_modules(tree_unflatten(merged))
    base, _ = load_resident(tiny_random_converted)
    ids = tok.encode(PROMPT)
    got, want, plain = _logits(adapted, ids), _logits(ref, ids), _logits(base, ids)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2
    assert np.abs(got - want).max() < 1e-3
    # the adapter does change the model: well beyond the agreement above
    assert np.linalg.norm(got - plain) / np.linalg.norm(plain) > 20 * np.linalg.norm(
        got - want) / np.linalg.norm(want)


def test_targets_are_attention_and_shared_experts_only(arch_model):
    for arch in ARCHS:
        _, conv = arch_model(arch)
        model, _ = load_resident(conv)
        targets = lora.target_modules(model)
        assert targets, arch
        for t in targets:
            parts = t.split(".")
            assert not {"gate", "shared_expert_gate", "switch_mlp"} & set(parts), t
            assert set(parts) & {"self_attn", "attention", "linear_attn", "shared_expert",
                                 "shared_experts"}, t
        kinds = {p for t in targets for p in t.split(".")[3:5]}
        if arch in ("qwen3_next", "bailing_moe"):  # these fixtures have shared experts
            assert kinds & {"shared_expert", "shared_experts"}, (arch, kinds)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_preset_gives_the_resident_adapted_tokens(arch, arch_model, tmp_path):
    _, conv = arch_model(arch)
    ad = make_adapter(conv, tmp_path / "ad", seed=1, scale_b=0.2)
    resident, tok = load_resident(conv, lora=ad)
    want = generate(resident, tok, PROMPT, 10, stop_at_eos=False).tokens
    plain, _ = load_resident(conv)
    assert generate(plain, tok, PROMPT, 10, stop_at_eos=False).tokens != want or arch == \
        "mixtral"  # (one tiny random fixture's greedy tokens survive the adapter)
    for preset in ("on-demand", "hot", "staged"):
        eng = load_streaming(conv, config=EngineConfig.from_preset(preset, lora=str(ad)))
        model, tok = eng.model, eng.tokenizer
        try:
            got = generate(model, tok, PROMPT, 10, stop_at_eos=False, runtime=eng.runtime)
            assert got.tokens == want, preset
            assert eng.runtime.lora.nbytes > 0
        finally:
            eng.close()


def test_adapter_works_with_heads_on_every_path(tiny_random_converted, tmp_path):
    from prerouter_helpers import _heads

    heads = _heads(tiny_random_converted, tmp_path / "pre", seed=1)
    ad = make_adapter(tiny_random_converted, tmp_path / "ad", seed=2, scale_b=0.2)
    tokens = {}
    for preset in ("on-demand", "hot", "staged"):
        for adapter in (None, str(ad)):
            eng = load_streaming(tiny_random_converted, config=EngineConfig
                                 .from_preset(preset, prerouter=str(heads),
                                 lora=adapter))
            model, tok = eng.model, eng.tokenizer
            tokens[(preset, adapter)] = generate(model, tok, PROMPT, 12, stop_at_eos=False,
                                                 runtime=eng.runtime).tokens
            eng.close()
    for adapter in (None, str(ad)):
        assert len({tuple(tokens[(p, adapter)]) for p in ("on-demand", "hot", "staged")}) == 1
    assert tokens[("staged", None)] != tokens[("staged", str(ad))]


def test_provenance_is_in_the_file(tiny_random_converted, tmp_path):
    ad = make_adapter(tiny_random_converted, tmp_path / "ad")
    header_len = struct.unpack("<Q", (ad / lora.ADAPTER_FILE).read_bytes()[:8])[0]
    header = json.loads((ad / lora.ADAPTER_FILE).read_bytes()[8:8 + header_len])
    meta = json.loads(header["__metadata__"][lora.META_KEY])
    assert meta["rank"] == 16 and meta["alpha"] == 32.0
    assert meta["provenance"]["base_sha256"] == sha256_file(tiny_random_converted / MANIFEST_FILE)
    assert lora.read_provenance(ad) == meta["provenance"]


def _rewrite(ad: Path, change) -> None:
    arrays, meta = mx.load(str(ad / lora.ADAPTER_FILE), return_metadata=True)
    spec = json.loads(meta[lora.META_KEY])
    arrays = change(spec, arrays) or arrays
    mx.save_safetensors(str(ad / lora.ADAPTER_FILE), arrays,
                        metadata={lora.META_KEY: json.dumps(spec)})


def _drop_layer0(spec, arrays):
    spec["targets"] = [t for t in spec["targets"] if ".layers.0." not in t]
    return {k: v for k, v in arrays.items() if ".layers.0." not in k}


@pytest.mark.parametrize("damage, message", [
    (lambda ad: (ad / lora.ADAPTER_FILE).unlink(), "no such file"),
    (lambda ad: (ad / lora.ADAPTER_FILE).write_bytes(
        (ad / lora.ADAPTER_FILE).read_bytes()[:-100]), "truncated"),
    (lambda ad: _rewrite(ad, lambda s, a: s["provenance"].update(base_sha256="0" * 64)),
     "trained on base 000000000000"),
    (lambda ad: _rewrite(ad, lambda s, a: s["provenance"].update(top_k=1)), "trained at K=1"),
    (lambda ad: _rewrite(ad, lambda s, a: s.update(rank=8)), "the model needs"),
    (lambda ad: _rewrite(ad, lambda s, a: s["targets"].append("model.layers.9.self_attn.q_proj")),
     "does not exist in this model"),
    (lambda ad: _rewrite(ad, lambda s, a: s["targets"].__setitem__(
        0, "model.layers.0.mlp.gate")), "router or a streamed expert"),
    (lambda ad: _rewrite(ad, lambda s, a: {**a, "model.extra.lora_a": mx.zeros((2, 2))}),
     "not one of the adapter's targets"),
])
def test_mismatched_adapters_are_refused_in_one_line(damage, message, tiny_random_converted,
                                                     tmp_path, ssdmoe):
    ad = make_adapter(tiny_random_converted, tmp_path / "ad")
    damage(ad)
    r = ssdmoe("generate", str(tiny_random_converted), "--prompt", "x", "--max-tokens", "2",
               "--lora", str(ad))
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip()
    assert "\n" not in line and line.startswith("error: ") and message in line, line
    assert "Traceback" not in r.stderr


def test_a_damaged_adapter_file_is_kept(tiny_random_converted, tmp_path):
    ad = make_adapter(tiny_random_converted, tmp_path / "ad")
    before = (ad / lora.ADAPTER_FILE).read_bytes()
    _rewrite(ad, _drop_layer0)
    damaged = (ad / lora.ADAPTER_FILE).read_bytes()
    model, _ = load_resident(tiny_random_converted)
    lora.install(model, ad)  # fewer targets is still a valid adapter
    assert (ad / lora.ADAPTER_FILE).read_bytes() == damaged != before


def test_generate_flags(tiny_random_converted, model_copy, tmp_path, ssdmoe):
    """--lora applies; --no-lora serves without; with --prerouter the adapter trained for
    those heads under MODEL/lora is the default."""
    from prerouter_helpers import _heads

    root = model_copy(tiny_random_converted)
    heads = _heads(root, root / "prerouter", seed=1)
    k = json.loads((root / MANIFEST_FILE).read_text())["top_k"]
    ad = make_adapter(root, root / "lora" / f"k{k}-sft", scale_b=0.3)
    _rewrite(ad, lambda s, a: s["provenance"].update(
        heads_sha256=sha256_file(heads / "prerouter.safetensors")))

    def tokens(*extra: str) -> tuple[list[int], str]:
        r = ssdmoe("generate", str(root), "--prompt", PROMPT, "--max-tokens", "10", "--json",
                   *extra)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout.strip().splitlines()[-1])["tokens"], r.stderr

    plain, _ = tokens("--prerouter", str(heads), "--no-lora")
    explicit, _ = tokens("--prerouter", str(heads), "--lora", str(ad))
    default, err = tokens("--prerouter", str(heads))
    assert explicit == default != plain
    assert "lora: " in err and f"k{k}-sft" in err
    other = _heads(root, tmp_path / "other-heads", seed=2)  # not the adapter's heads
    _, err = tokens("--prerouter", str(other))
    assert "lora: " not in err
    r = ssdmoe("generate", str(root), "--prompt", "x", "--lora", str(ad), "--no-lora")
    assert r.returncode == 2 and "exclude each other" in r.stderr


def test_the_simulator_accounts_for_the_adapter(tiny_random_converted, model_copy, tmp_path):
    """The model profile holds the served adapter's bytes (from its file header, no MLX); a
    trace captured with an adapter replays with lora=true and those bytes."""
    from engine.capture import capture, load_engine, start_recorder
    from sim.compare import compare, scenario_for
    from sim.model_profile import profile_from_manifest
    from traces.reader import read_trace

    root = model_copy(tiny_random_converted)
    assert profile_from_manifest(root)["lora_bytes"][0] == 0
    k = json.loads((root / MANIFEST_FILE).read_text())["top_k"]
    ad = make_adapter(root, root / "lora" / f"k{k}-sft")
    _, arrays = lora.read(ad)
    params = sum(v.size for v in arrays.values())
    assert profile_from_manifest(root)["lora_bytes"][0] == 4 * params
    out = tmp_path / "trace"
    eng = load_engine(tiny_random_converted, preset="staged", lora=ad)
    rec = start_recorder(out, eng, command=["test"])
    try:
        capture(eng, [PROMPT], 6, recorder=rec)
    finally:
        rec.close()
        eng.close()
    trace = read_trace(out)
    assert trace.run["engine"]["lora"] == str(ad)
    sc, derived, notes = scenario_for(trace)
    assert sc.lora and "lora=true" in derived and sc.model.lora_bytes == 4 * params
    assert compare(trace).simulated["decode_tok_s"] > 0
