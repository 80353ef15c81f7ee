"""Samples during training: every ``speechlm.sample_every`` steps a fixed small prompt set is
decoded and written under ``{dump_folder}/samples/step-N/`` (TTS wavs and their texts, ASR
transcripts with their references), and logged to TensorBoard and wandb as audio and text.

Every rank takes part in gathering the full weights once (one collective per parameter, the
same cost as a checkpoint's), then only rank 0 builds an unsharded copy and decodes: the other
ranks go on and wait at their next collective for at most the decode. The prompt set is the
first ``sample_count`` speech items of the first validation set (``speechlm.sample_texts``
replaces the TTS texts).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from torchtitan_speechlm.generation import tasks
from torchtitan_speechlm.generation.decode import DecodeConfig
from torchtitan_speechlm.generation.loading import Loaded
from torchtitan_speechlm.model.codec_identity import CodecIdentity
from torchtitan_speechlm.model.model import build_model
from torchtitan_speechlm.model.run_record import model_record
from torchtitan_speechlm.utils.upstream import logger


@dataclass(frozen=True)
class SamplePrompts:
    """What the sample set is decoded with: the data's codec and text tokenizer, its frame rate
    and its ASR prompts (``items(count)``: the first speech items of the first validation set,
    [] without one); ``speaker_prompts(count)``: per item, another utterance of its speaker
    (None where there is none), which prompts the TTS samples of a model trained with a
    prompted task."""

    codec: CodecIdentity
    tokenizer_path: str
    frame_rate: float
    items: Callable[[int], list]
    speaker_prompts: Callable[[int], list] = lambda count: []


class TrainingSamples:
    def __init__(
        self, every: int, count: int, texts: list[str], folder: str, prompts: SamplePrompts
    ):
        self.every, self.count, self.texts = every, count, list(texts)
        self.folder, self.prompts = folder, prompts
        self._done_until = 0

    def due(self, step: int) -> bool:
        return self.every > 0 and step // self.every > self._done_until

    def run(self, step: int, model_parts, loggers) -> None:
        """Decode the prompt set at ``step`` (call on every rank)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        self._done_until = step // self.every
        model = model_parts[0]
        state = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        try:
            self._decode(step, model.args, state, loggers)
        except Exception as e:  # a sample must never stop a training run
            logger.warning(f"samples at step {step} failed: {type(e).__name__}: {e}")

    def _decode(self, step: int, args, state: dict, loggers) -> None:
        prompts = self.prompts
        copy = build_model(_copy_args(args))
        copy.load_state_dict(state, strict=False)
        loaded = Loaded(
            copy.eval(),
            {"model_args": model_record(args), "codec": prompts.codec.to_dict()},
            prompts.tokenizer_path,
            prompts.codec.path,
            "training",
        )
        items = prompts.items(self.count)
        texts = self.texts or [it.text for it in items]
        cfg = DecodeConfig(max_frames=int(20 * prompts.frame_rate) or 500)
        out = os.path.join(self.folder, f"step-{step}")
        os.makedirs(out, exist_ok=True)
        panels = {}
        speakers = self._speaker_prompts(loaded, len(texts))
        # one batch, decoded by the codec together
        spoken = tasks.tts_with_ends(loaded, texts, cfg, prompts_codes=speakers)[0]
        wavs = tasks.decode_audio(loaded, spoken)
        for i, (text, codes, wav) in enumerate(zip(texts, spoken, wavs, strict=True)):
            path = os.path.join(out, f"tts_{i}.wav")
            tasks.write_wav(loaded, codes, path, wav)
            with open(os.path.join(out, f"tts_{i}.txt"), "w") as f:
                f.write(text + "\n")
            panels[f"samples/tts_{i}"] = (path, text)
            if speakers[i] is not None:  # the voice it was asked for, as the model heard it
                heard = loaded.builder.cut_prompt(speakers[i])
                prompt_path = os.path.join(out, f"tts_{i}_prompt.wav")
                tasks.write_wav(loaded, heard, prompt_path)
                panels[f"samples/tts_{i}_prompt"] = (prompt_path, f"speaker prompt of: {text}")
        if items:
            for i, (it, hyp) in enumerate(
                zip(items, tasks.asr(loaded, [it.audio_codes for it in items], cfg), strict=True)
            ):
                with open(os.path.join(out, f"asr_{i}.txt"), "w") as f:
                    f.write(f"ref: {it.text}\nhyp: {hyp}\n")
                panels[f"samples/asr_{i}"] = (None, f"ref: {it.text}  \nhyp: {hyp}")
        _log_panels(loggers, panels, step, loaded.codec.sample_rate)
        logger.info(f"samples at step {step}: {out}")

    def _speaker_prompts(self, loaded: Loaded, n: int) -> list:
        """Per TTS sample, its speaker prompt's codes: a model trained with a prompted task
        speaks each sample in the voice of another utterance of the sample item's speaker
        (a sample without one of its own, or beyond the items: ``sample_texts``, takes the
        prompts found in turn, so that every sample of such a model is prompted); None for a
        model trained without prompts, or a validation set without speaker labels."""
        if loaded.max_prompt_frames <= 0:
            return [None] * n
        own = [
            None if p is None else p.audio_codes for p in self.prompts.speaker_prompts(self.count)
        ]
        found = [p for p in own if p is not None]
        if not found:
            return [None] * n
        return [
            own[i] if i < len(own) and own[i] is not None else found[i % len(found)]
            for i in range(n)
        ]


def _copy_args(args):
    import copy

    args = copy.copy(args)
    args.load_weights, args.init_from = False, ""
    return args


def _log_panels(loggers, panels: dict, step: int, rate: int) -> None:
    """Audio and text panels for TensorBoard's writer and wandb, where they are enabled."""
    import soundfile as sf

    for sink in _leaves(loggers):
        writer, wandb = getattr(sink, "writer", None), getattr(sink, "wandb", None)
        for tag, (path, text) in panels.items():
            if writer is not None:
                if path:
                    wav, _ = sf.read(path, dtype="float32")
                    writer.add_audio(tag, torch.from_numpy(wav)[None], step, sample_rate=rate)
                writer.add_text(tag, text, step)
        if wandb is not None and wandb.run is not None:
            wandb.log(
                {
                    tag: (
                        wandb.Audio(path, sample_rate=rate, caption=text)
                        if path
                        else wandb.Html(f"<pre>{text}</pre>")
                    )
                    for tag, (path, text) in panels.items()
                },
                step=step,
            )


def _leaves(sink) -> list:
    """The loggers inside (nested) LoggerContainers."""
    inner = getattr(sink, "_loggers", None)
    return [sink] if inner is None else [leaf for s in inner for leaf in _leaves(s)]
