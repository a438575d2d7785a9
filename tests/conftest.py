"""Hypothesis profiles: `ci` is deterministic and thorough, `dev` is quick, `soak` is a long
random campaign (``HYPOTHESIS_SOAK_EXAMPLES``, 2000 by default) to run by hand."""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=300, derandomize=True, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=60, deadline=None)
settings.register_profile(
    "soak", max_examples=int(os.environ.get("HYPOTHESIS_SOAK_EXAMPLES", "2000")), deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
