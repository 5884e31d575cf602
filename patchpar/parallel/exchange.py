"""The packed stale exchange (docs/design.md §2): in the steady phase a stale site reads its
buffer and leaves what it would send in the Flax collection `send`; after the model call the
engine exchanges those pending sends together, in `groups` groups of sites in layer order
(distrifuser's `comm_checkpoint`), one collective per site kind, collective and dtype over one
flat buffer per group (on a CPU; on a TPU or GPU each payload its own collective, issued with
its group's: `sites.common.packs_flat`), and lays what comes back into the buffers step t+1
reads.

Group g's collectives depend only on its own sites' sends, so a backend with asynchronous
collectives (GPU, TPU) may start them as soon as the group's last site has run and overlap them
with the compute of groups g+1..; on XLA:CPU collectives run synchronously, and the gain is the
number of collectives (each pays gloo's latency). Exchanging is data movement (and an
elementwise mean for GroupNorm statistics), so the buffers equal those of per-site exchanges
(bit for bit where XLA compiles the two programs' arithmetic alike; within float rounding
where it fuses them differently). A compressed site's payloads are its `uint8` wire payloads; its new bases come
from the same update as at the site (`PatchSite.absorb`).
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from patchpar.models.scan import LAYER
from patchpar.parallel.sites import PatchOps, exchange
from patchpar.parallel.sites.common import COLLECTIVES

Pending = tuple[tuple[str, ...], str, dict]  # (module path, site kind, {collective: payload})


def pending_sends(tree: dict, path: tuple[str, ...] = ()) -> Iterator[Pending]:
    """The pending sends of a model call's `send` collection, in the order the sites ran (Flax
    keeps the order in which variables were made; `jax.tree` would sort the keys)."""
    for key, node in tree.items():
        if isinstance(node, dict) and node and set(node) <= set(COLLECTIVES):
            yield path, key, node
        elif isinstance(node, dict):
            yield from pending_sends(node, path + (key,))


def exchange_packed(tree: dict, ops: PatchOps, groups: int, stale: dict) -> dict:
    """Exchange the pending sends of `tree` in `groups` groups of consecutive sites; returns the
    new stale buffers as a nested dict {module path...: {buffer name: value}}. `stale`: the
    call's stale collection (what a compressed site's update starts from)."""
    pending = list(pending_sends(tree))
    check_groups(groups, len(pending))
    out: dict = {}
    for chunk in np.array_split(np.arange(len(pending)), groups):
        by_kind: dict[str, list[Pending]] = {}
        for i in chunk:
            by_kind.setdefault(pending[i][1], []).append(pending[i])
        for kind, items in by_kind.items():
            op = ops.site(kind)
            got = exchange(kind, [sends for _, _, sends in items], op.n, op.local)
            for (path, _, sends), received in zip(items, got, strict=True):
                held = stale
                for part in path:
                    held = held.get(part, {})
                node = out
                for part in path:
                    node = node.setdefault(part, {})
                if not scanned(path):
                    node.update(op.absorb(received, held, sends))
                    continue
                # a scanned stack's site: every payload has a layer axis in front (a
                # gather's behind its device axis); each layer's buffers from its own
                received = {c: jnp.moveaxis(v, 1, 0) if c == "gather" else v
                            for c, v in received.items()}  # fmt: skip
                node.update(jax.vmap(op.absorb)(received, held, sends))
    return out


def scanned(path: tuple[str, ...]) -> bool:
    """Whether a site's module path runs inside a scanned stack of blocks (its variables have a
    leading layer axis: `patchpar.models.scan`)."""
    return any(path[i : i + 2] == ("scan", LAYER) for i in range(len(path) - 1))


def check_groups(groups: int, sites: int) -> None:
    if groups > 1 and groups > sites:
        raise ValueError(
            f"comm_groups={groups} is larger than the {sites} stale site(s) that send in the "
            f"steady phase of this model and plan: use comm_groups between 1 and {max(sites, 1)}"
        )


def merged(stale: dict, updates: dict) -> dict:
    """`stale` with the buffers of `updates` put in (nested dicts; neither is changed)."""
    out = dict(stale)
    for key, value in updates.items():
        out[key] = merged(stale.get(key, {}), value) if isinstance(value, dict) else value
    return out
