"""The decision rule (musique_rl/verdict/stats.py) against numbers computed by hand."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from musique_rl.verdict import stats


def t2_cdf(t: float) -> float:
    """Student's t CDF with 2 degrees of freedom in closed form: 1/2 + t / (2 sqrt(2 + t^2))."""
    return 0.5 + t / (2.0 * math.sqrt(2.0 + t * t))


def test_t_interval_matches_the_hand_computed_example():
    # mean 0.2, sd 0.1, se 0.1/sqrt(3); t_{0.975,2} = 4.303 -> 0.2 +- 0.2484
    iv = stats.t_interval([0.1, 0.2, 0.3])
    assert iv.mean == pytest.approx(0.2) and iv.sd == pytest.approx(0.1) and iv.df == 2
    assert iv.lo == pytest.approx(-0.0484, abs=1e-4) and iv.hi == pytest.approx(0.4484, abs=1e-4)
    assert iv.hi - iv.mean == pytest.approx(4.303 * 0.1 / math.sqrt(3), abs=1e-4)


def test_level_widens_the_interval_and_small_n_widens_it_through_t():
    d = [0.08, 0.03, 0.06, 0.05]
    narrow, wide = stats.t_interval(d, 0.5), stats.t_interval(d, 0.99)
    assert wide.lo < narrow.lo < narrow.hi < wide.hi
    # the same mean and sd over 2 pairs: t_{0.975,1} = 12.706 instead of t_{0.975,3} = 3.182
    two = stats.t_interval([0.1, 0.2])
    assert two.hi - two.mean == pytest.approx(12.706 * np.std([0.1, 0.2], ddof=1) / math.sqrt(2), abs=1e-3)


def test_one_difference_has_no_interval():
    with pytest.raises(ValueError, match="at least 2 paired differences, got 1"):
        stats.t_interval([0.3])


def test_sign_flip_p_is_exact_over_all_assignments():
    # n=3, all positive: only "all +" and "all -" reach |mean| 0.2 -> 2/8 two-sided
    sf = stats.sign_flip_test([0.1, 0.2, 0.3])
    assert sf.p == pytest.approx(0.25) and sf.exact and sf.min_p == pytest.approx(0.25)
    # sums of +-0.1 +-0.2 +-0.3: {.6, .4, .2, 0, 0, -.2, -.4, -.6}; 6 of 8 reach |0.1 - 0.2 + 0.3| = 0.2
    assert stats.sign_flip_test([0.1, -0.2, 0.3]).p == pytest.approx(0.75)
    # 5 pairs all one way: 2/32, the smallest p 5 pairs can give
    sf5 = stats.sign_flip_test([0.1, 0.2, 0.3, 0.15, 0.25])
    assert sf5.p == pytest.approx(0.0625) and sf5.min_p == pytest.approx(0.0625)


def test_identical_differences_give_a_point_interval_without_nan_or_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. scipy's "catastrophic cancellation" on near-identical data
        iv = stats.t_interval([0.1, 0.1, 0.1])
        assert (iv.lo, iv.mean, iv.hi, iv.sd) == (0.1, 0.1, 0.1, 0.0)
        d = stats.decide([0.1, 0.1, 0.1], "increase", 0.02)
        assert d.status == "Validated" and d.confidence == 1.0
        zero = stats.decide([0.0, 0.0], "decrease", 0.02)  # a knob that changes nothing, deterministically
        assert zero.status == "Invalidated" and zero.confidence == 1.0 and zero.sign_flip.p == 1.0
        at = stats.decide([0.02, 0.02], "increase", 0.02)
        assert at.status == "Inconclusive" and at.confidence == 0.5


def test_status_follows_the_signed_interval_and_confidence_is_the_t_mass():
    d = stats.decide([0.1, 0.2, 0.3], "increase", 0.02)  # [-0.048, 0.448] straddles 0.02
    assert d.status == "Inconclusive" and d.agree == 3
    assert d.confidence == pytest.approx(t2_cdf((0.2 - 0.02) / (0.1 / math.sqrt(3))), abs=1e-9)  # 0.9553
    assert d.confidence == pytest.approx(0.9553, abs=1e-4)

    up = stats.decide([0.11, 0.09, 0.12], "increase", 0.02)  # [0.069, 0.145]
    assert up.status == "Validated" and up.signed_lo > 0.02
    assert up.confidence == pytest.approx(t2_cdf((0.32 / 3 - 0.02) / (np.std([0.11, 0.09, 0.12], ddof=1) / math.sqrt(3))))
    # the same drop: Validated when a decrease was predicted, Invalidated when an increase was
    assert stats.decide([-0.11, -0.09, -0.12], "decrease", 0.02).status == "Validated"
    down = stats.decide([-0.11, -0.09, -0.12], "increase", 0.02)
    assert down.status == "Invalidated" and down.signed_hi < 0.02 and down.agree == 0
    # the interval is reported as measured (treatment minus control), whichever the direction
    assert down.interval.hi < 0


@pytest.mark.parametrize("direction", ["increase", "decrease"])
def test_a_decided_status_carries_at_least_the_one_sided_level(direction):
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(200):
        n = int(rng.integers(2, 8))
        d = stats.decide(rng.normal(rng.normal(0, 0.05), 0.03, n), direction, 0.02)
        seen.add(d.status)
        if d.status != "Inconclusive":
            assert d.confidence >= 0.975 - 1e-9
        else:
            assert 0.5 <= d.confidence <= 0.975 + 1e-9
    assert seen == {"Validated", "Invalidated", "Inconclusive"}


def test_bad_direction_is_named():
    with pytest.raises(ValueError, match="'up'"):
        stats.decide([0.1, 0.2], "up", 0.02)
