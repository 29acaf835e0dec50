"""pytest for the whole repository: the kit's fixtures, and the hypothesis profiles ("ci" when
CI is set keeps the suite within its time budget on 2 cores)."""

import os

from hypothesis import HealthCheck, settings

pytest_plugins = ["parallel.testing.world"]  # the virtual_world fixture, as a user loads it

settings.register_profile(
    "ci",
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")
