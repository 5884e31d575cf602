"""A worker program for tests/test_processes.py, started by `patchpar.lab.launch.launch`:
joins the others, then does what its first argument says.

  denoise OUT.npz CFG NAME...   the micro SD UNet's final latent under each strategy NAME
                    (of STRATEGIES) on a (data, cfg, patch) mesh over every process's device;
                    process 0 saves them
  bases OUT.npz NAME   the link variables (compressed exchange) of the stale state under NAME
                    after each of STEPS steps (whole runs of 1..STEPS steps), every device's
  die RANK          process RANK exits at once with code 7; the others wait in a collective
  hang              every process sleeps (for the launcher's timeout)
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

WORKER_PROGRAM = (str(Path(__file__).resolve()),)  # `launch(..., program=WORKER_PROGRAM)`


def can_bind_localhost() -> bool:
    """The process tests need a localhost port (they are skipped where none can be bound)."""
    from patchpar.lab.launch import free_port

    try:
        free_port()
        return True
    except OSError:
        return False


def quiet(msg: str) -> None:
    """The launcher's log, on stderr (pytest shows it for a failing test)."""
    print(msg, file=sys.stderr)


STRATEGIES = {  # name: (strategy, options, data parallel, fsdp)
    "sync_patch": ("sync_patch", {}, False, False),
    "distrifusion": ("distrifusion", {"warmup_steps": 1}, False, False),
    "pcpp": ("pcpp", {"warmup_steps": 1, "portion": 0.5}, False, False),
    # the stale sends exchanged at each site (the two above: packed, in one group)
    "distrifusion_per_site": (
        "distrifusion",
        {"warmup_steps": 1, "comm_groups": "per_site"},
        False,
        False,
    ),
    "pcpp_per_site": (
        "pcpp",
        {"warmup_steps": 1, "portion": 0.5, "comm_groups": "per_site"},
        False,
        False,
    ),
    "ring": ("ring", {}, False, False),
    "ulysses": ("ulysses", {}, False, False),
    "tensor": ("tensor", {}, False, False),
    "data": ("sync_patch", {}, True, False),  # every device of a cfg half takes its own images
    "fsdp": ("sync_patch", {}, False, True),  # weights sharded, gathered per layer
    # compressed exchange: stale (packed) on distrifusion, fresh with compact
    "distrifusion_int2": (
        "distrifusion",
        {"warmup_steps": 0, "codec": "kv=int2,halo=int8"},
        False,
        False,
    ),
    "compact_sign1": ("compact", {"warmup_steps": 0, "codec": "kv=sign1,halo=int4"}, False, False),
}
EXACT = ("sync_patch", "ring", "ulysses", "tensor", "data", "fsdp")  # equal to the single device
STEPS = 4


def final_latents(devices: int, cfg: int, names) -> dict:
    """{strategy: final latent} of STEPS DDIM steps under each strategy on `devices` devices."""
    import numpy as np
    from parallel_helpers import GUIDANCE, inputs, micro_unet

    from patchpar.parallel.engine import Plan, denoise
    from patchpar.parallel.mesh import to_local
    from patchpar.parallel.strategies import make_strategy
    from patchpar.sampling.schedulers import SchedulerConfig, get_sampler

    unet, params = micro_unet("sd")
    x, _, cond = inputs("sd")
    smp = get_sampler("ddim")
    sched = smp.schedule(SchedulerConfig(), STEPS)
    out = {}
    for name in names:
        strategy, options, data, fsdp = STRATEGIES[name]
        plan = Plan(
            make_strategy(strategy, **options),
            devices,
            cfg,
            data=devices // cfg if data else 1,
            fsdp=fsdp,
        )
        latent, _ = denoise(
            unet, plan, smp, params, cond, sched, x * sched.init_noise_sigma, GUIDANCE
        )
        out[name] = np.asarray(to_local(latent))
    return out


def link_states(devices: int, name: str) -> dict:
    """{'<steps>/<variable path>': every device's value} of the link variables (`cx_...`)
    after runs of 1..STEPS steps under strategy NAME, gathered from every process."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from parallel_helpers import GUIDANCE, inputs, micro_unet

    from patchpar.parallel.engine import Plan, denoise
    from patchpar.parallel.strategies import make_strategy
    from patchpar.sampling.schedulers import SchedulerConfig, get_sampler

    unet, params = micro_unet("sd")
    x, _, cond = inputs("sd")
    smp = get_sampler("ddim")
    strategy, options, _, _ = STRATEGIES[name]
    plan = Plan(make_strategy(strategy, **options), devices, 1)
    out = {}
    for steps in range(1, STEPS + 1):
        sched = smp.schedule(SchedulerConfig(), steps)
        _, state = denoise(
            unet, plan, smp, params, cond, sched, x * sched.init_noise_sigma, GUIDANCE
        )
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
            if path[-1].key.startswith("cx_"):
                key = f"{steps}/" + "/".join(p.key for p in path)
                out[key] = np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    return out


def vae_outputs(devices: int) -> dict:
    """The tiny preset's VAE over `devices` devices: rows decode, rows encode, tiled decode
    (`vae_inputs` gives the inputs), each gathered whole on every process."""
    import numpy as np

    from patchpar.parallel.mesh import to_local
    from patchpar.parallel.vae import VAEPlan, decode, encode

    vae, params, z, images = vae_inputs()
    mean, logvar = encode(vae, params, images, VAEPlan("rows", devices))
    out = {
        "rows": decode(vae, params, z, VAEPlan("rows", devices)),
        "tiles": decode(vae, params, z, VAEPlan("tiles", devices, tile=64)),
        "mean": mean,
        "logvar": logvar,
    }
    return {k: np.asarray(to_local(v)) for k, v in out.items()}


def vae_inputs():
    """(vae, params, latent (2, 16, 8, 4), images (2, 64, 64, 3)) of the tiny preset's VAE."""
    import jax
    import jax.numpy as jnp

    from patchpar.models.api import VAEFn
    from patchpar.models.presets import PRESETS
    from patchpar.models.vae import AutoencoderKL, VAEConfig

    vae = VAEFn(AutoencoderKL(VAEConfig.from_diffusers(PRESETS["tiny"]["vae"]), jnp.float32))
    z = jax.random.normal(jax.random.key(0), (2, 16, 8, 4))
    images = jax.random.uniform(jax.random.key(1), (2, 64, 64, 3), minval=-1, maxval=1)
    return vae, vae.init(1), z, images


def main() -> None:
    from patchpar.lab import launch

    launch.setup_worker()
    args, cluster = launch.pop_cluster_flags(sys.argv[1:])
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py
    launch.join(cluster)
    what = args[0]
    if what == "denoise":
        latents = final_latents(jax.device_count(), int(args[2]), args[3:])
        if jax.process_index() == 0:
            import numpy as np

            np.savez(args[1], **latents)
    elif what == "denoise_and_vae":  # both in one launch (one start-up of the processes)
        latents = final_latents(jax.device_count(), int(args[3]), args[4:])
        outs = vae_outputs(jax.device_count())
        if jax.process_index() == 0:
            import numpy as np

            np.savez(args[1], **latents)
            np.savez(args[2], **outs)
    elif what == "bases":
        states = link_states(jax.device_count(), args[2])
        if jax.process_index() == 0:
            import numpy as np

            np.savez(args[1], **states)
    elif what == "vae":
        outs = vae_outputs(jax.device_count())
        if jax.process_index() == 0:
            import numpy as np

            np.savez(args[1], **outs)
    elif what == "die":
        if jax.process_index() == int(args[1]):
            os._exit(7)
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("never reached by the dead rank")
    elif what == "hang":
        time.sleep(3600)


if __name__ == "__main__":
    main()
