"""A model to generate with, from a training checkpoint's step folder or an exported folder:
the model, its vocabulary and template builder, the tokenizer and the codec of its data, found
from the folder alone (the run's ``speechlm_run.json``, or the export's config.json)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property

from torchtitan_speechlm.data.tasks import LossWeights, TemplateBuilder, normalised_stream_weights
from torchtitan_speechlm.model.codec_identity import CodecIdentity
from torchtitan_speechlm.model.model import SpeechLM, build_model
from torchtitan_speechlm.model.pretrained import (
    PretrainedError,
    args_from_record,
    load_checkpoint_state,
    read_export_config,
)
from torchtitan_speechlm.model.run_record import record_for_checkpoint, recorded_codec
from torchtitan_speechlm.utils.text_tokenizer import load_text_tokenizer


@dataclass
class Loaded:
    model: object  # SpeechLM, eval mode
    record: dict  # the export's config.json or the run's speechlm_run.json
    tokenizer_path: str
    codec_path: str
    source: str

    @property
    def layout(self):
        return self.model.args.layout

    @cached_property
    def builder(self):
        n = self.layout.num_streams
        weights = LossWeights(1.0, 1.0, tuple(normalised_stream_weights([], n)))
        audio = self.model.args.audio  # a continuous audio encoder: its prompts' frame counts
        frames = audio.frames_of if audio else None
        return TemplateBuilder(
            self.layout,
            self.model.args.pattern,
            weights,
            continuous_frames=frames,
            max_prompt_frames=self.max_prompt_frames,
            chat_template=getattr(self.model.args, "chat_template", "ours"),
        )

    @property
    def prompt_seconds(self) -> float:
        """The speaker-prompt budget the model was trained with (0: trained without the
        prompted task, ``tts_prompt``)."""
        return float(getattr(self.model.args, "prompt_seconds", 0.0) or 0.0)

    @property
    def max_prompt_frames(self) -> int:
        """Codec frames a speaker prompt is cut to (0: the model takes no prompt)."""
        if not self.prompt_seconds:
            return 0
        rate = self.codec_identity.frame_rate
        rate = float(rate) if rate else float(self.codec.frame_rate)
        return max(1, round(self.prompt_seconds * rate))

    @cached_property
    def tokenizer(self):
        if not self.tokenizer_path or not os.path.isdir(self.tokenizer_path):
            raise PretrainedError(
                f"{self.source}: the tokenizer of its data ({self.tokenizer_path!r}) is not found; "
                "export the checkpoint again on a machine that has it (exports carry it)"
            )
        return load_text_tokenizer(self.tokenizer_path)

    @cached_property
    def codec_identity(self) -> CodecIdentity:
        """The codec the model was trained with, as its record or export names it."""
        return recorded_codec(self.record)

    @cached_property
    def codec(self):
        from torchtitan_speechlm.codecs import load_codec

        meta = self.codec_identity
        if not self.codec_path or not os.path.isdir(self.codec_path):
            raise PretrainedError(
                f"{self.source}: the codec of its data ({self.codec_path!r}) is not found; "
                "exports carry it in codec/"
            )
        codec = load_codec(self.codec_path, num_streams=meta.num_streams or None)
        if meta.config_hash and codec.config_hash != meta.config_hash:
            raise PretrainedError(
                f"{self.codec_path} is not the codec the model was trained "
                f"with (config_hash {codec.config_hash} vs {meta.config_hash})"
            )
        return codec


def load_model(path: str, device: str = "cpu") -> Loaded:
    """The model in a ``torchtitan export`` folder or a ``DUMP/checkpoint/step-N`` folder."""
    path = os.path.abspath(path)
    if os.path.isfile(os.path.join(path, "config.json")):
        record = read_export_config(path)
        model = SpeechLM.from_pretrained(path, device)
        tok = (
            path
            if os.path.isfile(os.path.join(path, "tokenizer.json"))
            else record.get("tokenizer", {}).get("path", "")
        )
        codec = recorded_codec(record)
        codec_path = os.path.join(path, codec.folder) if codec.folder else codec.path
        return Loaded(model, record, tok, codec_path, path)
    if os.path.isdir(path):
        record = record_for_checkpoint(path)
        model = build_model(args_from_record(record["model_args"]), device)
        names = {n for n, _ in model.named_parameters()}
        model.load_state_dict(load_checkpoint_state(path, names), strict=False)
        return Loaded(
            model.eval(),
            record,
            record["tokenizer"].get("path", ""),
            recorded_codec(record).path,
            path,
        )
    raise PretrainedError(
        f"--model {path}: no such folder (a `torchtitan export` folder or a "
        "DUMP/checkpoint/step-N folder)"
    )
