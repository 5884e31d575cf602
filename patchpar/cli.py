"""The `patchpar` command: parses a typed config and hands it to a library function."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    import tyro

    from patchpar.costs import CommConfig
    from patchpar.generate import GenerateConfig

    config = tyro.extras.subcommand_cli_from_dict(
        {"generate": GenerateConfig, "comm": CommConfig},
        prog="patchpar",
        description="Patch-parallel diffusion inference in JAX.",
        args=argv,
    )
    try:
        if isinstance(config, GenerateConfig):
            from patchpar.generate import generate

            record = generate(config)
            for path in record["images"]:
                print(path)
            print(
                f"{record['strategy']} on {record['devices']} device(s): latent {record['latent_shape']} "
                f"-> {config.out}/latent.npy ({record['generate_s_including_compile']:.1f} s including "
                f"compile; stale buffers {record['stale_bytes_per_device'] / 2**20:.2f} MiB per device)"
            )
        elif isinstance(config, CommConfig):
            import json

            from patchpar.costs import format_comm, run_comm

            rec = run_comm(config)
            print(json.dumps(rec, sort_keys=True) if config.json else format_comm(rec))
    except ValueError as e:  # bad input: a clear message, no traceback
        print(f"patchpar: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
