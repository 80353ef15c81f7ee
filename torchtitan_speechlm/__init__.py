"""torchtitan-speechlm: train speech language models with torchtitan's own train loop.

Importing the package loads neither torch nor torchtitan (``torchtitan --help`` and every
command's ``--help`` answer at once: cli.py). It arranges, through ``utils/import_hooks.py``, that
the first ``import torchtitan`` of the process runs our fixes around it (utils/compat.py): the CPU
device is selected before torchtitan's modules run, and torchtitan's CPU, checkpoint and MoE fixes
are installed right after (with them, fix 20 for every ``wandb.init`` of the process, the user's
own included); and that transformers' loss modules find ``scipy.optimize`` deferred (compat fix
22). The ``speechlm`` TrainSpec registers when any module of
``trainer/`` is imported, as every training entry point and every reader of a job config does
(``torchtitan train``, ``torchrun -m torchtitan_speechlm.train``, the Python API,
``trainer.run.prepare_run``); ``torchtitan_speechlm.register()`` does it too. Stock ``python -m torchtitan.train
--experimental.custom_import torchtitan_speechlm`` imports torchtitan first, and the package then
registers the spec at once.
"""

import sys

from torchtitan_speechlm.utils.import_hooks import around_import


def _before_torchtitan() -> None:
    from torchtitan_speechlm.utils import compat

    compat.use_cpu_when_no_accelerator()
    compat.count_integers_with_histc_on_cpu()
    compat.defer_hf_text_datasets()
    compat.defer_attention_compiles_on_cpu()


def _after_torchtitan() -> None:
    from torchtitan_speechlm.utils import compat

    compat.install_torchtitan_cpu_patches()
    compat.install_checkpoint_safety()
    compat.quiet_peak_flops_on_cpu()
    compat.start_every_wandb_run_without_its_launch_agent()


def _before_transformers_losses() -> None:
    from torchtitan_speechlm.utils import compat

    compat.defer_scipy_optimize()


_TORCHTITAN_FIRST = "torchtitan" in sys.modules
around_import("torchtitan", _before_torchtitan, _after_torchtitan)
around_import("transformers.loss.loss_utils", _before_transformers_losses, lambda: None)
if _TORCHTITAN_FIRST:  # torchtitan's custom_import: the spec is looked up next
    from torchtitan_speechlm.trainer import spec as _spec  # noqa: F401  (registers it)

__all__ = [
    "SPEC_NAME", "EspnetData", "PreparedData", "TitanTrainer", "mix_espnet_batches", "register"
]  # fmt: skip
_PYTHON_API = ("EspnetData", "PreparedData", "TitanTrainer", "mix_espnet_batches")


def __getattr__(name: str):
    """``from torchtitan_speechlm import TitanTrainer`` (or ``register``, ``SPEC_NAME``): loaded
    on first use, so that importing the package (every rank, every command) stays cheap."""
    if name in _PYTHON_API:
        import torchtitan_speechlm.python_api as api

        return getattr(api, name)
    if name in ("SPEC_NAME", "register"):
        from torchtitan_speechlm.trainer import spec

        return getattr(spec, name)
    raise AttributeError(f"module 'torchtitan_speechlm' has no attribute {name!r}")


__version__ = "0.1.0"
