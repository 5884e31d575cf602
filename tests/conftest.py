"""Test setup: eight fake CPU devices and no network, before anything imports JAX."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import tempfile  # noqa: E402

# Generated model folders (tiny presets) go to a fresh place per test session.
os.environ["PATCHPAR_HOME"] = tempfile.mkdtemp(prefix="patchpar-test-")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
