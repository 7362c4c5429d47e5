"""The contract every registered strategy must pass: hetsim.testing's suite, collected here as well.

The checks live in the package (`hetsim.testing`) so that a third-party family runs the same suite
against itself (`python -m pytest --pyargs hetsim.testing`); importing the test functions here makes
`pytest tests` run them over every registered family.
"""

from __future__ import annotations

from hetsim.testing.test_contract import (  # noqa: F401  (collected by pytest)
    test_memory_prediction_is_sane,
    test_plans_roundtrip_through_json,
    test_real_run_matches_full_batch_gradient,
    test_search_space_gives_valid_prefixed_plans,
    test_simulation_is_deterministic,
)
