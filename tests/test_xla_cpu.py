"""patchpar's XLA:CPU options (patchpar/xla_flags.py) and the multi-device race they avoid."""

import os
from pathlib import Path

import pytest

from patchpar import xla_flags
from patchpar.xla_flags import YNN


@pytest.fixture
def env(monkeypatch):
    for var in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES", "PATCHPAR_XLA_DEFAULTS", "PATCHPAR_XLA_SET"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_one_device_gets_the_fast_option(env):
    assert xla_flags.apply_defaults() == [f"{YNN}=individual_dot"]
    assert os.environ["XLA_FLAGS"] == f"{YNN}=individual_dot"


@pytest.mark.parametrize(
    "var, value",
    [("XLA_FLAGS", "--xla_force_host_platform_device_count=8"), ("JAX_NUM_CPU_DEVICES", "4")],
)
def test_several_devices_in_one_process_get_jaxlibs_default(env, var, value):
    env.setenv(var, value)
    assert xla_flags.apply_defaults() == []
    assert xla_flags.in_effect() == {YNN: "(jaxlib default)"}


def test_a_changed_device_count_replaces_patchpars_own_value(env):
    xla_flags.apply_defaults()
    xla_flags.apply_defaults(devices=8)  # patchpar's one-device value goes: jaxlib's default
    assert os.environ["XLA_FLAGS"].split() == []
    xla_flags.apply_defaults(devices=1)
    assert os.environ["XLA_FLAGS"].split() == [f"{YNN}=individual_dot"]
    env.setenv("XLA_FLAGS", f"{YNN}=individual_dot")  # the user's: kept
    env.setenv(xla_flags.SET_BY_PATCHPAR, "")
    xla_flags.apply_defaults(devices=8)
    assert os.environ["XLA_FLAGS"].split() == [f"{YNN}=individual_dot"]


def test_the_users_value_and_the_off_switch_win(env):
    env.setenv("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {YNN}=individual_dot")
    assert xla_flags.apply_defaults() == []  # even patchpar's one-device value, if the user's
    assert xla_flags.in_effect() == {YNN: "individual_dot"}
    env.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    env.setenv("PATCHPAR_XLA_DEFAULTS", "0")
    assert xla_flags.apply_defaults() == []
    assert xla_flags.in_effect() == {YNN: "(jaxlib default)"}


def test_this_session_runs_with_the_multi_device_option():
    """conftest starts 8 CPU devices before importing patchpar: the option below must be on,
    or the next test does not test what patchpar runs."""
    import jax

    assert jax.device_count() == 8
    assert xla_flags.in_effect() == {YNN: "(jaxlib default)"}


@pytest.mark.slow  # an XLA:CPU canary, 200 images: the flags' logic is tested above
def test_sync_patch_repeated_in_one_program_equals_single_for_a_large_batch():
    """The fmnist UNet 5 times in one jitted loop, 200 images, 8 devices with sync_patch's
    exact site ops, against one device (experiments/xla_cpu_race.py's programs, run in this
    process). With `individual_dot` in this 8-device process (jaxlib 0.10.2, 2 cores) images
    0-3 come out wrong by 0.029 from the 5th call on, an XLA:CPU race (checked: the same test
    with that option set by hand fails); the small batches of the other tests never showed it."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "experiments" / "xla_cpu_race.py"
    spec = importlib.util.spec_from_file_location("xla_cpu_race", path)
    race = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(race)
    got = race.child(race.parse(["--devices", "8", "--batch", "200", "--calls", "5"]))
    assert got["max_abs_diff"] <= 1e-4, f"images off by > 1e-3: {got['wrong_images']}"
