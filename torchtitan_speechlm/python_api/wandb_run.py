"""wandb for the Python API: the caller's run if there is one, else the CLI's offline run.

ESPnet's TitanTrainer requires ``wandb.init()`` before it is built and logs into that run.
torchtitan's WandBLogger instead calls ``wandb.init`` itself (which would finish or replace the
caller's run) and ``wandb.finish`` on close. So: with ``wandb.run`` set, torchtitan's logger is
switched off for this process and ``RunLogger`` logs rank 0's metrics into the caller's run
(online or offline, as the caller chose) without finishing it; without one, the TOML's
``metrics.enable_wandb = true`` makes torchtitan start an offline run under the dump folder,
exactly as ``torchtitan train`` does (components/metrics.py).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from torchtitan_speechlm.utils.upstream import BaseLogger


def current_run() -> Any | None:
    """The caller's wandb run, without importing wandb if the caller never did."""
    wandb = sys.modules.get("wandb")
    return getattr(wandb, "run", None) if wandb is not None else None


class RunLogger(BaseLogger):
    """Logs into an existing wandb run; never finishes it (the caller owns it)."""

    def __init__(self, run: Any):
        self.run = run

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.run.log(
            {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in metrics.items()},
            step=step,
        )

    def close(self) -> None:
        """The caller's run stays open."""
