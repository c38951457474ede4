"""The first MoE layer's token table (engine.first_layer_hint): its fit against the exact
linear map it should recover, its recall by hand, its file checked against the model; the
slot table's hint (room for the call's own misses, no read twice, hinted experts counted as
misses); and in the engine the same tokens with and without it, the hinted sets recorded as
the table's rows of each step's input token and read as prefetches of the first layer."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from prerouter_helpers import PROMPT, _heads, _hint_table

from contract.engine_config import EngineConfig
from contract.errors import BadInput
from engine.first_layer_hint import HINT_FILE, FirstLayerHint, fit_table
from engine.loader import load_streaming
from engine.manifest import read_manifest
from engine.paths.exact import ExactPath
from engine.paths.staged import StagedPath
from engine.paths.stats import PathStats
from engine.readers import ReaderPool
from engine.store import ExpertStore


def test_fit_recovers_an_exact_linear_map():
    """Logits made exactly [embedding, 1] @ W: with a vanishing ridge the table is each token's
    top-K of that map, ranked here by an independent argsort of the true scores."""
    rng = np.random.default_rng(0)
    vocab, dims, experts, k = 40, 5, 9, 3
    emb = rng.standard_normal((vocab, dims))
    w = rng.standard_normal((dims + 1, experts))
    scores = np.concatenate([emb, np.ones((vocab, 1))], axis=1) @ w
    tokens = rng.integers(0, vocab, 300)
    table = fit_table(emb, tokens, scores[tokens], k, lam=1e-9)
    assert table.shape == (vocab, k) and table.dtype == np.int16
    want = np.argsort(-scores, axis=1)[:, :k]
    assert all(set(a) == set(b) for a, b in zip(table.tolist(), want.tolist(), strict=True))


def test_recall_by_hand():
    """The table's recall as `train heads` reports it (set_recall of the tokens' rows). Rows:
    token 0 -> {0, 1}, token 1 -> {2, 3}. Positions (0, routed {0, 5}): 1/2; (1, {2, 3}):
    2/2; (1, {4, 5}): 0/2. Mean 0.5."""
    from engine.fixtures.train_loop import set_recall

    table = np.array([[0, 1], [2, 3]])
    routed = np.array([[0, 5], [2, 3], [4, 5]])
    assert set_recall(table[np.array([0, 1, 1])], routed) == pytest.approx(0.5)


def test_table_file_is_checked_against_the_model(tmp_path):
    assert FirstLayerHint.load(tmp_path, 10, 8) is None  # heads from before the hint
    hint = FirstLayerHint(np.array([[1, 2], [3, 4]], dtype=np.int16))
    hint.save(tmp_path)
    assert FirstLayerHint.load(tmp_path, 2, 8).experts(1) == [3, 4]
    assert hint.experts(7) == []  # a token outside the table: no hint
    with pytest.raises(BadInput, match=rf"{HINT_FILE}: a first-layer hint table must be "
                       r"integer \[vocab=3"):
        FirstLayerHint.load(tmp_path, 3, 8)
    with pytest.raises(BadInput, match=r"expert ids outside 0..3"):
        FirstLayerHint.load(tmp_path, 2, 4)
    (tmp_path / HINT_FILE).write_bytes(b"not numpy")
    with pytest.raises(BadInput, match=rf"{HINT_FILE}: not a first-layer hint table"):
        FirstLayerHint.load(tmp_path, 2, 8)


@pytest.fixture
def staged(tiny_random_converted):
    rows: list[dict] = []
    store = ExpertStore(read_manifest(tiny_random_converted), on_load=rows.append)
    stats = PathStats()
    readers = ReaderPool(store, 2, stats, help_main=False)
    path = StagedPath(store, 1, readers, stats)  # K=4 + headroom 4 = 8 slots
    yield path, store, stats, rows
    readers.close()
    store.close()


def _call(path, store, experts):
    x = mx.array(np.random.default_rng(1).standard_normal(
        (1, store.manifest.config["hidden_size"])).astype(np.float32))
    inds = mx.array(np.array([experts], dtype=np.uint32))
    assert np.array_equal(np.array(path(x, inds)), np.array(ExactPath(store, 1)(x, inds)))


def test_hint_reads_ahead_and_leaves_room_for_the_call(staged):
    """Slots hold 1-4 (published). A hint of 5-9 may fill 8 - 0 busy - K = 4 slots: 5-8 are
    read as prefetches, 9 is not. The call [5, 6, 1, 2] then reads nothing: 5 and 6 are in
    their slots (counted as misses: read for this call), 1 and 2 are hits. The unused hints
    (7, 8) are published once reaped."""
    path, store, stats, rows = staged
    table = path.slot_table
    _call(path, store, [1, 2, 3, 4])
    rows.clear()
    hits, misses = stats.cache_hits, stats.cache_misses
    table.hint([5, 6, 7, 8, 9])
    assert sorted(table.resident()) == [1, 2, 3, 4, 5, 6, 7, 8]
    _call(path, store, [5, 6, 1, 2])
    assert (stats.cache_hits - hits, stats.cache_misses - misses) == (2, 2)
    table.readers.drain(list(table.ticket_of.values()))
    table.reap()
    assert not table.ticket_of
    staged_rows = [r for r in rows if r["thread"] != "main"]  # (not the exact reference's)
    assert sorted((r["expert"], r["source"]) for r in staged_rows) == [
        (e, "prefetch") for e in (5, 6, 7, 8)]
    assert all(table.table_np[e] != table.sentinel for e in (5, 6, 7, 8))


def test_hint_never_takes_a_slot_with_a_read_in_flight(staged):
    """Four hinted reads not yet waited for hold 4 of the 8 slots: 8 - 4 - K = 0, so a second
    hint reads nothing (the call's own misses keep their K slots)."""
    path, store, stats, rows = staged
    table = path.slot_table
    table.hint([1, 2, 3, 4])
    table.hint([5, 6])
    assert sorted(table.resident()) == [1, 2, 3, 4]
    table.readers.drain(list(table.ticket_of.values()))
    table.reap()


def test_engine_same_tokens_and_the_hinted_sets_recorded(tiny_random_converted, tmp_path):
    """With the hint the tokens are those without it (a hint never routes); each decode
    step's hinted set is the table's row of its input token (the token the step before
    emitted), and only with the hint does the first MoE layer read prefetches in decode."""
    from engine.capture import capture, load_engine, start_recorder
    from traces.reader import read_trace

    heads = _heads(tiny_random_converted, tmp_path / "pre", seed=2)
    table = _hint_table(tiny_random_converted, heads)
    out = {}
    for hint in (False, True):
        eng = load_engine(tiny_random_converted, preset="staged", prerouter=heads,
                          page_cache_fraction=0.25, first_layer_hint=hint)
        rec = start_recorder(tmp_path / f"t{hint}", eng, command=["test"])
        try:
            out[hint] = capture(eng, [PROMPT], 12, recorder=rec, temp=1.0, seed=3)
        finally:
            rec.close()
            eng.close()
    trace = read_trace(tmp_path / "tTrue")
    plain = read_trace(tmp_path / "tFalse")
    assert trace.run["engine"]["first_layer_hint"] is True
    tokens = [t for r in out[True] for t in r.tokens]
    assert tokens == [t for r in out[False] for t in r.tokens]
    first = min(read_manifest(tiny_random_converted).moe_layers)
    decode = trace.steps.filter(trace.steps["phase"] == "decode").sort("step")
    hinted = trace.routing.filter(trace.routing["hinted_experts"].is_not_null()
                                  & trace.routing["step"].is_in(decode["step"].implode()))
    assert hinted["layer"].unique().to_list() == [first]
    got = dict(zip(hinted["step"].to_list(), hinted["hinted_experts"].to_list(), strict=True))
    for i, step in enumerate(decode["step"].to_list()):  # decode step i's input: token i
        assert got[step] == table[tokens[i]].tolist()
    for t, want in ((trace, True), (plain, False)):
        loads = t.loads.filter(t.loads["step"].is_in(decode["step"].implode())
                               & (t.loads["layer"] == first))
        assert ("prefetch" in loads["source"].to_list()) is want
    assert plain.routing["hinted_experts"].null_count() == plain.routing.height


def test_hint_config_is_bad_input_without_heads_or_table(tiny_random_converted, tmp_path):
    with pytest.raises(BadInput, match="comes with prerouter heads"):
        EngineConfig.from_preset("staged", first_layer_hint=True)
    heads = _heads(tiny_random_converted, tmp_path / "pre", seed=1)
    with pytest.raises(BadInput, match=rf"{HINT_FILE}: no such file .*ssdmoe train hint"):
        load_streaming(tiny_random_converted, config=EngineConfig.from_preset(
            "staged", prerouter=str(heads), first_layer_hint=True))
    _hint_table(tiny_random_converted, heads)
    with pytest.raises(BadInput, match="decode path is 'exact'"):
        load_streaming(tiny_random_converted, config=EngineConfig.from_preset(
            "on-demand", prerouter=str(heads), first_layer_hint=True))


def test_a_trace_from_before_the_hint_reads_none(tmp_path):
    """tests/data's capture predates the routing column: it reads as null (no hint), and its
    replay hints nothing."""
    import shutil
    from pathlib import Path

    from sim.routing_input import hints_of
    from traces.reader import read_trace

    src = Path(__file__).resolve().parent / "data" / "tiny-trained-staged"
    shutil.copytree(src, tmp_path / "old")
    trace = read_trace(tmp_path / "old")
    assert trace.routing["hinted_experts"].null_count() == trace.routing.height
    assert hints_of(trace, {int(s): i for i, s in enumerate(trace.steps["step"])}) == {}
