"""ESPnet's ``trainer_args`` dict -> the sections of a torchtitan TOML (JobConfig + ours).

The Python API never configures torchtitan behind the TOML's back: everything a run needs is
turned into one dict of TOML sections here, written to ``output_dir`` and parsed by torchtitan's
own ConfigManager, so ``torchtitan train --job.config_file OUTPUT_DIR/titan_trainer.toml``
repeats the run. ESPnet's keys keep ESPnet's defaults (bf16 parameters, fp32 reduce, clipping
at 1.0, AdamW 1e-4 with betas 0.9/0.95, warmup -> cosine -> constant floor); any of our or
torchtitan's sections can be given as a nested dict and wins over the mapped values. A key that
is neither is an error listing the known ones (docs/python-api.md has the whole table).
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from torchtitan_speechlm.config import ConfigError, check_toml
from torchtitan_speechlm.distributed.batch import data_parallel_degree
from torchtitan_speechlm.trainer.plan import REGISTERED_VALUES
from torchtitan_speechlm.utils import upstream
from torchtitan_speechlm.utils.compat import accelerator_available
from torchtitan_speechlm.utils.fileio import write_text_atomic
from torchtitan_speechlm.utils.upstream import (
    ParallelismConfig,
    TrainingConfig,
)

CONFIG_MODULE = "torchtitan_speechlm.config"
TOML_NAME = "titan_trainer.toml"

# ESPnet TitanTrainer's documented keys, plus those its source also reads
ESPNET_KEYS = (
    "max_step",
    "log_interval",
    "save_interval",
    "freeze_param",
    "titan_config",
    "gradient_accumulation_steps",
    "model_init",
    "model_init_std",
    "optimizer",
    "lr_scheduler",
)
TITAN_CONFIG_KEYS = (
    "dp_shard",
    "dp_replicate",
    "mixed_precision_param",
    "mixed_precision_reduce",
    "gradient_clipping",
    "optimizer",
    "lr_scheduler",
    "activation_checkpoint",
    "gc_freq",
    "optimizer_storage_dtype",
    "parallel_strategy",
)
ESPNET_OPTIMIZER_DEFAULTS = {"name": "AdamW", "lr": 1e-4, "beta1": 0.9, "beta2": 0.95}
ESPNET_LR_KEYS = ("warmup_steps", "decay_end_step", "min_lr_ratio")
REQUIRED = ("max_step", "save_interval")

# ESPnet parameter names (an HF causal LM with a stream embedding) -> ours (model/model.py)
FREEZE_PREFIXES = (
    ("model.embed_tokens", "tok_embeddings"),
    ("lm_head", "head.output"),
    ("stream_emb", "head.stream_emb"),
    ("model.", "backbone."),
)


def config_class() -> type:
    """torchtitan's JobConfig with our sections merged, as ``torchtitan train`` builds it."""
    return upstream.job_config_class(CONFIG_MODULE)


def section_names() -> list[str]:
    from dataclasses import fields

    return [f.name for f in fields(config_class())]


def _unknown(key: str, known: list[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" Did you mean `{close[0]}`?" if close else ""
    return ConfigError(
        f"trainer_args: unknown key `{where}{key}`.{hint} Known keys: {', '.join(known)} "
        "(ESPnet's, see docs/python-api.md), or a torchtitan / speechlm TOML section as a "
        f"dict: {', '.join(section_names())}."
    )


def map_freeze(prefix: str) -> str:
    """An ESPnet ``freeze_param`` prefix in our parameter names (ours pass unchanged)."""
    for espnet, ours in FREEZE_PREFIXES:
        if prefix == espnet or prefix.startswith(espnet if espnet.endswith(".") else espnet + "."):
            return ours + prefix[len(espnet) :]
    return prefix


def _optimizer(opt: Mapping) -> dict:
    from dataclasses import fields

    known = [f.name for f in fields(upstream.OptimizerConfig)]
    out = dict(ESPNET_OPTIMIZER_DEFAULTS)
    out["implementation"] = "fused" if accelerator_available() else "foreach"
    for key, value in opt.items():
        if key not in known:
            raise _unknown(key, known, "titan_config.optimizer.")
        out[key] = value
    return out


def _lr_scheduler(lr: Mapping, max_step: int) -> dict:
    """ESPnet's warmup from 0 -> cosine -> constant floor, in torchtitan's keys (our scheduler
    starts the warmup at 0 and holds the floor after ``total_steps``, components/optim.py)."""
    lr_section = {f.name: f.type for f in fields(config_class())}["lr_scheduler"]
    known = [f.name for f in fields(lr_section)]
    espnet = {k: lr[k] for k in ESPNET_LR_KEYS if k in lr}
    own = {k: v for k, v in lr.items() if k not in ESPNET_LR_KEYS}
    for key in own:
        if key not in known:
            raise _unknown(key, [*ESPNET_LR_KEYS, *known], "titan_config.lr_scheduler.")
    warmup = int(espnet.get("warmup_steps", 1000))
    end = int(espnet.get("decay_end_step", max_step))
    if end < 1:
        raise ConfigError("trainer_args: lr_scheduler.decay_end_step must be >= 1")
    out = {
        "warmup_steps": warmup,
        "total_steps": end,
        "decay_ratio": max(0, end - warmup) / end,
        "decay_type": "cosine",
        "min_lr_factor": float(espnet.get("min_lr_ratio", 0.0)),
        "warmup_from_zero": True,  # ESPnet's lambda(0) = 0
    }
    out.update(own)
    return out


def _titan_sections(titan: Mapping) -> dict[str, dict]:
    for key in titan:
        if key not in TITAN_CONFIG_KEYS:
            raise _unknown(key, list(TITAN_CONFIG_KEYS), "titan_config.")
    strategy = titan.get("parallel_strategy", "qwen3")
    if strategy != "qwen3":
        raise ConfigError(
            f"trainer_args: titan_config.parallel_strategy = {strategy!r}: there is no per-model "
            "plan to choose here (every backbone is parallelised by distributed/parallelize.py); "
            "remove the key"
        )
    storage = titan.get("optimizer_storage_dtype", "float32")
    ac = titan.get("activation_checkpoint", "none")
    if ac not in ("none", "selective", "full"):
        raise ConfigError(
            f"trainer_args: titan_config.activation_checkpoint = {ac!r}: use none, selective or "
            "full"
        )
    return {
        "training": {
            # bf16 storage (master weights) runs with mixed precision off (trainer/checks.py)
            "mixed_precision_param": titan.get(
                "mixed_precision_param", "bfloat16" if storage == "float32" else "float32"
            ),
            "mixed_precision_reduce": titan.get("mixed_precision_reduce", "float32"),
            "max_norm": float(titan.get("gradient_clipping", 1.0)),
            "dtype": storage,
            **({"gc_freq": int(titan["gc_freq"])} if "gc_freq" in titan else {}),
        },
        "parallelism": {
            "data_parallel_shard_degree": int(titan.get("dp_shard", -1)),
            "data_parallel_replicate_degree": int(titan.get("dp_replicate", 1)),
        },
        "activation_checkpoint": {"mode": ac},
    }


def merge(base: dict, extra: Mapping) -> dict:
    """``extra``'s sections over ``base``'s, key by key (a given key wins)."""
    out = {k: dict(v) for k, v in base.items()}
    for section, values in extra.items():
        out.setdefault(section, {}).update(values)
    return out


def trainer_args_to_sections(
    trainer_args: Mapping[str, Any],
    *,
    output_dir: str,
    backbone_path: str,
    world_size: int = 1,
) -> dict[str, dict]:
    """The TOML sections of a run from ESPnet's ``trainer_args`` (plus any of our sections
    given as dicts). Raises ConfigError naming an unknown or missing key."""
    sections = set(section_names())
    for key in trainer_args:
        if key not in ESPNET_KEYS and key not in sections:
            raise _unknown(key, list(ESPNET_KEYS), "")
        if (
            key in sections
            and key not in ESPNET_KEYS
            and not isinstance(trainer_args[key], Mapping)
        ):
            raise ConfigError(f"trainer_args[{key!r}] is a TOML section: give it as a dict")
    for key in REQUIRED:
        if key not in trainer_args:
            raise ConfigError(f"trainer_args needs `{key}` (ESPnet's required keys: {REQUIRED})")
    max_step, every = int(trainer_args["max_step"]), int(trainer_args["save_interval"])
    if max_step < 1 or every < 1:
        raise ConfigError("trainer_args: max_step and save_interval must be >= 1")
    titan = dict(trainer_args.get("titan_config") or {})
    # ESPnet's source reads optimizer / lr_scheduler at the top level, its docs in titan_config
    opt = {**(trainer_args.get("optimizer") or {}), **(titan.get("optimizer") or {})}
    lr = {**(trainer_args.get("lr_scheduler") or {}), **(titan.get("lr_scheduler") or {})}
    base = {
        "job": {"dump_folder": str(output_dir), "custom_config_module": CONFIG_MODULE},
        "experimental": {"custom_import": "torchtitan_speechlm"},
        "model": {"name": "speechlm", "flavor": "hf", "hf_assets_path": str(backbone_path)},
        "training": {"steps": max_step},
        "checkpoint": {"enable": True, "interval": every, "last_save_model_only": False},
        "metrics": {
            "log_freq": int(trainer_args.get("log_interval", 1)),
            "enable_wandb": True,
            "espnet_keys": True,  # train/lr, train/grad_norm, time/iter beside ours
        },
        "validation": {"freq": every, "steps": -1},
        "optimizer": _optimizer(opt),
        "lr_scheduler": _lr_scheduler(lr, max_step),
        "speechlm": {"freeze": [map_freeze(p) for p in trainer_args.get("freeze_param") or []]},
    }
    base = merge(base, _titan_sections(titan))
    if trainer_args.get("model_init") not in (None, "normal"):
        raise ConfigError(
            f"trainer_args: model_init = {trainer_args['model_init']!r}: only 'normal' (or "
            "leaving it out: the backbone's pretrained weights)"
        )
    if trainer_args.get("model_init") == "normal":
        base["speechlm"]["init"] = "normal"
        base["speechlm"]["init_std"] = float(trainer_args.get("model_init_std", 0.02))
    ours = {k: dict(v) for k, v in trainer_args.items() if k in sections and k not in ESPNET_KEYS}
    out = merge(base, ours)
    accumulation = int(trainer_args.get("gradient_accumulation_steps", 1))
    if accumulation > 1 and "global_batch_size" not in out["training"]:
        out["training"]["global_batch_size"] = global_batch(out, world_size) * accumulation
    return out


def global_batch(sections: dict, world_size: int) -> int:
    """Rows of one optimizer step without accumulation: local batch x data-parallel degree."""
    t, p = sections.get("training", {}), sections.get("parallelism", {})
    local = int(t.get("local_batch_size", TrainingConfig.local_batch_size))
    parallelism = ParallelismConfig(
        **{f.name: p[f.name] for f in fields(ParallelismConfig) if f.name in p}
    )
    return local * max(1, data_parallel_degree(parallelism, world_size))


def check_sections(sections: dict, source: str) -> None:
    """Unknown keys and wrong types, exactly as ``torchtitan train`` checks a TOML."""
    check_toml(sections, config_class(), source=source, registered=REGISTERED_VALUES)


# ---------------------------------------------------------------------------------------------
# TOML writing (values of a JobConfig: strings, numbers, booleans, lists of them)
# ---------------------------------------------------------------------------------------------
def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string is a JSON string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if value is None:
        raise ConfigError("a TOML value cannot be None: leave the key out instead")
    raise ConfigError(f"cannot write {value!r} ({type(value).__name__}) to a TOML file")


def to_toml(sections: dict[str, dict], header: str = "") -> str:
    lines = [f"# {line}" for line in header.splitlines()]
    for name, values in sections.items():
        lines += ["", f"[{name}]"]
        lines += [f"{key} = {_toml_value(v)}" for key, v in values.items() if v is not None]
    return "\n".join(lines) + "\n"


def write_toml(path: str, sections: dict[str, dict], header: str = "") -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    write_text_atomic(path, to_toml(sections, header))
    return path
