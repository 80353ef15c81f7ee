"""The checkpoint folder of a run on disk: where it is and which ``step-N`` in it are complete.

An on-disk contract (DCP writes ``.metadata`` last), read by the resume logic, the start-up
checks and the checkpoint-save workaround in utils/compat.py alike, so it sits at the bottom.
"""

from __future__ import annotations

import json
import logging
import os
import re

# torchtitan's logger (torchtitan.tools.logging.logger) is the root logger; importing torchtitan
# here would run before utils/compat.py has chosen the device, so this module asks logging directly.
logger = logging.getLogger()

_STEP = re.compile(r"^step-(\d+)$")


def checkpoint_folder(job_config) -> str:
    return os.path.join(job_config.job.dump_folder, job_config.checkpoint.folder)


def complete_checkpoints(folder: str, warn: bool = False) -> list[int]:
    """Steps of the checkpoints DCP finished writing (a folder with ``.metadata``), ascending.
    A half-written ``step-N`` (no ``.metadata``: a save that was interrupted) is not one;
    torchtitan skips it silently, ``warn`` names it."""
    if not os.path.isdir(folder):
        return []
    steps = []
    for name in sorted(os.listdir(folder)):
        m = _STEP.match(name)
        if not m:
            continue
        if os.path.isfile(os.path.join(folder, name, ".metadata")):
            steps.append(int(m.group(1)))
        elif warn:
            logger.warning(
                f"{os.path.join(folder, name)} {why_incomplete(os.path.join(folder, name))}"
            )
    return sorted(steps)


def why_incomplete(step_dir: str) -> str:
    """Why a ``step-N`` without ``.metadata`` is skipped: a save that was interrupted, or,
    when its manifest (written once the save was complete) lists ``.metadata``, a file
    deleted or lost after the save."""
    try:
        with open(os.path.join(step_dir, ".manifest.json")) as f:
            listed = ".metadata" in json.load(f).get("files", {})
    except (OSError, ValueError, AttributeError):
        listed = False
    if listed:
        return (
            "has no .metadata although its manifest lists it: the file was deleted or lost "
            "after the save completed; skipped (restore it from a copy, or delete the folder)"
        )
    return "has no .metadata (a save that was interrupted): skipped; delete it once you no longer need it"
