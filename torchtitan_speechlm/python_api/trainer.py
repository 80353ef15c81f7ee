"""``TitanTrainer``: ESPnet SpeechLM's trainer class, with torchtitan's own Trainer doing the work.

ESPnet users build ``TitanTrainer(train_data_factory, valid_data_factories, model, resume_path,
output_dir, trainer_args, parallel_dims=None)`` and call ``run()`` (or ``train()`` /
``valid()`` themselves). Here the constructor

1. saves a transformers model object once as the backbone folder (a folder is used as is);
2. maps ``trainer_args`` and the data factories to TOML sections (args.py, data.py), writes
   them to ``output_dir/titan_trainer.toml`` and parses that file with torchtitan's
   ConfigManager and the same checks as ``torchtitan train`` (so the CLI repeats the run);
3. builds ``ChunkedTrainer``, our trainer (torchtitan's ``Trainer`` with the run handed to the
   spec: trainer/trainer.py) with three small overrides (an existing
   ParallelDims, a stop step, one persistent data iterator), and loads the checkpoint to
   continue from.

``run()`` is one call of torchtitan's ``Trainer.train`` up to ``max_step`` (identical to
``torchtitan train``: validation every ``save_interval`` steps and at step 1, checkpoints every
``save_interval`` steps). ``train()`` calls the same loop for ``save_interval`` steps without
validation and saves; ``valid()`` runs our validator over every set. Chunks share the data
iterator and never reload, so any sequence of ``train()`` calls trains exactly what ``run()``
trains.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torchtitan_speechlm.commands.train import check_config, set_single_process_env, torchtitan_args
from torchtitan_speechlm.config import ConfigError
from torchtitan_speechlm.python_api.args import (
    TOML_NAME,
    check_sections,
    merge,
    trainer_args_to_sections,
    write_toml,
)
from torchtitan_speechlm.python_api.data import resolve_data
from torchtitan_speechlm.python_api.espnet_checkpoint import (
    EspnetCheckpoint,
    espnet_steps,
    is_espnet_checkpoint,
    load_espnet_checkpoint,
)
from torchtitan_speechlm.python_api.espnet_data import EspnetRunData
from torchtitan_speechlm.python_api.espnet_io import io_delay
from torchtitan_speechlm.python_api.espnet_model import (
    espnet_model_parts,
    is_espnet_model,
    save_espnet_backbone,
)
from torchtitan_speechlm.python_api.wandb_run import RunLogger, current_run
from torchtitan_speechlm.trainer.trainer import SpeechLMTrainer
from torchtitan_speechlm.utils import upstream
from torchtitan_speechlm.utils.upstream import logger

BACKBONE_DIR = "backbone"


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def use_single_process_env() -> None:
    """Outside torchrun (no RANK): this process is rank 0 of 1, as ``torchtitan train``."""
    import torch.distributed as dist

    if "RANK" in os.environ or (dist.is_available() and dist.is_initialized()):
        os.environ.setdefault("LOCAL_RANK", "0")
        return
    set_single_process_env()


def backbone_folder(model: Any, output_dir: Path, timeout_s: float = 600.0) -> str:
    """A folder holding the backbone: ``model`` itself if it is one, else the transformers
    model object (or the text LM inside ESPnet's model object, espnet_model.py) saved (once,
    by rank 0) to ``output_dir/backbone``; other ranks wait for it."""
    if isinstance(model, (str, os.PathLike)):
        path = Path(model)
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"model = {str(model)!r}: not a transformers model folder (no config.json); "
                "pass a causal-LM object or a folder saved with save_pretrained"
            )
        return str(path.resolve())
    espnet = is_espnet_model(model)
    if not espnet and not callable(getattr(model, "save_pretrained", None)):
        raise ConfigError(
            f"model: expected a transformers causal-LM object (with save_pretrained) or a "
            f"model folder, got {type(model).__name__}"
        )
    target = (output_dir / BACKBONE_DIR).resolve()
    done = target / "config.json"
    import torch.distributed as dist

    dist_up = dist.is_available() and dist.is_initialized()
    if _rank() == 0 and not done.is_file():
        tmp = target.with_name(f".{BACKBONE_DIR}.tmp{os.getpid()}")
        if espnet:
            save_espnet_backbone(model, str(tmp))
        else:
            model.save_pretrained(str(tmp))
        os.replace(tmp, target)  # atomic: config.json appears with the weights
    if dist_up:
        dist.barrier()
    deadline = time.monotonic() + timeout_s
    while not done.is_file():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {_rank()}: rank 0 did not save the backbone to {target}")
        time.sleep(0.2)
    return str(target)


def resume_sections(resume_path: Any, output_dir: Path, sections: dict) -> dict:
    """``resume_path`` in torchtitan's keys: a step of this run (``checkpoint.load_step``),
    another run's checkpoint (``initial_load_path``, full state), or a ``.pt`` state dict
    (weights only, ``speechlm.init_from``, as ESPnet treats a file). None: the newest
    checkpoint in ``output_dir``, torchtitan's default."""
    if resume_path is None:
        return {}
    path = Path(resume_path).resolve()
    if path.is_file():
        return {"speechlm": {"init_from": str(path)}}
    if not (path / ".metadata").is_file():
        raise ConfigError(
            f"resume_path = {str(resume_path)!r} is not a complete DCP checkpoint (no .metadata) "
            "nor a .pt file"
        )
    folder = (output_dir / sections["checkpoint"].get("folder", "checkpoint")).resolve()
    if path.parent == folder and path.name.startswith("step-"):
        return {"checkpoint": {"load_step": int(path.name.split("-", 1)[1])}}
    if folder.is_dir() and any(p.name.startswith("step-") for p in folder.iterdir()):
        raise ConfigError(
            f"resume_path {path} is another run's checkpoint, but {folder} already holds "
            "checkpoints, which torchtitan would load instead; use a fresh output_dir to "
            "continue from resume_path, or resume_path=None to continue this run"
        )
    return {"checkpoint": {"initial_load_path": str(path), "initial_load_model_only": False}}


def espnet_resume(resume_path: Any, output_dir: Path, folder: str) -> EspnetCheckpoint | None:
    """The ESPnet checkpoint to continue from (espnet_checkpoint.py), or None: ``resume_path``
    if it is one, or with no ``resume_path`` the newest of ``output_dir/checkpoints`` (ESPnet's
    own rule), unless this run already has checkpoints of its own (``output_dir/folder``),
    which then win (it continued the ESPnet one before)."""
    ours = output_dir / folder
    if ours.is_dir() and any(p.name.startswith("step-") for p in ours.iterdir()):
        if resume_path is not None and is_espnet_checkpoint(str(resume_path)):
            logger.info(
                f"{ours} has checkpoints of this run: continuing from its newest, not from "
                f"resume_path {resume_path} (continued before)"
            )
        return None
    if resume_path is not None:
        return (
            EspnetCheckpoint(str(resume_path)) if is_espnet_checkpoint(str(resume_path)) else None
        )
    steps = espnet_steps(str(output_dir))
    return (
        EspnetCheckpoint(str(output_dir / "checkpoints" / f"step_{steps[-1]}")) if steps else None
    )


def check_espnet_resume(ckpt: EspnetCheckpoint, plan, sections: dict) -> None:
    """An ESPnet checkpoint continues only with ESPnet's data (its vocabulary), and only a
    model of its shape (``EspnetCheckpoint.check``)."""
    if not isinstance(plan.external, EspnetRunData):
        raise ConfigError(
            f"resume_path {ckpt.path} is an ESPnet checkpoint: its token ids are ESPnet's, so it "
            "continues with ESPnet's data factories (and its model object or vocab_intervals)"
        )
    import json

    backbone = sections["model"]["hf_assets_path"]
    with open(os.path.join(backbone, "config.json")) as f:
        config = json.load(f)
    tie = sections["speechlm"].get("tie_embeddings", "auto")
    tied = bool(config.get("tie_word_embeddings", False)) if tie == "auto" else tie == "true"
    ckpt.check(plan.external.train.vocab, config, tied)


def run_sections(trainer_args: dict, plan, model: Any, resume_path: Any, output_dir: Path) -> dict:
    """The run's TOML sections (ESPnet's keys mapped, the data, the resume point, the saved
    backbone), checked before anything is written; written to ``output_dir`` by rank 0."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # the mapping is checked before anything is written or saved
    sections = trainer_args_to_sections(
        trainer_args, output_dir=str(output_dir), backbone_path="(set below)", world_size=world
    )
    data_section = dict(plan.speechlm_data)
    if plan.external is not None:
        sections["speechlm"].setdefault("sample_every", 0)  # samples read prepared data
        has_valid = bool(plan.external.valid_names())
        if isinstance(plan.external, EspnetRunData):  # the layout ESPnet's data has
            sections["speechlm"].setdefault("chat_template", "espnet")
            delay = io_delay(plan.external.train.audio_io)
            if delay is not None:
                sections["speechlm"].setdefault("pattern", "delay" if delay else "parallel")
    else:
        has_valid = bool(data_section.get("valid"))
    sections = merge(sections, {"speechlm_data": data_section})
    sections["validation"].setdefault("enable", has_valid)
    if is_espnet_model(model):  # ESPnet's model has its own embedding and head, never tied
        sections["speechlm"].setdefault("tie_embeddings", "false")
    if not (resume_path is not None and is_espnet_checkpoint(str(resume_path))):
        sections = merge(sections, resume_sections(resume_path, output_dir, sections))
    check_sections(sections, source="trainer_args")
    output_dir.mkdir(parents=True, exist_ok=True)
    sections["model"]["hf_assets_path"] = backbone_folder(model, output_dir)
    if _rank() == 0:
        path = str(output_dir / TOML_NAME)
        header = (
            "Written by torchtitan_speechlm.TitanTrainer; repeat the run with\n"
            f"torchtitan train --job.config_file {path}"
            + (
                "\n(the training data came from a Python object: EspnetData)"
                if plan.external
                else ""
            )
        )
        write_toml(path, sections, header)
    return sections


class ChunkedTrainer(SpeechLMTrainer):
    """Our trainer (torchtitan's, with the run handed to the spec) with an existing
    ParallelDims, a stop step and one data iterator for every call of ``train()``; its loop
    is not copied."""

    def __init__(self, job_config, parallel_dims=None, external=None):
        self._given_dims = parallel_dims
        self._stop_at: int | None = None
        self._iterator = None
        super().__init__(job_config, external)

    def init_distributed(self):
        dims = self._given_dims
        if dims is None:
            return super().init_distributed()
        p = self.job_config.parallelism
        want = {
            "dp_replicate": p.data_parallel_replicate_degree,
            "dp_shard": p.data_parallel_shard_degree,
            "tp": p.tensor_parallel_degree,
            "pp": p.pipeline_parallel_degree,
            "cp": p.context_parallel_degree,
        }
        for name, value in want.items():
            if value > 0 and getattr(dims, name) != value:
                raise ConfigError(
                    f"parallel_dims.{name} = {getattr(dims, name)} but the config asks for "
                    f"{value}; make titan_config / [parallelism] match the ParallelDims"
                )
        return self.beating(dims)

    def should_continue_training(self) -> bool:
        return super().should_continue_training() and (
            self._stop_at is None or self.step < self._stop_at
        )

    def batch_generator(self, data_iterable):
        if self._iterator is None:  # one iterator across chunks: no batch lost or repeated
            self._iterator = super().batch_generator(data_iterable)
        return self._iterator

    def train_until(self, stop_at: int | None, validate: bool = True) -> None:
        """torchtitan's ``train()`` up to ``stop_at`` (None: ``training.steps``); the
        checkpoint was loaded once already, so its load is skipped here."""
        validation = self.job_config.validation
        enabled = validation.enable
        self._stop_at = stop_at
        self.checkpointer.load = lambda step=-1: False  # instance attribute: this call only
        validation.enable = enabled and validate
        try:
            super().train()
        finally:
            del self.checkpointer.load
            validation.enable = enabled
            self._stop_at = None


class TitanTrainer:
    """ESPnet SpeechLM's ``TitanTrainer`` API over torchtitan's Trainer (docs/python-api.md).

    Args:
        train_data_factory: ``PreparedData``, ``"TASK:NAME[:WEIGHT]"`` specs (a list or one
            space-separated string), or an ESPnet factory wrapped in ``EspnetData``.
        valid_data_factories: ``{name: PreparedData | "TASK:NAME" | ESPnet factory}``; logged
            as ``val/{name}/{key}``.
        model: a transformers causal-LM object (saved once to ``output_dir/backbone``) or a
            model folder: the backbone.
        resume_path: a checkpoint folder (``step-N``) to continue from, a ``.pt`` state dict
            (weights only), or None (the newest checkpoint in ``output_dir``).
        output_dir: the run folder (torchtitan's ``job.dump_folder``).
        trainer_args: ESPnet's keys (max_step, log_interval, save_interval, freeze_param,
            titan_config, ...) and any TOML section as a dict (``training``, ``speechlm``,
            ``speechlm_data``, ``validation``, ...).
        parallel_dims: an existing torchtitan ParallelDims, used instead of building one.
    """

    count_normalized_keys = [
        "loss",
        "ce_loss",
        "z_loss",
        "z_loss_s0",
        "z_loss_mm",
        "load_balance_loss",
        "acc_layer0",
    ]

    def __init__(
        self,
        train_data_factory: Any,
        valid_data_factories: Mapping[str, Any] | None,
        model: Any,
        resume_path: str | os.PathLike | None,
        output_dir: str | os.PathLike,
        trainer_args: Mapping[str, Any],
        parallel_dims: Any = None,
    ):
        self.output_dir = Path(output_dir).resolve()
        self.trainer_args = dict(trainer_args)
        use_single_process_env()
        if not logging.getLogger().handlers:  # torchtitan's console log, unless the caller has one
            upstream.init_logger()
        espnet = espnet_model_parts(model) if is_espnet_model(model) else None
        plan = resolve_data(train_data_factory, valid_data_factories, self.trainer_args, espnet)
        sections = run_sections(self.trainer_args, plan, model, resume_path, self.output_dir)
        folder = sections["checkpoint"].get("folder", "checkpoint")
        espnet_ckpt = espnet_resume(resume_path, self.output_dir, folder)
        if espnet_ckpt is not None:
            check_espnet_resume(espnet_ckpt, plan, sections)
        self.config_path = str(self.output_dir / TOML_NAME)
        self.sections = sections
        self.job_config = self._parse(sections, plan.external)
        self._wandb_run = self._choose_wandb()
        import torch.distributed as dist

        # torchtitan's Trainer creates the process group only when none exists: release it at
        # close() only then, never a group the caller made
        self._owns_process_group = parallel_dims is None and not dist.is_initialized()
        self.trainer = ChunkedTrainer(self.job_config, parallel_dims, plan.external)
        self._attach_wandb()
        if espnet_ckpt is not None:
            load_espnet_checkpoint(
                self.trainer, espnet_ckpt, plan.external.train.vocab, self.trainer.run.plan.layout
            )
        else:
            self.trainer.checkpointer.load(step=self.job_config.checkpoint.load_step)
        self._closed = False

    # ---- construction helpers -------------------------------------------------------------
    def _parse(self, sections: dict, external: Any):
        """The JobConfig of the written TOML, with ``torchtitan train``'s checks."""
        import tempfile

        # every rank parses its own copy (rank 0's file may not be visible yet)
        with tempfile.TemporaryDirectory() as tmp:
            path = write_toml(os.path.join(tmp, TOML_NAME), sections)
            try:
                return check_config(torchtitan_args(["--job.config_file", path]), external)
            except ConfigError as e:  # its one line, not the checks' call stack
                raise ConfigError(str(e)) from None

    def _choose_wandb(self):
        run = current_run()
        if run is not None and self.job_config.metrics.enable_wandb:
            self.job_config.metrics.enable_wandb = False  # log into the caller's run instead
            return run
        return None

    def _attach_wandb(self) -> None:
        if self._wandb_run is None or _rank() != 0:
            return

        self.trainer.metrics_processor.logger.add_logger(RunLogger(self._wandb_run))

    # ---- ESPnet's API -----------------------------------------------------------------------
    @property
    def max_step(self) -> int:
        """The last optimizer step: ``training.steps`` of the run's config (ESPnet's
        ``max_step``, or a ``training`` section that overrides it)."""
        return self.job_config.training.steps

    @property
    def save_interval(self) -> int:
        """Steps per ``train()`` chunk and between saves: ``checkpoint.interval``."""
        return self.job_config.checkpoint.interval

    @property
    def global_step(self) -> int:
        """Optimizer steps done (torchtitan's ``Trainer.step``)."""
        return self.trainer.step

    def run(self) -> None:
        """Train to ``max_step``: torchtitan's own loop, validating and saving every
        ``save_interval`` steps, exactly as ``torchtitan train`` with the written TOML; then
        close the loggers and the checkpointer."""
        self.trainer.train_until(None)
        self.close()

    def train(self) -> None:
        """Train ``save_interval`` optimizer steps (fewer at ``max_step``) and save."""
        if self.global_step >= self.max_step:
            return
        self.trainer.train_until(self.global_step + self.save_interval, validate=False)
        self.trainer.save_now()

    def valid(self) -> None:
        """Validate on every set, logged as ``val/{name}/{key}`` at the current step."""
        if self.job_config.validation.enable:
            self.trainer.validator.validate(self.trainer.model_parts, self.global_step)

    def close(self) -> None:
        """Flush the loggers, finish checkpoint writes, and release the process group if this
        trainer created it (as torchtitan's ``main`` does). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.trainer.close()
        import torch.distributed as dist

        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
