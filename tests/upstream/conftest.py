"""The patches check (patches/check_sufficiency.py) runs these tests on a scratch copy of
torchtitan and names it in ``TORCHTITAN_SPEECHLM_EXPECT_TORCHTITAN``: a run that imported
torchtitan from anywhere else stops at once (exit status 4) instead of testing the wrong copy.
(The check used to ask a Python process of its own first, ~4 s of imports per condition.)"""

import os
from pathlib import Path

import pytest
import torchtitan

EXPECTED = os.environ.get("TORCHTITAN_SPEECHLM_EXPECT_TORCHTITAN")


def pytest_configure(config: pytest.Config) -> None:
    if EXPECTED and not Path(torchtitan.__file__).resolve().is_relative_to(
        Path(EXPECTED).resolve()
    ):
        pytest.exit(f"torchtitan came from {torchtitan.__file__}, not {EXPECTED}", returncode=4)
