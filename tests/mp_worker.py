"""A worker program for tests/test_processes.py, started by `patchpar.lab.launch.launch`:
joins the others, then does what its first argument says.

  denoise OUT.npz CFG NAME...   the micro SD UNet's final latent under each strategy NAME
                    (of STRATEGIES) on a (data, cfg, patch) mesh over every process's device;
                    process 0 saves them
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
    elif what == "die":
        if jax.process_index() == int(args[1]):
            os._exit(7)
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("never reached by the dead rank")
    elif what == "hang":
        time.sleep(3600)


if __name__ == "__main__":
    main()
