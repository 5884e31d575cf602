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

import pytest  # noqa: E402


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
# hands out whole files in collection order, so a heavy file collected late (test_runner.py's
# killed-and-resumed sweep alone takes ~150 s) ran by itself at the end while the other worker
# idled. Measured on this 2-core machine, same 250 tests: 766 s in alphabetical order, 495 s
# with this order. Within a file the order is unchanged. pytest-xdist >= 3.6 reorders files by
# their number of tests unless told not to (`--no-loadscope-reorder`, in the Makefile): that
# put test_processes.py's one 77 s test last, alone.
HEAVY_FIRST = (
    "test_runner.py",
    "test_processes.py",
    "test_parallel_context.py",
    "test_parallel_fsdp.py",
    "test_parallel_exchange.py",
    "test_non_square.py",
    "test_parallel_unet.py",
    "test_parallel_cli.py",
    "test_parallel_forward.py",
    "test_parallel_tensor.py",
    "test_attention.py",
    "test_models_parity.py",
    "test_fmnist.py",
    "test_cli.py",
    "test_projection.py",
    "test_quality.py",
    "test_comm.py",
    "test_pipeline.py",
    "test_device_suite.py",
    "test_xla_cpu.py",
    "test_notebooks.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable within a file
