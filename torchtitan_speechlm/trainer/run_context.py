"""The resolve step: what a SpeechLM run is made of, resolved once per process from the job config.

torchtitan's Trainer hands each of our builders (model args, data loader, loss, metrics,
validator) only the job config. Instead of each re-reading the backbone config, the datasets'
metadata and the mixture, they all ask ``run_context(job_config)``, which builds the RunContext
once (memoised on the job config object): the backbone family and config, the datasets and
their metadata (checked to share one codec layout and to fit the backbone's text vocabulary),
the training mixture, the validation sets, the vocabulary layout, and from them the model args
(``fill_model_args``). The config schema (config.py) sits below this; the checks that need the
model, the data, the parallel layout or the checkpoints (trainer/preflight.py) sit above it.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, fields
from pathlib import Path

from torchtitan.protocols.train_spec import get_train_spec
from torchtitan.tools.logging import logger

from torchtitan_speechlm.config import ConfigError, SpeechLM
from torchtitan_speechlm.data.external import external_data
from torchtitan_speechlm.data.format import check_compatible
from torchtitan_speechlm.data.tasks import TASKS, get_task
from torchtitan_speechlm.model.audio.encoders import AudioEncoderError
from torchtitan_speechlm.model.audio.tower import AudioEncoderArgs
from torchtitan_speechlm.model.backbones import Backbone, get_backbone
from torchtitan_speechlm.model.lora import CONVERTER, SETTING_KEYS
from torchtitan_speechlm.model.patterns import PATTERNS
from torchtitan_speechlm.model.vocab import VocabLayout

# keys whose value must name a registered extension (checked with a "did you mean")
REGISTERED_VALUES = {"speechlm.pattern": PATTERNS}
# the TrainSpecs [speechlm] sections, the resolve step and the checks apply to (trainer/spec.py adds
# each one it registers)
SPEECHLM_SPECS: set[str] = set()

_ATTR = "_speechlm_run_context"


@dataclass(frozen=True)
class MixEntry:
    task: str
    dataset: str
    weight: float


def parse_datasets(specs: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ConfigError(
                f"speechlm_data.datasets entry {spec!r} must look like NAME=PATH "
                "(a directory made by `torchtitan prepare`)."
            )
        if name in out:
            raise ConfigError(f"speechlm_data.datasets names {name!r} twice")
        out[name] = path
    return out


def parse_mix(specs: list[str], key: str, names: dict[str, str]) -> list[MixEntry]:
    entries = []
    for spec in specs:
        parts = spec.split(":")
        if len(parts) not in (2, 3):
            raise ConfigError(f"speechlm_data.{key} entry {spec!r} must be TASK:NAME[:WEIGHT]")
        task, name = parts[0], parts[1]
        if task not in TASKS:
            try:
                TASKS.get(task)
            except ValueError as e:
                raise ConfigError(f"speechlm_data.{key} entry {spec!r}: {e}") from None
        if name not in names:
            raise ConfigError(
                f"speechlm_data.{key} entry {spec!r}: no dataset named {name!r}; add "
                f"`{name}=PATH` to speechlm_data.datasets (known: {sorted(names)})"
            )
        try:
            weight = float(parts[2]) if len(parts) == 3 else 1.0
        except ValueError:
            raise ConfigError(
                f"speechlm_data.{key} entry {spec!r}: weight is not a number"
            ) from None
        if weight <= 0:
            raise ConfigError(f"speechlm_data.{key} entry {spec!r}: weight must be > 0")
        entries.append(MixEntry(task, name, weight))
    return entries


def read_dataset_metadata(path: str) -> dict:
    meta = Path(path) / "metadata.json"
    if not meta.is_file():
        raise ConfigError(
            f"prepared dataset {path!r} has no metadata.json; create it with "
            "`torchtitan prepare --manifest M.jsonl --codec DIR --tokenizer DIR --out "
            f"{path}`."
        )
    return json.loads(meta.read_text())


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
        _check_stream_weights(job_config, ctx)
        _check_continuous(job_config, ctx, audio_encoder_args(job_config))
        object.__setattr__(job_config, _ATTR, ctx)
    return ctx


def _check_stream_weights(job_config, ctx: RunContext) -> None:
    weights, n = job_config.speechlm.stream_weights, ctx.num_streams
    if weights and len(weights) != n:
        raise ConfigError(
            f"speechlm.stream_weights has {len(weights)} values but the codec has "
            f"{n} streams; give {n} values or leave it empty (uniform)."
        )


def is_speechlm(job_config) -> bool:
    """The job trains a spec registered through ``spec.register_speechlm_spec``."""
    return job_config.model.name in SPEECHLM_SPECS


def backbone_of(job_config) -> Backbone:
    """The backbone family of the job's spec and flavor."""
    spec = get_train_spec(job_config.model.name)
    flavor = job_config.model.flavor
    if flavor not in spec.model_args:
        raise ConfigError(
            f"model.flavor = {flavor!r}: the {job_config.model.name!r} spec has "
            f"flavor(s) {sorted(spec.model_args)}"
        )
    return get_backbone(spec.model_args[flavor].backbone)


def check_registered_values(job_config) -> None:
    """Each key of ``REGISTERED_VALUES`` names a registered extension (else a "did you mean")."""
    for dotted, registry in REGISTERED_VALUES.items():
        section, key = dotted.split(".")
        try:
            registry.get(getattr(getattr(job_config, section), key), dotted)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _build(job_config) -> RunContext:
    check_registered_values(job_config)
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


def audio_encoder_args(job_config) -> dict:
    """[audio_encoder] as the model args' ``audio_encoder`` (the folder's encoder config read
    and checked against its feature extractor), {} without a path."""
    a = job_config.audio_encoder
    if not a.path:
        return {}
    options = {k: getattr(a, k) for k in ("stack", "adaptor_hidden")}
    options.update(freeze_encoder=a.freeze_encoder, freeze_adaptor=a.freeze_adaptor)
    try:
        return AudioEncoderArgs.from_folder(a.path, **options).to_dict()
    except AudioEncoderError as e:
        raise ConfigError(str(e)) from None


def lora_settings(job_config) -> dict:
    """The job's [lora] section as the model args' settings when `model.converters` lists
    "lora" (components/lora.py), else empty (no LoRA)."""
    if CONVERTER not in job_config.model.converters:
        return {}
    return {key: copy.deepcopy(getattr(job_config.lora, key)) for key in SETTING_KEYS}


def _check_continuous(job_config, ctx: RunContext, audio: dict) -> None:
    """Continuous-audio tasks need an audio encoder and datasets with waveforms at its rate, no
    longer than its window (longer audio is refused, not chunked: docs/audio-encoder.md)."""
    entries = list(ctx.train) + [e for es, _ in ctx.valid.values() for e in es]
    for e in entries:
        if not get_task(e.task).continuous:
            continue
        where = f"speechlm_data: {e.task}:{e.dataset}"
        if not audio:
            raise ConfigError(
                f"{where} takes continuous audio, but the run has no audio encoder: set "
                "[audio_encoder] path to a local speech-encoder folder (docs/audio-encoder.md)"
            )
        wave = ctx.metadata.get(e.dataset, {}).get("waveform")
        if not wave:
            raise ConfigError(
                f"{where}: dataset {ctx.datasets.get(e.dataset)!r} holds no waveforms; add them "
                "with `python -m torchtitan_speechlm.prepare.waveforms PREPARED MANIFEST`"
            )
        args = AudioEncoderArgs(**audio)
        if int(wave["sample_rate"]) != args.sample_rate:
            raise ConfigError(
                f"{where}: its waveforms are at {wave['sample_rate']} Hz, the audio encoder "
                f"{args.path!r} reads {args.sample_rate} Hz; add them again with "
                f"--sample-rate {args.sample_rate}"
            )
        if int(wave.get("max_samples", 0)) > args.window_samples:
            raise ConfigError(
                f"{where}: its longest item is {int(wave['max_samples']) / args.sample_rate:.2f} "
                f"s, longer than the audio encoder's window of "
                f"{args.window_samples / args.sample_rate:g} s; cut the audio (e.g. Kaldi "
                "segments) before preparing it"
            )


def fill_model_args(args, job_config) -> None:
    """The model args of the job, from the resolved run (no side effects; the spec's
    ``update_from_config`` also checks the job and records the run)."""
    sl, ctx = job_config.speechlm, run_context(job_config)
    for f in fields(SpeechLM):
        if f.name in {g.name for g in fields(args)}:
            setattr(args, f.name, getattr(sl, f.name))
    args.hf_assets_path = ctx.backbone_path
    args.backbone_config = ctx.backbone_config
    args.vocab = ctx.layout.to_dict()
    args.tie_embeddings = (
        ctx.family.tie_word_embeddings(ctx.backbone_config)
        if sl.tie_embeddings == "auto"
        else sl.tie_embeddings == "true"
    )
    args.load_weights = sl.init == "pretrained"
    args.codec_hash = str(ctx.codec.get("config_hash", ""))
    args.lora = lora_settings(job_config)
    args.audio_encoder = audio_encoder_args(job_config)
