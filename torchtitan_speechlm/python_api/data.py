"""The Python API's data factories -> ``[speechlm_data]`` entries, or an external data object.

ESPnet passes a training factory and a dict of validation factories. Ours are either

- prepared datasets and a task mixture (``PreparedData``, or ``"TASK:NAME[:WEIGHT]"`` specs
  whose NAMEs are listed in ``trainer_args["speechlm_data"]["datasets"]``): they become
  ``speechlm_data.datasets / train / valid`` in the written TOML, so the CLI repeats the run;
  a validation set is logged under its dict key (``SET=TASK:NAME``);
- ESPnet ``DataIteratorFactory`` objects wrapped in ``EspnetData`` (espnet_data.py): a live
  Python object no TOML can name, handed to the trainer (data/external.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torchtitan_speechlm.config import ConfigError
from torchtitan_speechlm.data.catalog import parse_datasets
from torchtitan_speechlm.python_api.espnet_data import EspnetData, EspnetRunData


@dataclass
class PreparedData:
    """Prepared datasets (folders made by ``torchtitan prepare``) and a task mixture over them.

    ``mixture`` entries are ``TASK:NAME[:WEIGHT]`` (TASK a registered task: tts, asr,
    continuation, text, dialogue, ...; NAME a key of ``datasets``). As a validation factory it
    holds one entry (no weight)."""

    datasets: dict[str, str]
    mixture: list[str] = field(default_factory=list)


@dataclass
class DataPlan:
    """What the factories resolved to: TOML entries, or an external data object."""

    speechlm_data: dict[str, list[str]]
    external: Any = None


def _specs(value: Any, what: str) -> list[str]:
    if isinstance(value, str):
        return value.split()  # ESPnet's space-separated specifier strings
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ConfigError(
        f"{what}: expected PreparedData, 'TASK:NAME[:WEIGHT]' specs or an ESPnet factory "
        f"wrapped in EspnetData, got {type(value).__name__}"
    )


def _is_espnet_factory(obj: Any) -> bool:
    return callable(getattr(obj, "build_iter", None))


def resolve_data(
    train_data_factory: Any,
    valid_data_factories: Mapping[str, Any] | None,
    trainer_args: Mapping,
    espnet: tuple[dict, dict] | None = None,
) -> DataPlan:
    """The factories as TOML entries or an external data object. ``espnet``: the vocabulary
    and ios of the ESPnet model object passed as ``model`` (espnet_model.py): bare ESPnet
    factories are then wrapped with them, as ESPnet's own trainer reads them from its model."""
    valid = dict(valid_data_factories or {})
    if espnet is not None and _is_espnet_factory(train_data_factory):
        if not isinstance(train_data_factory, EspnetData):
            intervals, ios = espnet
            train_data_factory = EspnetData(train_data_factory, intervals, multimodal_io=ios)
    elif espnet is not None:
        raise ConfigError(
            "model is an ESPnet model object but train_data_factory is not an ESPnet factory: "
            "pass its DataIteratorFactory (or pass a backbone folder as model)"
        )
    if _is_espnet_factory(train_data_factory) and not isinstance(train_data_factory, EspnetData):
        raise ConfigError(
            "train_data_factory is an ESPnet DataIteratorFactory: its token ids are in ESPnet's "
            "vocabulary, so pass ESPnet's model object as `model` (job_template.build_model()) "
            "or wrap it to say which: EspnetData(factory, "
            "vocab_intervals=job_template.vocab_intervals, "
            "multimodal_io=job_template.multimodal_io) (docs/python-api.md)"
        )
    if isinstance(train_data_factory, EspnetData):
        sets = {}
        for name, f in valid.items():
            if isinstance(f, EspnetData):
                sets[name] = f
            elif _is_espnet_factory(f):  # same vocabulary as the training data
                sets[name] = train_data_factory.like(f)
            else:
                raise ConfigError(
                    f"valid_data_factories[{name!r}]: with an ESPnet training factory every "
                    "validation factory must be an ESPnet factory (or EspnetData) too"
                )
        return DataPlan({}, EspnetRunData(train_data_factory, sets))

    given = (trainer_args.get("speechlm_data") or {}).get("datasets", [])
    datasets = parse_datasets(list(given))

    def add(ds: Mapping[str, str], what: str) -> None:
        for name, path in ds.items():
            if datasets.get(name, path) != path:
                raise ConfigError(
                    f"{what}: dataset {name!r} is {path!r} here but {datasets[name]!r} "
                    "elsewhere; give each prepared folder one name"
                )
            datasets[name] = str(path)

    if isinstance(train_data_factory, PreparedData):
        add(train_data_factory.datasets, "train_data_factory")
        train = list(train_data_factory.mixture)
    else:
        train = _specs(train_data_factory, "train_data_factory")
    entries = []
    for name, f in valid.items():
        if isinstance(f, PreparedData):
            add(f.datasets, f"valid_data_factories[{name!r}]")
            specs = list(f.mixture)
        elif _is_espnet_factory(f):
            raise ConfigError(
                f"valid_data_factories[{name!r}] is an ESPnet factory but the training data is "
                "prepared data; use one kind for both"
            )
        else:
            specs = _specs(f, f"valid_data_factories[{name!r}]")
        if len(specs) != 1:
            raise ConfigError(
                f"valid_data_factories[{name!r}]: a validation set is one TASK:NAME entry, got "
                f"{specs}"
            )
        if "=" in name or ":" in name or "/" in name:
            raise ConfigError(f"validation set name {name!r} must not contain '=', ':' or '/'")
        entries.append(f"{name}={specs[0]}")
    return DataPlan(
        {
            "datasets": [f"{name}={path}" for name, path in datasets.items()],
            "train": train,
            "valid": entries,
        }
    )
