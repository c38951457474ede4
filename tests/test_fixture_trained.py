"""tiny-trained at toy size: determinism, mlx_lm.load compatibility, the tapped forward pass
against mlx-lm's own forward, the balance loss against hand-worked values, corpus selection."""

import json
import math
import zlib

import mlx.core as mx
import numpy as np
import pytest

from engine.fixtures.bpe import EOS, train_bpe
from engine.fixtures.corpus import CorpusConfig, _interleave, assemble_corpus, heldout_key
from engine.fixtures.train_loop import forward_with_taps, switch_balance_loss
from engine.fixtures.trained import build_tiny_trained

TINY = dict(num_layers=2, hidden=64, heads=2, kv_heads=1, head_dim=32, experts=8, top_k=2,
            moe_intermediate=32, vocab_size=384, seq_len=32, batch=4, warmup=2,
            code_bytes=120_000, per_file_bytes=2_048, docstring_bytes=60_000, prose_bytes=30_000,
            eval_windows=8, compile_step=False)  # compiled kernels cost ~40 s on a fresh machine
STEPS = 6


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_trained")
    return {name: build_tiny_trained(root / name, seed=seed, steps=STEPS, progress=False, **TINY)
            for name, seed in (("a", 0), ("b", 0), ("c", 1))}


def test_same_seed_is_bitwise_identical_other_seed_differs(builds):
    a, b, c = (builds[k] for k in "abc")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_mlx_lm_loads_it_and_tokenizer_round_trips(builds):
    import mlx_lm

    model, tok = mlx_lm.load(str(builds["a"]))
    config = json.loads((builds["a"] / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe"
    assert tok.eos_token == EOS and tok.eos_token_id == config["eos_token_id"]
    text = 'def f(x):\n    """Return x + 1."""\n    return x + 1  # café\n\nThe "if" statement'
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    logits = model(mx.array([ids]))
    assert logits.shape == (1, len(ids), config["vocab_size"])
    assert bool(mx.all(mx.isfinite(logits)))


def test_provenance_and_training_progress(builds):
    meta = json.loads((builds["a"] / "fixture.json").read_text())
    assert meta["seed"] == 0 and meta["steps"] == STEPS
    assert meta["corpus"]["code_files"] > 0 and meta["corpus"]["prose_docs"] > 0
    assert meta["python_version"].count(".") == 2
    curve = meta["loss_curve"]
    assert curve[0]["step"] == 1 and curve[-1]["step"] == STEPS
    # Starts near chance (ln vocab) and goes down.
    assert abs(curve[0]["ce"] - math.log(TINY["vocab_size"])) < 1.0
    assert curve[-1]["ce"] < curve[0]["ce"] - 0.3
    held = meta["heldout"]
    assert held["chance_overlap"] == TINY["top_k"] / TINY["experts"]
    for row in held["per_layer"]:
        assert 0 <= row["adjacent_overlap"] <= 1 and 0 < row["load_entropy"] <= 1


def test_forward_with_taps_matches_mlx_lm_and_router(builds):
    import mlx_lm

    model, tok = mlx_lm.load(str(builds["a"]))
    x = mx.array([tok.encode("import os\nprint(os.getcwd())\n")])
    logits, taps = forward_with_taps(model, x)
    assert np.allclose(np.array(logits), np.array(model(x)), atol=1e-4)
    for layer, tap in zip(model.model.layers, taps, strict=True):
        # Independent top-k: numpy argsort of the router logits (softmax keeps the order).
        router = np.array(tap.x) @ np.array(layer.mlp.gate.weight).T
        want = np.sort(np.argsort(-router, axis=-1)[..., : TINY["top_k"]], axis=-1)
        assert (np.sort(np.array(tap.inds), axis=-1) == want).all()
        assert np.allclose(np.array(tap.probs).sum(-1), 1.0, atol=1e-5)


def test_switch_balance_loss_hand_worked():
    e = 4
    uniform = mx.full((6, e), 1 / e)
    spread = mx.array([[0, 1], [2, 3], [0, 1], [2, 3], [0, 1], [2, 3]])
    assert switch_balance_loss(uniform, spread).item() == pytest.approx(1.0)
    # Everything on expert 0 with probability 1: f_0 = 1/2 (two slots per token, one is 0),
    # P_0 = 1 -> 4 * 0.5 * 1 = 2.
    onehot = mx.array([[1.0, 0, 0, 0]] * 6)
    assert switch_balance_loss(onehot, mx.array([[0, 1]] * 6)).item() == pytest.approx(2.0)


def test_corpus_is_deterministic_and_excludes_tests():
    cfg = CorpusConfig(code_bytes=150_000, per_file_bytes=4_096, docstring_bytes=80_000,
                       prose_bytes=40_000)
    one, two = assemble_corpus(cfg), assemble_corpus(cfg)
    assert one.train == two.train and one.heldout == two.heldout
    names = [n for n, _ in one.train + one.heldout]
    assert not any("/test/" in f"/{n}" or n.rsplit("/", 1)[-1].startswith("test_") for n in names)
    assert {n for n, _ in one.train}.isdisjoint(n for n, _ in one.heldout)
    assert all(zlib.crc32(heldout_key(n).encode()) % cfg.heldout_mod == 0 for n, _ in one.heldout)
    # A file's code and its docstrings-only document land on the same side.
    held = {heldout_key(n) for n, _ in one.heldout}
    assert not any(heldout_key(n) in held for n, _ in one.train)
    assert any(n.endswith("#docstrings") for n, _ in one.train)
    assert any("#" not in n for n, _ in one.heldout)
    assert all(len(t.encode()) <= cfg.per_file_bytes for n, t in one.train if "#" not in n)
    assert one.code_bytes <= 2 * cfg.code_bytes and one.prose_bytes <= cfg.prose_bytes


def test_interleave_keeps_order_and_spreads():
    merged = _interleave(list("abcdef"), [1, 2])
    assert [m for m in merged if isinstance(m, str)] == list("abcdef")
    assert [m for m in merged if isinstance(m, int)] == [1, 2]
    assert merged.index(1) < 4 < merged.index(2)


def test_bpe_is_deterministic():
    texts = ["def add(a, b):\n    return a + b\n", "The quick brown fox.\n"] * 50
    assert train_bpe(texts, 300).to_str() == train_bpe(texts, 300).to_str()


def _cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    from cli_runner import run_cli

    return run_cli(monkeypatch, capsys, "fixture", *args)


def test_cli_lists_and_rejects_bad_input_in_one_line(monkeypatch, capsys, tmp_path):
    code, out, _ = _cli(monkeypatch, capsys, "--list")
    assert code == 0 and "tiny-trained" in out and "tiny-random" in out
    code, _, err = _cli(monkeypatch, capsys, "nope", "--out", str(tmp_path / "m"))
    assert code == 2 and "unknown fixture 'nope'" in err and "tiny-trained" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    code, _, err = _cli(monkeypatch, capsys, "tiny-random", "--out", str(busy))
    assert code == 2 and "not empty" in err
    code, _, err = _cli(monkeypatch, capsys, "tiny-random", "--out", str(busy), "--force")
    assert code == 2 and "not a model directory" in err and (busy / "notes.txt").exists()
    code, _, err = _cli(monkeypatch, capsys, "tiny-random", "--out", str(busy), "--steps", "3")
    assert code == 2 and "--steps" in err


def test_cli_force_replaces_a_model_directory(monkeypatch, capsys, tmp_path):
    out_dir = tmp_path / "model"
    out_dir.mkdir()
    (out_dir / "config.json").write_text("{}")
    (out_dir / "model-00001-of-00002.safetensors").write_text("stale")
    code, _, err = _cli(monkeypatch, capsys, "tiny-random", "--out", str(out_dir), "--force")
    assert code == 0, err
    assert not (out_dir / "model-00001-of-00002.safetensors").exists()
    assert json.loads((out_dir / "config.json").read_text())["model_type"]
    assert not (tmp_path / ".model.building").exists()


def test_the_build_shows_its_progress_off_a_terminal(tmp_path, capfd):
    """Off a terminal (a log, CI, a pipe) rich draws no live bar, so the build prints its
    phases and lines with the step, tokens/s and the time left."""
    build_tiny_trained(tmp_path / "p", seed=0, steps=STEPS, progress=True, **TINY)
    err = capfd.readouterr().err
    assert "tiny-trained: assembling the corpus" in err and "tokenizer" in err
    lines = [line for line in err.splitlines() if line.startswith("tiny-trained seed 0: step")]
    assert lines[0].startswith(f"tiny-trained seed 0: step 1 of {STEPS},")
    assert lines[-1].startswith(f"tiny-trained seed 0: step {STEPS} of {STEPS},")
    assert all("tok/s" in line and "left" in line for line in lines)
    assert "routing on held-out text" in err


def test_plain_progress_lines_come_every_tenth_or_minute(capsys):
    from engine.fixtures.train_loop import PlainProgress

    p = PlainProgress("x", 100, every_s=1e9)
    for done in range(1, 101):
        p.update(done, 1000.0, 2.0)
    steps = [int(line.split("step ")[1].split(" ")[0])
             for line in capsys.readouterr().err.splitlines()]
    assert steps == [1, 11, 21, 31, 41, 51, 61, 71, 81, 91, 100]
