"""One training rank: torchtitan's own `main(Trainer)` after our device selection and spec.

Run by `torchtitan train`, or directly by torchrun for multi-node jobs:
    torchrun --nnodes 2 --nproc-per-node 8 ... -m torchtitan_speechlm.train --job.config_file X
"""

from __future__ import annotations

import sys


def run_worker(args: list[str]) -> int:
    import torchtitan_speechlm  # noqa: F401  (must precede torchtitan: CPU device selection)

    from .cli import torchtitan_args
    from .compat import run_torchtitan_main

    run_torchtitan_main(torchtitan_args(args))  # idempotent on already normalised args
    return 0


if __name__ == "__main__":
    sys.exit(run_worker(sys.argv[1:]))
