"""Generation: greedy tokens equal mlx-lm's on the same checkpoint fully resident; step hooks;
the `ssdmoe generate` command, including bad input."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

from engine.convert import export_mlx
from engine.generate import generate
from engine.loader import load_streaming

PROMPT = "def fibonacci(n):\n    return"


@pytest.mark.parametrize("fixture", ["tiny_random_converted", "tiny_grouped_converted"])
def test_greedy_64_equals_mlx_lm(fixture, request, tmp_path):
    converted = request.getfixturevalue(fixture)
    ref_model, ref_tok = mlx_lm.load(str(export_mlx(converted, tmp_path / "resident")))
    ref = [t for t, _ in generate_step(mx.array(ref_tok.encode(PROMPT)), ref_model,
                                       max_tokens=64)]
    eng = load_streaming(converted)
    model, tok, store = eng.model, eng.tokenizer, eng.store
    steps, loads = [], []
    store.on_load = loads.append
    result = generate(model, tok, PROMPT, 64, stop_at_eos=False, runtime=eng.runtime,
                      on_step=steps.append)
    assert result.tokens == ref
    assert len(result.tokens) == 64 and result.decode_tok_s > 0 and result.prefill_tok_s > 0
    # mlx_lm.generate (stops at EOS) gives the same text as ours with EOS stopping.
    text = mlx_lm.generate(ref_model, ref_tok, PROMPT, max_tokens=64)
    assert generate(model, tok, PROMPT, 64, runtime=eng.runtime).text == text
    # hooks: prompt[:-1] in one prefill step, the last prompt token's step, 63 decode steps
    assert [s["phase"] for s in steps] == ["prefill"] * 2 + ["decode"] * 63
    assert [s["step"] for s in steps] == list(range(65))
    assert all(s["start_ns"] < s["end_ns"] for s in steps)
    assert {r["step"] for r in loads} == set(range(65))
    eng.close()


def test_logits_processors_equal_mlx_lm(tiny_random_converted, tmp_path):
    """Penalties and logit bias (mlx-lm's processors) see the prompt and every token so far,
    through the lookahead and a chunked prefill: tokens equal generate_step's, greedy and
    sampled, and the processors change what is generated (so the comparison means something)."""
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    ref_model, ref_tok = mlx_lm.load(str(export_mlx(tiny_random_converted, tmp_path / "res")))
    prompt = ref_tok.encode(PROMPT)
    eng = load_streaming(tiny_random_converted)

    def ours(procs, temp: float) -> list[int]:
        return generate(eng.model, eng.tokenizer, prompt, 24, temp=temp, top_p=1.0, seed=5,
                        stop_at_eos=False, runtime=eng.runtime, prefill_step_size=3,
                        logits_processors=procs).tokens

    plain = ours(None, 0.0)
    for kw in ({"presence_penalty": 1.5, "frequency_penalty": 0.7},
               {"logit_bias": {plain[3]: -100.0, 7: 5.0}, "repetition_penalty": 1.3}):
        for temp in (0.0, 0.9):
            procs = make_logits_processors(**kw)
            mx.random.seed(5)
            ref = [t for t, _ in generate_step(
                mx.array(prompt), ref_model, max_tokens=24, prefill_step_size=3,
                sampler=make_sampler(temp, top_p=1.0), logits_processors=procs)]
            assert ours(make_logits_processors(**kw), temp) == ref, (kw, temp)
        assert ours(make_logits_processors(**kw), 0.0) != plain, kw
    eng.close()


def test_prefill_chunks_and_text_stream(tiny_random_converted):
    eng = load_streaming(tiny_random_converted)
    model, tok = eng.model, eng.tokenizer
    pieces: list[str] = []
    starts: list[tuple] = []
    r = generate(model, tok, "x" * 11, 5, prefill_step_size=4, stop_at_eos=False,
                 on_text=pieces.append, on_step_start=lambda *a: starts.append(a))
    assert [(p, n) for _, p, n in starts] == [("prefill", 4), ("prefill", 4), ("prefill", 2),
                                               ("prefill", 1)] + [("decode", 1)] * 4
    assert "".join(pieces) == r.text and r.prompt_tokens == 11
    eng.close()


def test_cli_generate_json(tiny_random_converted, ssdmoe_subprocess):
    r = ssdmoe_subprocess("generate", str(tiny_random_converted), "--prompt", PROMPT,
                          "--max-tokens", "8", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"tokens", "text", "prefill_tok_s", "decode_tok_s"}
    assert isinstance(out["text"], str) and out["decode_tok_s"] > 0
    assert 1 <= len(out["tokens"]) <= 8


def one_line_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def _edit_manifest(d: Path, fn) -> None:
    path = d / "manifest.json"
    m = json.loads(path.read_text())
    fn(m)
    path.write_text(json.dumps(m))


def test_cli_generate_bad_input_subprocess(tiny_random_converted, model_copy,
                                           ssdmoe_subprocess):
    """The installed console script: one line on stderr, exit 2, no traceback."""
    gen = ("--prompt", "hi", "--max-tokens", "2")
    d = model_copy(tiny_random_converted)
    os.truncate(d / "experts/layer_002.safetensors", 5000)
    one_line_error(ssdmoe_subprocess("generate", str(d), *gen), "layer_002.safetensors",
                    "truncated")


def test_cli_generate_bad_input(tiny_random_converted, model_copy, tmp_path, ssdmoe):
    _cli = ssdmoe
    gen = ("--prompt", "hi", "--max-tokens", "2")
    one_line_error(_cli("generate", str(tmp_path / "nowhere"), *gen), "nowhere")
    one_line_error(_cli("generate", str(tmp_path), *gen), "manifest.json", "missing")
    one_line_error(_cli("generate", str(tmp_path), "--prompt", "hi", "--max-tokens", "0"),
                    "--max-tokens")

    d = model_copy(tiny_random_converted)
    (d / "tokenizer.json").unlink()
    one_line_error(_cli("generate", str(d), *gen), "tokenizer.json", "missing")

    d = model_copy(tiny_random_converted)
    _edit_manifest(d, lambda m: m["files"]["resident.safetensors"].update(sha256="0" * 64))
    one_line_error(_cli("generate", str(d), *gen), "resident.safetensors", "sha256")

    d = model_copy(tiny_random_converted)  # same size, one flipped byte in an expert
    p = d / "experts/layer_001.safetensors"
    data = bytearray(p.read_bytes())
    data[-1] ^= 0xFF
    p.write_bytes(bytes(data))
    one_line_error(_cli("generate", str(d), *gen), "layer_001.safetensors", "sha256")

    d = model_copy(tiny_random_converted)
    _edit_manifest(d, lambda m: m.update(model_type="llama"))
    one_line_error(_cli("generate", str(d), *gen), "manifest.json", "unsupported architecture")

    d = model_copy(tiny_random_converted)
    _edit_manifest(d, lambda m: m["config"].update(num_experts=16))
    one_line_error(_cli("generate", str(d), *gen), "layer_000.safetensors",
                    "config does not match tensors")

    d = model_copy(tiny_random_converted)
    _edit_manifest(d, lambda m: m["config"].update(num_attention_heads=8, head_dim=64))
    one_line_error(_cli("generate", str(d), *gen), "resident.safetensors",
                    "config does not match tensors")

    d = model_copy(tiny_random_converted)
    (d / "manifest.json").write_text("{not json")
    one_line_error(_cli("generate", str(d), *gen), "manifest.json", "not valid JSON")
