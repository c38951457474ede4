"""reports/policies/run.py's reading of a run, on hand-worked rounds: the noise band comes from
the staged path's same-reads control (Least-Stale is LRU in a per-layer table), a difference
counts only when every round separates it AND it is wider than that band, and the simulator is
judged on the resolved pairs alone; each round's throttle rate rotates around the nominal."""

from __future__ import annotations

from argparse import Namespace

import pytest

from reports.load_script import load_script


@pytest.fixture(scope="module")
def report():
    return load_script("policies/run.py")


def _row(config: str, policy: str, rounds: list[float], sim: float, hit: float = 0.3) -> dict:
    return {"model": "m", "config": config, "policy": policy, "paired_rounds": rounds,
            "paired_vs_lru": sorted(rounds)[len(rounds) // 2], "simulated_paired_vs_lru": sim,
            "measured_cache_hit_rate": hit, "simulated_cache_hit_rate": hit,
            "measured_decode_tok_s": 10 * sorted(rounds)[len(rounds) // 2],
            "simulated_decode_tok_s": 10 * sim}


def _rows(fifo_sim: float) -> list[dict]:
    one = [1.0, 1.0, 1.0]
    return [
        # the control: Least-Stale reads what LRU reads on the staged path; it drifts by 0.6%
        _row("staged", "lru", one, 1.0), _row("staged", "least-stale", [1.004, 0.994, 1.0], 1.0),
        _row("staged", "lfu", [0.995, 0.996, 0.997], 1.02, hit=0.29),  # separated, inside 0.6%
        _row("staged", "fifo", [1.01, 1.02, 1.015], 0.99, hit=0.28),
        _row("hot", "lru", one, 1.0), _row("hot", "least-stale", [0.9, 0.91, 0.92], 0.93),
        _row("hot", "lfu", [0.975, 0.99, 1.01], 0.96),  # 1% off LRU, rounds overlap: a tie
        _row("hot", "fifo", [0.95, 0.96, 0.97], fifo_sim)]


def test_the_band_is_the_same_reads_controls_largest_drift(report):
    rows = _rows(0.95)
    assert report.null_band(rows, "m") == pytest.approx(0.006)
    rows[1]["measured_cache_hit_rate"] = 0.31  # the control read other bytes: no band
    assert report.null_band(rows, "m") is None


def test_only_differences_wider_than_the_band_and_every_round_are_resolved(report):
    ranks = {k["config"]: k for k in report.rankings(_rows(0.95))}
    staged, hot = ranks["staged"], ranks["hot"]
    # LFU is below LRU in every round, but by 0.4% < 0.6%: a tie; FIFO's +1.5% is resolved
    assert staged["resolved_pairs"] == [["fifo", "lru", False], ["fifo", "least-stale", False],
                                        ["fifo", "lfu", False]]
    assert staged["measured"] == "fifo > lru = least-stale = lfu"
    assert staged["simulated"] == "lfu > lru = least-stale > fifo"
    assert not staged["resolved_pairs_agree"]
    # LFU overlaps LRU: tied; every other hot pair is resolved, and the simulator agrees
    assert {tuple(p[:2]) for p in hot["resolved_pairs"]} == {
        ("lru", "least-stale"), ("lru", "fifo"), ("lfu", "least-stale"), ("lfu", "fifo"),
        ("fifo", "least-stale")}
    assert hot["resolved_pairs_agree"] and hot["resolved_pairs_agreeing"] == 5
    assert hot["measured"] == "lru = lfu > fifo > least-stale"


def test_a_simulator_that_swaps_one_resolved_pair_fails_it(report):
    hot = {k["config"]: k for k in report.rankings(_rows(0.92))}["hot"]  # fifo below LS now
    assert not hot["resolved_pairs_agree"]
    assert ["fifo", "least-stale", False] in hot["resolved_pairs"]
    assert hot["resolved_pairs_agreeing"] == 4


def test_rounds_rotate_the_throttle_around_its_rate(report):
    args = Namespace(read_mbps=30.0, rate_spread=0.1)
    assert [report.round_rate(args, r) for r in range(6)] == [30, 27, 33, 30, 27, 33]
    assert report.round_rate(Namespace(read_mbps=0.0, rate_spread=0.1), 2) == 0  # unthrottled
    assert report.round_rate(Namespace(read_mbps=30.0, rate_spread=0.0), 1) == 30
