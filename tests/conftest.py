"""Test setup: eight fake CPU devices and no network, before anything imports JAX."""

import os

# LLVM at -O0 and the older loop emitters: the same programs, compiled a third faster (the
# Makefile says why)
os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
    "--xla_cpu_use_fusion_emitters=false",
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# no Python traceback recorded as the location of every traced operation: ~5% of the suite's
# time (tracing is half of it); byte counts read named scopes, not locations
os.environ.setdefault("JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "0")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

# Generated model folders (tiny presets) go to a fresh place per test process, removed at exit.
os.environ["PATCHPAR_HOME"] = tempfile.mkdtemp(prefix="patchpar-test-")
atexit.register(shutil.rmtree, os.environ["PATCHPAR_HOME"], ignore_errors=True)

# One compile cache for the session, shared by its pytest workers: many tests compile the same
# programs (a micro model's single-device reference, a strategy's phase programs on the same
# inputs), and a program compiled once is then read back, in this worker or the other. The
# first process (pytest-xdist's controller, or pytest alone) makes a fresh folder, which its
# workers inherit through the environment, and removes it at exit: nothing comes from an
# earlier run, and a user's own cache is never touched. `PATCHPAR_COMPILE_CACHE=off` runs the
# tests uncached. Tests of the cache itself run their processes with folders of their own.
_OFF = ("0", "off", "false", "no")
if os.environ.get("PATCHPAR_COMPILE_CACHE", "").lower() not in _OFF and (
    "PYTEST_XDIST_WORKER" not in os.environ
):
    _cache = tempfile.mkdtemp(prefix="patchpar-test-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["PATCHPAR_COMPILE_CACHE"] = _cache

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402


def pytest_configure(config):
    """The session's compile cache on, in every process that runs tests (not in xdist's
    controller, which only hands them out)."""
    from patchpar import compile_cache

    controller = getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput")
    if not controller:
        compile_cache.enable()


@pytest.fixture(scope="session")
def micro_folder(tmp_path_factory):
    """A small diffusers-format pipeline folder (micro UNet, 2-level VAE, tiny CLIP), random
    weights: the CLI tests' model, quick to compile."""
    from torch_refs import MICRO_UNETS

    from patchpar.models.presets import PRESETS, write_random_folder

    micro = {
        "unet": {**MICRO_UNETS["sd"], "cross_attention_dim": 32},
        "vae": {
            **PRESETS["tiny"]["vae"],
            "block_out_channels": [8, 8],
            "norm_num_groups": 4,
            "down_block_types": ["DownEncoderBlock2D"] * 2,
            "up_block_types": ["UpDecoderBlock2D"] * 2,
        },
        "text_encoder": PRESETS["tiny"]["text_encoder"],
        "scheduler": PRESETS["tiny"]["scheduler"],
    }
    folder = tmp_path_factory.mktemp("micro")
    write_random_folder(folder, micro, seed=0)
    return folder


@pytest.fixture
def run_notebook():
    """Execute a notebook with nbclient in its own folder: (printed text, PNG outputs)."""
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient

    def run(path):
        nb = nbformat.read(path, as_version=4)
        NotebookClient(
            nb,
            timeout=300,
            kernel_name="python3",
            resources={"metadata": {"path": str(path.parent)}},
        ).execute()
        outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
        images = [o for o in outputs if "image/png" in o.get("data", {})]
        return "".join(o.get("text", "") for o in outputs), images

    return run


# Files with the most work first. `make test` runs pytest-xdist with `--dist loadfile`, which
# hands out whole files in collection order, so a heavy file collected late ran by itself at
# the end while the other worker idled (on this 2-core machine, 250 tests: 766 s in
# alphabetical order, 495 s heaviest first). The order: each file's measured time in the
# default tier, most first (re-measure with `pytest --durations=0` when a file grows). Within a
# file the order is unchanged. pytest-xdist >= 3.6 reorders files by their number of tests
# unless told not to (`--no-loadscope-reorder`, in the Makefile).
HEAVY_FIRST = (
    "test_uneven.py",
    "test_parallel_flux.py",
    "test_compress.py",
    "test_pipefusion.py",
    "test_processes.py",
    "test_runner.py",
    "test_parallel_sd3.py",
    "test_quant.py",
    "test_flux_pipeline.py",
    "test_parallel_context.py",
    "test_parallel_exchange.py",
    "test_cache.py",
    "test_wan_pipeline.py",
    "test_wan_models.py",
    "test_parallel_wan.py",
    "test_video_run.py",
    "test_parallel_unet.py",
    "test_scan.py",
    "test_vae_parallel.py",
    "test_asyncdiff.py",
    "test_cli.py",
    "test_readme.py",
    "test_clips.py",
    "test_deepcache.py",
    "test_parallel_dit.py",
    "test_parallel_tensor.py",
    "test_non_square.py",
    "test_calibrate.py",
    "test_projection.py",
    "test_launch.py",
    "test_sd3_pipeline.py",
    "test_attention.py",
    "test_ignored_options.py",
    "test_compile_cache.py",
    "test_comm.py",
    "test_cache_parity.py",
    "test_bad_input.py",
    "test_parallel_sites.py",
    "test_parallel_fsdp.py",
    "test_wire.py",
    "test_parallel_cli.py",
    "test_models_parity.py",
    "test_fmnist.py",
    "test_lab_ux.py",
    "test_pipeline.py",
    "test_parallel_forward.py",
    "test_non_finite.py",
    "test_dit_pipeline.py",
    "test_flops.py",
    "test_dit_models.py",
    "test_cache_lab.py",
    "test_schedulers.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable within a file
