"""An ESPnet SpeechLM checkpoint (``OUTPUT/checkpoints/step_N``) continued by our trainer.

ESPnet's TitanTrainer saves ``dcp.save({"model": get_model_state_dict(model), "optimizer":
get_optimizer_state_dict(model, opt), "lr_scheduler": ..., "global_step": N})``: its model's
names (``model.embed_tokens.weight``, ``model.layers.*``, ``model.norm.weight``,
``lm_head.weight``, ``stream_emb.weight``, and its ios' and adaptors' own), AdamW's
``exp_avg`` / ``exp_avg_sq`` / ``step`` per parameter, reshardable (any number of ranks).
Here, after torchtitan built the model and optimizer (ours: ``tok_embeddings``,
``backbone.*``, ``head.output``, ``head.stream_emb``):

- every backbone tensor, and its Adam moments and step, is read by DCP straight into our
  (sharded) parameter and optimizer state under ESPnet's name;
- the embedding and head (and their moments) are read whole and their rows moved from ESPnet's
  ids to ours (espnet_vocab.py); our rows ESPnet has no id for (specials beyond its nine,
  ``<|cfg_drop|>``, reserved) keep their initial values and a fresh Adam state;
- the step becomes the trainer's step, the LR schedule continues from it, and the data position
  is where ESPnet would go on: its next ``build_iter(global_step=N, ...)`` chunk.

Before any of that is built, ``EspnetCheckpoint.check`` compares the checkpoint with the run
(the vocabulary's size, the backbone's width and depth, a tied head, what our model lacks) and
refuses with one line naming what differs.
"""

from __future__ import annotations

import os
import re

import torch

from torchtitan_speechlm.components.optim import apply_factors
from torchtitan_speechlm.config import ConfigError
from torchtitan_speechlm.python_api.espnet_vocab import EspnetVocab
from torchtitan_speechlm.utils.upstream import logger

STEP_FOLDER = re.compile(r"^step_(\d+)$")
ROW_PARAMS = {"tok_embeddings.weight": "model.embed_tokens.weight",
              "head.output.weight": "lm_head.weight"}  # fmt: skip
IGNORED = ("multimodal_io_dict.",)  # the ios' own weights (the codec): not trained, not ours
WEIGHTS_ONLY = (
    "to start from its weights alone, export them with ESPnet's bin/export_checkpoint.py and "
    "pass the .pt file as resume_path"
)


def espnet_name(ours: str) -> str | None:
    """ESPnet's name of our parameter (None: ESPnet's model has none)."""
    if ours in ROW_PARAMS:
        return ROW_PARAMS[ours]
    if ours == "head.stream_emb.weight":
        return "stream_emb.weight"
    if ours.startswith("backbone."):
        return "model." + ours[len("backbone.") :]
    return None


def espnet_steps(output_dir: str) -> list[int]:
    """Steps of ESPnet checkpoints in ``output_dir/checkpoints`` (complete: with .metadata)."""
    folder = os.path.join(output_dir, "checkpoints")
    if not os.path.isdir(folder):
        return []
    steps = []
    for name in os.listdir(folder):
        m = STEP_FOLDER.match(name)
        if m and os.path.isfile(os.path.join(folder, name, ".metadata")):
            steps.append(int(m.group(1)))
    return sorted(steps)


def is_espnet_checkpoint(path: str) -> bool:
    """A DCP folder written by ESPnet's TitanTrainer (a ``global_step`` entry, ``model.*``)."""
    if not os.path.isfile(os.path.join(path, ".metadata")):
        return False
    keys = _metadata(path).state_dict_metadata
    return "global_step" in keys and any(k.startswith("model.") for k in keys)


def _metadata(path: str):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(path).read_metadata()


class EspnetCheckpoint:
    """One ESPnet step folder, its tensors' shapes read from the DCP metadata."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        meta = _metadata(self.path).state_dict_metadata
        self.shapes = {
            k[len("model.") :]: tuple(v.size)
            for k, v in meta.items()
            if k.startswith("model.") and hasattr(v, "size")
        }
        self.has_optimizer = any(k.startswith("optimizer.state.") for k in meta)

    def check(self, vocab: EspnetVocab, backbone_config: dict, tied: bool) -> None:
        """Refuse (one line, naming what differs) a checkpoint this run cannot continue."""
        where = f"resume_path {self.path} (an ESPnet checkpoint)"
        embed = self.shapes.get("model.embed_tokens.weight")
        if embed is None or "lm_head.weight" not in self.shapes:
            raise ConfigError(
                f"{where} has no model.embed_tokens / lm_head weights (its keys start "
                f"{sorted(self.shapes)[:3]}); {WEIGHTS_ONLY}"
            )
        if embed[0] != vocab.size:
            raise ConfigError(
                f"{where} was trained with a vocabulary of {embed[0]} ids, the run's ESPnet "
                f"vocab_intervals have {vocab.size}: use the job template (ios, tokenizer, "
                f"codec) it was trained with; {WEIGHTS_ONLY}"
            )
        width = int(backbone_config.get("hidden_size", embed[1]))
        layers = {int(k.split(".")[2]) for k in self.shapes if k.startswith("model.layers.")}
        depth = int(backbone_config.get("num_hidden_layers", len(layers)))
        if embed[1] != width or len(layers) != depth:
            raise ConfigError(
                f"{where} has a backbone {embed[1]} wide with {len(layers)} layers, the run's "
                f"{width} wide with {depth}: pass the backbone it was trained from as model"
            )
        adaptors = sorted({k.split(".")[1] for k in self.shapes if k.startswith("adaptor.")})
        if adaptors:
            raise ConfigError(
                f"{where} holds adaptors of the continuous ios {adaptors} (ESPnet's projections "
                f"of its own audio encoder), which this trainer has no place for; {WEIGHTS_ONLY}"
            )
        if tied:
            raise ConfigError(
                f"{where} has separate embedding and head weights, the run ties them: set "
                "trainer_args['speechlm']['tie_embeddings'] = 'false'"
            )

    def names(self, ours: list[str]) -> dict[str, str]:
        """Our parameter names -> ESPnet's; refuses what ESPnet's model lacks or has beyond."""
        mapped = {n: espnet_name(n) for n in ours}
        missing = sorted(n for n, e in mapped.items() if e is None or e not in self.shapes)
        extra = sorted(
            e
            for e in set(self.shapes) - set(mapped.values())
            if not e.startswith(IGNORED) and not e.endswith("rotary_emb.inv_freq")
        )
        if missing or extra:
            raise ConfigError(
                f"resume_path {self.path} (an ESPnet checkpoint) does not hold our parameters "
                f"{missing[:4]} or holds ones we lack {extra[:4]}; {WEIGHTS_ONLY}"
            )
        return mapped


def load_espnet_checkpoint(trainer, ckpt: EspnetCheckpoint, vocab: EspnetVocab, layout) -> int:
    """Continue ``trainer`` (torchtitan's, built) from ``ckpt``: weights, Adam state, step,
    LR schedule and ESPnet data position (the module docstring). Returns the step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if len(trainer.model_parts) != 1:
        raise ConfigError("an ESPnet checkpoint continues without pipeline parallelism only")
    model, opt = trainer.model_parts[0], trainer.optimizers.optimizers[0]
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    msd = get_model_state_dict(model)
    osd = get_optimizer_state_dict(model, opt, options=flat)  # Adam's state made, then filled
    names = ckpt.names(list(msd))
    source, whole = {"global_step": 0}, {}
    for ours, theirs in names.items():
        for key, value, prefix in _pairs(ours, theirs, msd, osd):
            if ours in ROW_PARAMS and not key.endswith(".step"):  # read whole, rows moved below
                whole[key] = torch.empty(ckpt.shapes[theirs][:1] + value.shape[1:],
                                         dtype=value.dtype)  # fmt: skip
                source[prefix] = whole[key]
            else:
                source[prefix] = value  # read straight into our (sharded) tensor
    dcp.load(source, checkpoint_id=ckpt.path)
    lut = vocab.lookup(layout)
    have = torch.nonzero(lut >= 0).flatten()
    for key, theirs in whole.items():
        target = msd if key in msd else osd
        value = target[key]
        full = value.full_tensor() if hasattr(value, "full_tensor") else value.detach()
        full = full.clone()
        if key not in msd:  # a fresh Adam state for the rows ESPnet has no id for
            full.zero_()
        full[lut[have]] = theirs[have].to(full.dtype)
        target[key] = _like(full, value)
    set_model_state_dict(model, msd)
    set_optimizer_state_dict(model, opt, optim_state_dict=osd, options=flat)
    step = int(source["global_step"])
    trainer.step = step
    for scheduler in trainer.lr_schedulers.schedulers:
        scheduler.last_epoch, scheduler._step_count = step, step + 1
        apply_factors(scheduler)
    loader = trainer.dataloader
    if hasattr(loader, "chunk_start"):  # ESPnet's next chunk: build_iter(global_step=N)
        loader.chunk_start, loader.offset = step, 0
    logger.info(
        f"Continued from ESPnet's checkpoint {ckpt.path}: step {step}, "
        f"{len(names)} parameters with their Adam state, lr {opt.param_groups[0]['lr']:.3g}, "
        f"data from build_iter(global_step={step})"
    )
    return step


def _pairs(ours: str, theirs: str, msd: dict, osd: dict):
    """(our key, our tensor, ESPnet's DCP key) of a parameter and of its Adam state."""
    yield ours, msd[ours], f"model.{theirs}"
    for part in ("exp_avg", "exp_avg_sq", "step"):
        key = f"state.{ours}.{part}"
        if key in osd:
            yield key, osd[key], f"optimizer.state.{theirs}.{part}"


def _like(full: torch.Tensor, like) -> torch.Tensor:
    """``full`` laid out as ``like`` (a DTensor's shards, or a plain tensor)."""
    if hasattr(like, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(full.to(like.device), like.device_mesh, like.placements)
    return full.to(like.device)
