"""Fig. 6 over several seeds (`adacc bench paper --loss-seeds`): the paper's claims are read from differences
paired by seed, with 95% intervals computed by hand here. The runs themselves: tests/foundation/test_paper_report.py."""

from __future__ import annotations

import math

import pytest

from megatron_adacc.bench import seeds


def test_the_interval_is_the_student_t_interval_of_the_mean() -> None:
    iv = seeds.interval([0.1, 0.3, 0.5])
    # mean 0.3, sd 0.2, t(0.975, 2) = 4.303: half-width 4.303 * 0.2 / sqrt(3)
    half = 4.303 * 0.2 / math.sqrt(3)
    assert iv["mean"] == pytest.approx(0.3) and iv["sd"] == pytest.approx(0.2)
    assert (iv["low"], iv["high"]) == (pytest.approx(0.3 - half), pytest.approx(0.3 + half))
    assert seeds.interval([0.4])["low"] is None
    assert seeds.t975(50) == 1.96 and seeds.t975(11) == 2.179


def test_differences_are_paired_by_seed_in_percent_of_that_seeds_baseline() -> None:
    runs = {"baseline": {1: 2.0, 2: 4.0, 3: 1.0}, "adacc": {1: 2.02, 2: 4.0}, "quantization": {1: 2.1, 2: 4.2}}
    assert seeds.paired(runs, "adacc", "baseline") == [pytest.approx(1.0), pytest.approx(0.0)]
    # Quantization against Adacc, still in percent of the baseline's loss from the same seed
    assert seeds.paired(runs, "quantization", "adacc") == [pytest.approx(4.0), pytest.approx(5.0)]
    stats = seeds.summary(runs)
    assert stats["vs_baseline"]["adacc"]["n"] == 2 and "no_outlier_vs_adacc" not in stats
    assert stats["baseline_spread_pct"] == pytest.approx(math.sqrt(7 / 3) / (7 / 3) * 100)  # sd 1.53, mean 2.33


@pytest.mark.parametrize("diffs, verdict", [
    ([0.1, 0.2, 0.15], "the interval lies below the paper's +0.5%, so the claim holds here"),
    ([0.9, 1.0, 1.1], "the interval lies above the paper's +0.5%, so the claim fails here"),
    ([0.1, 0.9, 0.5], "the interval contains +0.5%: these seeds do not decide the claim"),
])
def test_adacc_is_held_against_the_papers_bound_by_its_interval(diffs, verdict) -> None:
    runs = {"baseline": {s: 2.0 for s in (1, 2, 3)},
            "adacc": {s: 2.0 * (1 + d / 100) for s, d in zip((1, 2, 3), diffs)}}
    assert verdict in seeds.reading(seeds.summary(runs))


def test_the_reading_says_what_pairing_bought_and_how_many_seeds_would_resolve_a_quarter_point() -> None:
    base = {1: 2.0, 2: 2.02, 3: 1.98}  # spread 1.00%: two independent seeds differ by 1.41%
    decorrelated = seeds.reading(seeds.summary({"baseline": base, "adacc": {1: 2.04, 2: 2.0, 3: 1.98}}))
    # paired differences +2%, -0.99%, 0%: sd 1.52%, so pairing bought nothing; (1.96 x 1.52 / 0.25)^2 = 142.4
    assert ("a 1.52% standard deviation against 1.41% for two independent seeds: they vary as much as two "
            "independent seeds would") in decorrelated
    assert "about 143 seeds" in decorrelated
    paired = seeds.reading(seeds.summary({"baseline": base, "adacc": {s: v * 1.002 for s, v in base.items()}}))
    assert "pairing cuts that to 0%" in paired and "about 2 seeds" in paired
