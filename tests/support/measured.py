"""The planner's bar against a measured step, which its tests share."""

from memfit.planner.categories import Category


def assert_within_3pct_per_category(predicted, measured):
    """The issue's bar: the peak and each category at it within 3% of the measured step."""
    for c in Category:
        assert abs(predicted[c] - measured[c]) <= 0.03 * measured[c], (c, predicted.as_dict(), measured.as_dict())
    assert abs(predicted.total_bytes - measured.total_bytes) <= 0.03 * measured.total_bytes
