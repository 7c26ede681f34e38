"""Test setup: 8 fake CPU devices, so sharding is exercised without accelerators."""

import os

# Must happen before jax is imported anywhere in the test session.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
