"""What a SpeechLM run is made of, resolved from its job config: the run plan.

``RunPlan.resolve`` reads each section through the layer that owns it and checks what spans
sections: the backbone family of the spec's flavor and its config (``model.hf_assets_path``),
the data catalog (``[speechlm_data]``: data/catalog.py, each dataset's codec a
``CodecIdentity``) or a Python data object, the vocabulary layout (the backbone's text rows +
the codec's streams), the audio encoder (``[audio_encoder]``: model/audio/tower.py), LoRA
(``[lora]``: model/lora.py ``LoraSettings``), the loss weights against the codec's streams,
continuous-audio tasks against the encoder and the data's waveforms, the model args
(``[speechlm]``: model/args.py), the training stream's settings (data/settings.py
``StreamSettings.from_config``) and the data order. It is the one reader: the plan holds these
typed values and nothing reads the job config's SpeechLM sections for the run again. The plan
is a value: the launcher resolves one to check the job before any rank starts, each rank's
trainer resolves its own (trainer.py) and hands it to the spec's builders; nothing is cached in
a module or on the job config.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan_speechlm.components.resume import DataOrder
from torchtitan_speechlm.config import ConfigError
from torchtitan_speechlm.data.catalog import DataCatalog
from torchtitan_speechlm.data.external import ExternalData
from torchtitan_speechlm.data.settings import StreamSettings
from torchtitan_speechlm.data.tasks import LossWeights, TemplateBuilder, get_task
from torchtitan_speechlm.model.args import SpeechLMModelArgs
from torchtitan_speechlm.model.audio.tower import AudioEncoderArgs
from torchtitan_speechlm.model.backbones import Backbone, get_backbone
from torchtitan_speechlm.model.codec_identity import CodecIdentity
from torchtitan_speechlm.model.lora import LoraError, LoraSettings
from torchtitan_speechlm.model.patterns import PATTERNS
from torchtitan_speechlm.model.vocab import VocabLayout
from torchtitan_speechlm.utils.upstream import get_train_spec

# keys whose value must name a registered extension (checked with a "did you mean", also for
# values given on the command line, which the TOML check does not see)
REGISTERED_VALUES = {"speechlm.pattern": PATTERNS}


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


@dataclass(frozen=True)
class RunPlan:
    """What a run is made of, typed and checked once; nothing here reads the job config again
    (``resolve`` is the one reader)."""

    family: Backbone  # the backbone family of the spec's flavor
    backbone_path: str  # model.hf_assets_path
    backbone_config: dict
    data: DataCatalog  # the datasets (``DatasetRef``s: their codec typed) and the mixture
    external: ExternalData | None  # a Python data object instead of prepared datasets
    layout: VocabLayout
    audio_encoder: dict  # AudioEncoderArgs.to_dict(), {} without an encoder
    lora: LoraSettings | None  # None without LoRA
    loss_weights: LossWeights
    loss_region: str  # speechlm_data.loss_region
    model_args: SpeechLMModelArgs  # what torchtitan builds the model from
    train_stream: StreamSettings | None  # the training stream's (None: a data object's batches)
    valid_stream: StreamSettings | None  # validation's (None: validation off, or a data object)
    order: DataOrder  # what orders the training data (each checkpoint records it)

    @classmethod
    def resolve(cls, job_config, external: ExternalData | None = None) -> RunPlan:
        """The run of ``job_config`` (raises ConfigError naming the key and the fix)."""
        check_registered_values(job_config)
        family = backbone_of(job_config)
        path = job_config.model.hf_assets_path
        try:
            backbone_config = family.read_config(path)
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(str(e)) from None
        text = family.text_vocab_size(backbone_config)
        data = job_config.speechlm_data
        if external is not None:
            if callable(getattr(external, "resolve", None)):
                external.resolve(job_config)
            if data.datasets or data.train:
                raise ConfigError(
                    "the training data comes from a Python data object, so "
                    "speechlm_data.datasets and speechlm_data.train must be empty (they would "
                    "be ignored)"
                )
            catalog = DataCatalog.external(
                external.codec, external.valid_names(), text, getattr(external, "tokenizer", None)
            )
        else:
            catalog = DataCatalog.from_config(data)
            catalog.check_text_vocab(text, path)
        layout = VocabLayout(
            text_size=text,
            num_streams=catalog.codec.num_streams,
            codebook_size=catalog.codec.codebook_size,
        )
        audio_encoder = AudioEncoderArgs.from_config(job_config.audio_encoder)
        try:
            lora = LoraSettings.from_config(job_config.lora, job_config.model.converters)
        except LoraError as e:
            raise ConfigError(str(e)) from None
        loss_weights = LossWeights.from_config(job_config.speechlm, layout.num_streams)
        check_continuous(catalog, audio_encoder)
        model_args = SpeechLMModelArgs.from_config(
            job_config.speechlm,
            backbone=family.name,
            hf_assets_path=path,
            backbone_config=backbone_config,
            layout=layout,
            lora=lora,
            audio_encoder=audio_encoder,
            prompt_seconds=prompt_seconds(job_config.speechlm, catalog),
        )
        train = valid = None
        if external is None:  # a data object batches its own items
            train = StreamSettings.from_config(data, job_config.training)
            if job_config.validation.enable:
                valid = train.for_validation(job_config.validation)
        order = DataOrder(
            tuple(f"{e.task}:{e.dataset}" for e in catalog.train), data.seed, data.shuffle,
            data.batching,
        )  # fmt: skip
        return cls(
            family, path, backbone_config, catalog, external, layout, audio_encoder, lora,
            loss_weights, data.loss_region, model_args, train, valid, order,
        )  # fmt: skip

    @property
    def codec(self) -> CodecIdentity:
        return self.data.codec

    @property
    def num_streams(self) -> int:
        return self.layout.num_streams

    @property
    def frame_rate(self) -> float:
        return self.data.frame_rate

    @property
    def audio(self) -> AudioEncoderArgs | None:
        return AudioEncoderArgs(**self.audio_encoder) if self.audio_encoder else None

    @property
    def max_prompt_frames(self) -> int:
        """Codec frames a speaker prompt is cut to (0: the run has no prompted task)."""
        seconds = self.model_args.prompt_seconds
        return max(1, round(seconds * self.frame_rate)) if seconds else 0

    def template_builder(self) -> TemplateBuilder:
        """Items -> frames and loss weights, as this run lays them out (data/tasks.py)."""
        audio = self.audio
        return TemplateBuilder(
            self.layout,
            self.model_args.pattern,
            self.loss_weights,
            loss_region=self.loss_region,
            continuous_frames=audio.frames_of if audio else None,
            max_prompt_frames=self.max_prompt_frames,
            chat_template=self.model_args.chat_template,
        )


def prompt_seconds(speechlm, catalog: DataCatalog) -> float:
    """``speechlm.prompt_seconds`` when the run has a speaker-prompted task (checked > 0), else
    0 (the model records it: generation refuses a prompt to a model without it)."""
    if not any(get_task(e.task).prompt_budget for e in catalog.entries()):
        return 0.0
    seconds = float(speechlm.prompt_seconds)
    if not seconds > 0:
        raise ConfigError(
            f"speechlm.prompt_seconds = {seconds}: a speaker-prompted task (tts_prompt) "
            "needs a prompt budget > 0 seconds (default 3.0)"
        )
    return seconds


def check_continuous(catalog: DataCatalog, audio_encoder: dict) -> None:
    """Continuous-audio tasks need an audio encoder and datasets with waveforms at its rate,
    no longer than its window (longer audio is refused, not chunked:
    docs/audio-encoder.md)."""
    for e in catalog.entries():
        if not get_task(e.task).continuous:
            continue
        where = f"speechlm_data: {e.task}:{e.dataset}"
        if not audio_encoder:
            raise ConfigError(
                f"{where} takes continuous audio, but the run has no audio encoder: set "
                "[audio_encoder] path to a local speech-encoder folder (docs/audio-encoder.md)"
            )
        wave = catalog.refs[e.dataset].waveform if e.dataset in catalog.refs else None
        if not wave:
            raise ConfigError(
                f"{where}: dataset {catalog.datasets.get(e.dataset)!r} holds no "
                "waveforms; add them with `python -m torchtitan_speechlm.prepare.waveforms "
                "PREPARED MANIFEST`"
            )
        args = AudioEncoderArgs(**audio_encoder)
        if int(wave["sample_rate"]) != args.sample_rate:
            raise ConfigError(
                f"{where}: its waveforms are at {wave['sample_rate']} Hz, the audio encoder "
                f"{args.path!r} reads {args.sample_rate} Hz; add them again with "
                f"--sample-rate {args.sample_rate}"
            )
        if int(wave.get("max_samples", 0)) > args.window_samples:
            longest = int(wave["max_samples"]) / args.sample_rate
            raise ConfigError(
                f"{where}: its longest item is {longest:.2f} s, longer than the audio "
                f"encoder's window of {args.window_samples / args.sample_rate:g} s; cut the "
                "audio (e.g. Kaldi segments) before preparing it"
            )
