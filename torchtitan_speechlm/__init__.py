"""torchtitan-speechlm: train speech language models with torchtitan's own train loop.

Importing the package selects the CPU device when no accelerator exists (before torchtitan is
imported, see utils/compat.py) and registers the `speechlm` TrainSpec for our `torchtitan train`
console script and `torchrun -m torchtitan_speechlm.train` (torchtitan's Trainer subclassed:
trainer/trainer.py). Stock `python -m torchtitan.train --experimental.custom_import
torchtitan_speechlm` parses the same TOML and is told to use one of those.
"""

from torchtitan_speechlm.utils.compat import (
    count_integers_with_histc_on_cpu,
    install_checkpoint_safety,
    install_torchtitan_cpu_patches,
    use_cpu_when_no_accelerator,
)

use_cpu_when_no_accelerator()
install_torchtitan_cpu_patches()
install_checkpoint_safety()
count_integers_with_histc_on_cpu()

from torchtitan_speechlm.trainer.spec import SPEC_NAME, register  # noqa: E402

register()

__all__ = ["SPEC_NAME", "EspnetData", "PreparedData", "TitanTrainer", "register"]
_PYTHON_API = ("EspnetData", "PreparedData", "TitanTrainer")


def __getattr__(name: str):
    """``from torchtitan_speechlm import TitanTrainer``: the Python API is imported on first
    use only, so importing the package (every rank, every CLI command) stays cheap."""
    if name in _PYTHON_API:
        import torchtitan_speechlm.python_api as api

        return getattr(api, name)
    raise AttributeError(f"module 'torchtitan_speechlm' has no attribute {name!r}")


__version__ = "0.1.0"
