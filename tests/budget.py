"""How many examples a hypothesis test runs: its figure for the `ci` profile, scaled by the profile loaded in
tests/conftest.py (ci 40, dev 60, long 2,000), so a long local run runs every property longer, not only some."""

from __future__ import annotations

from hypothesis import settings

CI_MAX_EXAMPLES = 40  # the ci profile's max_examples (tests/conftest.py)


def examples(at_ci: int) -> int:
    """`at_ci` under the ci profile; proportionally more (or fewer) under the others."""
    return max(1, round(at_ci * settings.default.max_examples / CI_MAX_EXAMPLES))
