"""What a SpeechLM run is made of, resolved once per process from the job config.

torchtitan's Trainer hands each of our builders (model args, data loader, loss, metrics,
validator) only the job config. Instead of each re-reading the backbone config, the datasets'
metadata and the mixture, they all ask ``run_context(job_config)``, which validates the config
and builds this once (memoised on the job config object).
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.tools.logging import logger

from torchtitan_speechlm.config import (
    ConfigError,
    MixEntry,
    parse_datasets,
    parse_mix,
    read_dataset_metadata,
)
from torchtitan_speechlm.data.external import external_data
from torchtitan_speechlm.model.backbones import Backbone
from torchtitan_speechlm.model.vocab import VocabLayout

_ATTR = "_speechlm_run_context"


@dataclass
class RunContext:
    family: Backbone  # the backbone family of the chosen spec flavor
    backbone_path: str  # model.hf_assets_path
    backbone_config: dict
    datasets: dict[str, str]  # name -> prepared dataset path
    metadata: dict[str, dict]  # name -> its metadata.json
    train: list[MixEntry]
    valid: dict[str, tuple[list[MixEntry], str]]  # set name -> (entries, split to read)
    layout: VocabLayout

    @property
    def codec(self) -> dict:
        """The codec every dataset was prepared with (checked to be the same)."""
        return next(iter(self.metadata.values()))["codec"]

    @property
    def num_streams(self) -> int:
        return int(self.codec["num_streams"])

    @property
    def frame_rate(self) -> float:
        return float(self.codec["frame_rate"])


def run_context(job_config) -> RunContext:
    ctx = getattr(job_config, _ATTR, None)
    if ctx is None:
        ctx = _build(job_config)
        object.__setattr__(job_config, _ATTR, ctx)
    return ctx


def _build(job_config) -> RunContext:
    from torchtitan_speechlm.dataset_format import check_compatible
    from torchtitan_speechlm.spec import backbone_of

    family = backbone_of(job_config)
    path = job_config.model.hf_assets_path
    try:
        backbone_config = family.read_config(path)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    external = external_data(job_config)
    if external is not None:
        return _external_context(job_config, family, path, backbone_config, external)
    data = job_config.speechlm_data
    datasets = parse_datasets(data.datasets)
    train = parse_mix(data.train, "train", datasets)
    if not train:
        raise ConfigError("speechlm_data.train is empty: list at least one TASK:NAME entry")
    metadata = {name: read_dataset_metadata(p) for name, p in datasets.items()}
    first = next(iter(metadata))
    for name, meta in metadata.items():
        try:
            check_compatible(metadata[first], meta)
        except ValueError as e:
            raise ConfigError(
                f"datasets {first!r} and {name!r} cannot be mixed: {e}; prepare all of them "
                "with the same codec (and --num-streams) and tokenizer."
            ) from None
    text = family.text_vocab_size(backbone_config)
    for name, meta in metadata.items():
        tv = int(meta["tokenizer"]["vocab_size"])
        if tv > text:
            raise ConfigError(
                f"dataset {name!r} was tokenised with {tv} text tokens but the backbone "
                f"{path!r} has only {text} embedding rows; prepare it with the "
                "backbone's tokenizer."
            )
    codec = metadata[first]["codec"]
    layout = VocabLayout(
        text_size=text,
        num_streams=int(codec["num_streams"]),
        codebook_size=int(codec["codebook_size"]),
    )
    return RunContext(
        family,
        path,
        backbone_config,
        datasets,
        metadata,
        train,
        _validation_sets(data, datasets, train),
        layout,
    )


def _external_context(job_config, family, path, backbone_config, external) -> RunContext:
    """Data from a Python object (data/external.py): the layout comes from its codec, the
    validation sets are its named sets, and there are no prepared datasets or mixture."""
    if job_config.speechlm_data.datasets or job_config.speechlm_data.train:
        raise ConfigError(
            "the training data comes from a Python data object, so speechlm_data.datasets and "
            "speechlm_data.train must be empty (they would be ignored)"
        )
    codec = dict(external.codec)
    text = family.text_vocab_size(backbone_config)
    layout = VocabLayout(
        text_size=text,
        num_streams=int(codec["num_streams"]),
        codebook_size=int(codec["codebook_size"]),
    )
    metadata = {"external": {"codec": codec, "tokenizer": {"vocab_size": text}}}
    valid = {name: ([], "external") for name in external.valid_names()}
    return RunContext(family, path, backbone_config, {}, metadata, [], valid, layout)


def _validation_sets(data, datasets: dict, train: list[MixEntry]) -> dict:
    """Explicit ``valid`` entries: a dataset that training also uses is validated on its
    held-out part when ``valid_fraction`` > 0 (never on items training sees); with no hold-out
    it is validated on all its items, with a warning. A dataset training does not use: all
    items. No ``valid`` entries: every training entry on its held-out part."""
    if not data.valid:
        if data.valid_fraction > 0:
            return {f"{e.task}_{e.dataset}_heldout": ([e], "valid") for e in train}
        return {}
    trained = {e.dataset for e in train}
    sets = {}
    for spec in data.valid:
        name, eq, rest = spec.partition("=")
        if not eq or ":" in name:
            name, rest = "", spec
        (e,) = parse_mix([rest], "valid", datasets)
        name = name or f"{e.task}_{e.dataset}"
        if name in sets:
            raise ConfigError(
                f"speechlm_data.valid names the set {name!r} twice; name them apart with "
                "SET=TASK:NAME entries"
            )
        split = "all"
        if e.dataset in trained:
            if data.valid_fraction > 0:
                split = "valid"
            else:
                logger.warning(
                    f"validation set {e.task}:{e.dataset} is also training data (valid_fraction "
                    "= 0): its numbers measure fit, not generalisation; set "
                    "speechlm_data.valid_fraction > 0 to validate on held-out items"
                )
        sets[name] = ([e], split)
    return sets
