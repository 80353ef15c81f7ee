"""ESPnet SpeechLM's ``DataIteratorFactory`` as the data of a torchtitan run.

ESPnet's TitanTrainer asks its training factory for ``build_iter(global_step, length)`` (a
DataLoader of this rank's next ``length`` batches, ``global_step`` counting batches) and each
validation factory for ``build_iter()``; each rank builds its own factory, which shards the data
by rank. ``EspnetData`` wraps such a factory and converts every batch to ours:

ESPnet batch (dict)                           ours (``(input_dict, labels)``, components/dataloader.py)
``seqs`` int64 [B, T, N], ESPnet vocabulary   ``input`` = ids[:, :-1], ``targets`` = ids[:, 1:]
``loss_masks`` float [B, T, N]                ``loss_weights`` = loss_masks[:, 1:]
``position_ids`` [B, T] (packed; optional)    ``position_ids`` = position_ids[:, :-1] (else 0..T-2)
``key`` [(task, name, id), ...] (optional)    counted in ``data/task_{task}`` (ESPnet's names
                                              mapped: text_to_audio tts, audio_to_text asr,
                                              text_only text)
``data_stats``, ``cu_seq_lens`` (optional)    ignored (ours are recomputed from the batch)
``conti_feats[io]`` of a discrete audio io    ``step_audio*``: the waveforms, tokenised in the
  (zeros in ``seqs``, the raw waveform)        training step on the run's device
                                              (components/step_codec.py, espnet_io.py)
``conti_feats[io]`` of a continuous io        ``audio_wave``, ``audio_lengths``, ``audio_index``
                                              (one continuous io, through ``[audio_encoder]``;
                                              mel features are refused)

ESPnet shifts inside its model (``seqs[:, 1:]`` are the targets); ours expects shifted
inputs, so the shift happens here. Token ids are remapped by ``vocab_intervals`` (ESPnet's
``SpeechLMJobTemplate.vocab_intervals``, espnet_vocab.py). An io is discrete when it has a
vocabulary interval (ESPnet's job template gives intervals to discrete ios only). ESPnet's
delay interleave is applied by its io, so the run's ``speechlm.pattern`` must say the same
(``delay`` when the io delay-interleaves, else ``parallel``; checked when the io is known).

The training loader asks the factory for ``checkpoint.interval`` x accumulation batches at a
time, as ESPnet does, and saves (chunk start, batches taken) per rank: a resume rebuilds the
same chunk (ESPnet shuffles within a chunk by its start) and skips what was trained without
collating it (ESPnet's DataLoader is cut after its first batches), so it continues exactly; it
needs the same number of data-parallel ranks (the factory shards).
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from torchtitan_speechlm.codecs import load_codec
from torchtitan_speechlm.config import ConfigError
from torchtitan_speechlm.data.planner import Unit
from torchtitan_speechlm.model.codec_identity import CodecIdentity
from torchtitan_speechlm.model.vocab import VocabLayout
from torchtitan_speechlm.python_api.espnet_batch import (
    EspnetBatchError,
    batch_arrays,
    batch_stats,
    continuous_inputs,
    io_features,
    pad_batch,
    step_audio,
)
from torchtitan_speechlm.python_api.espnet_io import (
    CodecTokenizer,
    EspnetIoTokenizer,
    check_codec,
    io_delay,
    io_frame_rate,
)
from torchtitan_speechlm.python_api.espnet_vocab import SPECIAL_KEY, EspnetVocab, int_intervals
from torchtitan_speechlm.utils.fileio import json_hash
from torchtitan_speechlm.utils.text_tokenizer import tokenizer_fingerprint
from torchtitan_speechlm.utils.upstream import IGNORE_INDEX, BaseDataLoader, logger


class EspnetData:
    """An ESPnet SpeechLM ``DataIteratorFactory`` (or anything with its ``build_iter``) whose
    token ids follow ``vocab_intervals`` ({"special_token": [(0, 256)], "text": [(a, b)],
    AUDIO: [(s_0, e_0), ..., (s_{N-1}, e_{N-1})]}: one interval per audio stream, its pad then
    its codebook, all of one size). ``multimodal_io``: the job template's ios (``job.
    multimodal_io``, or an ESPnet model's ``multimodal_io_dict``): the discrete audio io's
    ``encode_batch`` tokenises its waveforms in the step, and its frame rate and delay
    interleave are checked against the run. ``frame_rate`` (codec frames per second) is read
    from the io when given; it feeds the audio-seconds throughput metric."""

    def __init__(
        self,
        factory: Any,
        vocab_intervals: Mapping[str, Any],
        *,
        multimodal_io: Mapping[str, Any] | None = None,
        audio: str | None = None,
        text: str = "text",
        frame_rate: float = 0.0,
    ):
        if not callable(getattr(factory, "build_iter", None)):
            raise ConfigError(
                f"EspnetData: {type(factory).__name__} has no build_iter(global_step, length)"
            )
        self.factory = factory
        self.vocab_intervals = int_intervals(vocab_intervals)
        self.ios = dict(multimodal_io or {})
        self.text = text
        self.vocab = EspnetVocab(self.vocab_intervals, audio, text)
        self.audio, self.codebook_size = self.vocab.audio, self.vocab.codebook_size
        self.audio_io = self.ios.get(self.audio)
        self.frame_rate = io_frame_rate(self.audio_io) or float(frame_rate)
        self.step_codec_path = ""  # speechlm_data.step_codec, set by resolve()
        self._codec = None  # that codec, loaded once by resolve()
        # LM frames of n waveform samples: the run's audio encoder (set by the run's loader)
        self.continuous_frames = None
        self.encoder_path = ""  # [audio_encoder] path (for messages), set by check()

    @property
    def codec(self) -> CodecIdentity:
        """The audio tokens' identity, as a prepared dataset's metadata.json records its codec:
        a codec of ours (``speechlm_data.step_codec``) as ``torchtitan prepare`` records it, so
        eval, generate and export decode with it; else ESPnet's io (its class, codec tag, delay
        and the vocabulary), which nothing here can decode."""
        if self._codec is not None:
            ours = CodecIdentity.of_codec(self._codec, num_streams=self.vocab.num_streams)
            return replace(ours, path=os.path.abspath(self.step_codec_path))
        identity = {"vocab_intervals": self.vocab_intervals, "io": self.audio}
        if self.audio_io is not None:
            identity["class"] = type(self.audio_io).__name__
            identity["codec"] = str(getattr(self.audio_io, "codec_hf_model_tag", ""))
            identity["delay"] = io_delay(self.audio_io)
        return CodecIdentity(
            name=f"espnet:{self.audio}",
            num_streams=self.vocab.num_streams,
            codebook_size=self.codebook_size,
            frame_rate=self.frame_rate,
            config_hash=json_hash(identity),
        )

    @property
    def tokenizer(self) -> dict | None:
        """The text io's tokenizer (``tokenizer_fingerprint``), when the ios are known."""
        tok = getattr(self.ios.get(self.text), "tokenizer", None)
        return tokenizer_fingerprint(tok) if tok is not None else None

    def like(self, factory: Any) -> EspnetData:
        """Another factory with the same vocabulary and ios (a validation set)."""
        other = EspnetData(
            factory,
            self.vocab_intervals,
            multimodal_io=self.ios,
            audio=self.audio,
            text=self.text,
            frame_rate=self.frame_rate,
        )
        other.step_codec_path, other._codec = self.step_codec_path, self._codec
        return other

    # ---- the run's checks and its step tokenizer -------------------------------------------------
    def resolve(self, job_config) -> None:
        """Check the run against ESPnet's vocabulary and ios before anything is built
        (``check``), and load a codec of ours named by ``speechlm_data.step_codec``, checked
        against the vocabulary and the io."""
        self.check(job_config)
        self.step_codec_path = job_config.speechlm_data.step_codec
        if self.step_codec_path:
            self._codec = load_codec(self.step_codec_path)
            check_codec(self._codec, self.step_codec_path, self.vocab, self.audio_io)
            self.frame_rate = self.frame_rate or float(self._codec.frame_rate)

    def check(self, job_config) -> None:
        """The interleave pattern against the io's delay interleave, and the ios' kinds."""
        self.encoder_path = job_config.audio_encoder.path
        pattern = job_config.speechlm.pattern
        delay = io_delay(self.audio_io)
        want = ("delay",) if delay else ("parallel",) if delay is False else ("delay", "parallel")
        if pattern not in want:
            why = (
                f"ESPnet's io {self.audio!r} {'delay-interleaves' if delay else 'does not interleave'} its streams"
                if delay is not None
                else "ESPnet's sequences carry every stream in parallel, delayed or not"
            )
            raise ConfigError(
                f"speechlm.pattern = {pattern!r}, but {why}: set speechlm.pattern = {want[0]!r} "
                "(the heads' vocabulary slices follow the layout of the data)"
            )
        for name, io in self.ios.items():
            if name not in self.vocab_intervals and getattr(io, "is_discrete", False):
                raise ConfigError(
                    f"EspnetData: io {name!r} is discrete but has no interval in "
                    "vocab_intervals: pass the job template's own vocab_intervals"
                )

    @property
    def can_tokenize(self) -> bool:
        """Whether something can tokenise this data's discrete audio in the step."""
        return bool(self.step_codec_path) or callable(getattr(self.audio_io, "encode_batch", None))

    def step_tokenizer(self, layout: VocabLayout, pattern: str):
        """What tokenises this data's discrete audio in the step (None: nothing can)."""
        if self.step_codec_path:
            return CodecTokenizer(self.step_codec_path, layout, pattern == "delay", self._codec)
        if self.can_tokenize:
            return EspnetIoTokenizer(self.audio, self.audio_io, self.vocab, layout)
        return None

    # ---- one batch -----------------------------------------------------------------------------
    def convert(self, batch: Mapping, layout: VocabLayout) -> tuple[dict, torch.Tensor]:
        """One ESPnet batch -> our ``(input_dict, labels)`` (see the module docstring)."""
        seqs, masks = batch_arrays(batch, layout.num_streams, self.audio)
        ids = self.vocab.to_ours(seqs, layout)
        b, t = seqs.shape[0], seqs.shape[1] - 1
        extra: dict[str, torch.Tensor] = {}
        for io, (segments, wave, lengths) in io_features(batch).items():
            if io in self.vocab_intervals and io not in (SPECIAL_KEY, self.text):
                extra.update(self.discrete_segments(io, segments, wave, lengths, ids, layout))
            else:
                if "audio_wave" in extra:
                    raise EspnetBatchError(
                        f"the batch has several continuous ios; one maps onto [audio_encoder] "
                        f"(io {io!r} is the second)"
                    )
                extra.update(continuous_inputs(
                    io, segments, wave, lengths, b, t, self.continuous_frames, self.encoder_path
                ))  # fmt: skip
        if batch.get("position_ids") is not None:
            pos = torch.as_tensor(np.asarray(batch["position_ids"])).long()[:, :t]
        else:
            pos = torch.arange(t).expand(b, t)
        inp, tgt, w = ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), masks[:, 1:].contiguous()
        loss_frames = (w > 0).any(-1)
        input_dict = {
            "input": inp,
            "targets": tgt,
            "loss_weights": w,
            "position_ids": pos.contiguous(),
            "data_stats": batch_stats(inp, pos, loss_frames, layout, batch),
            **extra,
        }
        return input_dict, torch.where(loss_frames, 0, IGNORE_INDEX)

    def discrete_segments(self, io, segments, wave, lengths, ids, layout) -> dict:
        """A discrete io's waveforms for the step codec; their frames hold each stream's pad
        until it places the codes (so the batch is valid ids either way)."""
        if not self.can_tokenize:
            raise EspnetBatchError(
                f"the batch carries raw audio for the discrete io {io!r} (zeros in `seqs`, the "
                f"waveform in conti_feats[{io!r}]) but nothing can tokenise it: pass the job "
                "template's ios (EspnetData(..., multimodal_io=job.multimodal_io)) or ESPnet's "
                "model object as `model`, or name a codec of ours in trainer_args "
                '{"speechlm_data": {"step_codec": PATH}}'
            )
        pads = torch.tensor([layout.stream_pad(k) for k in range(layout.num_streams)])
        for row, start, frames in segments:
            ids[row, start : start + frames] = pads
        return step_audio(io, segments, wave, lengths)


class EspnetTrainLoader(BaseDataLoader):
    """torchtitan's data loader over ``factory.build_iter(global_step, length)`` chunks."""

    def __init__(self, data: EspnetData, layout: VocabLayout, chunk: int, dp_rank: int, dp: int):
        self.data, self.layout, self.chunk = data, layout, max(1, chunk)
        self.dp_rank, self.dp_world_size = dp_rank, dp
        self.chunk_start, self.offset = 0, 0  # in batches of this rank

    def __iter__(self):
        while True:
            loader = self.data.factory.build_iter(global_step=self.chunk_start, length=self.chunk)
            for batch in skip_batches(loader, self.offset):
                converted = self.data.convert(batch, self.layout)
                self.offset += 1
                yield converted
            if self.offset == 0:
                raise EspnetBatchError(
                    f"build_iter(global_step={self.chunk_start}, length={self.chunk}) gave no batch"
                )
            self.chunk_start, self.offset = self.chunk_start + self.offset, 0

    def state_dict(self) -> dict:
        state = {"chunk_start": self.chunk_start, "offset": self.offset}
        return {f"dp_rank_{self.dp_rank}": pickle.dumps(state), "world_size": self.dp_world_size}

    def load_state_dict(self, state_dict: dict) -> None:
        if not state_dict:
            return
        key = f"dp_rank_{self.dp_rank}"
        if key not in state_dict or state_dict.get("world_size") != self.dp_world_size:
            raise ValueError(
                f"the checkpoint's ESPnet data position was saved with "
                f"{state_dict.get('world_size')} data-parallel ranks, this run has "
                f"{self.dp_world_size}: an ESPnet factory shards by rank, so resume on the same "
                "number of ranks (or add 'dataloader' to checkpoint.exclude_from_loading)"
            )
        state = pickle.loads(state_dict[key])
        self.chunk_start, self.offset = int(state["chunk_start"]), int(state["offset"])


def skip_batches(loader, n: int):
    """An iterator over ``loader`` after its first ``n`` batches. A torch DataLoader over a
    list of batches (ESPnet's ``build_iter``: ``batch_sampler`` = the chunk's batches, already
    shuffled) is rebuilt on the rest of that list, so the skipped batches are never read or
    collated; anything else is read and dropped."""
    sampler = getattr(loader, "batch_sampler", None)
    if n and isinstance(loader, torch.utils.data.DataLoader) and isinstance(sampler, list):
        return iter(
            torch.utils.data.DataLoader(
                loader.dataset,
                batch_sampler=sampler[n:],
                num_workers=loader.num_workers,
                collate_fn=loader.collate_fn,
                pin_memory=loader.pin_memory,
                worker_init_fn=loader.worker_init_fn,
            )
        )
    it = iter(loader)
    for _ in range(n):
        next(it)
    return it


class EspnetValidSet:
    """One validation factory, rebuilt each round (``build_iter()``, as ESPnet calls it)."""

    def __init__(self, data: EspnetData, layout: VocabLayout):
        self.data, self.layout = data, layout

    def __iter__(self):
        for batch in self.data.factory.build_iter():
            yield self.data.convert(batch, self.layout)

    def collate(self, unit: Unit) -> tuple[dict, torch.Tensor]:
        return pad_batch(self.layout, unit.t)


class EspnetRunData:
    """The ESPnet factories of one run, as data/external.py's ExternalData."""

    def __init__(self, train: EspnetData, valid: Mapping[str, EspnetData]):
        self.train, self.valid = train, dict(valid)
        for name, v in self.valid.items():
            if (v.vocab.num_streams, v.codebook_size) != (train.vocab.num_streams,
                                                          train.codebook_size):  # fmt: skip
                raise ConfigError(
                    f"valid_data_factories[{name!r}] has another vocabulary than the training data"
                )

    @property
    def codec(self) -> dict:
        return self.train.codec

    @property
    def tokenizer(self) -> dict | None:
        return self.train.tokenizer

    def valid_names(self) -> list[str]:
        return list(self.valid)

    def resolve(self, job_config) -> None:
        """The run's checks against ESPnet's vocabulary and ios (``EspnetData.resolve``)."""
        self.train.resolve(job_config)
        for data in self.valid.values():
            data.check(job_config)
            data.step_codec_path, data._codec = self.train.step_codec_path, self.train._codec

    def step_tokenizer(self, layout: VocabLayout, pattern: str):
        return self.train.step_tokenizer(layout, pattern)

    def describe(self, job_config, dp_world_size: int, accumulation: int) -> str:
        """The console line torchtitan's batch-size line cannot give for ESPnet factories."""
        factory = self.train.factory
        batches = len(getattr(factory, "batched_examples", ()) or ())
        per_epoch = f"{batches} batches per epoch on each rank, " if batches else ""
        return (
            f"ESPnet data: {type(factory).__name__} batches as ESPnet's batchfy made them "
            f"({per_epoch}{dp_world_size} data-parallel rank(s); `training.local_batch_size` "
            f"and `seq_len` do not apply), {accumulation} batch(es) per optimizer step, "
            f"{job_config.checkpoint.interval * accumulation} per build_iter chunk; validation "
            f"sets {self.valid_names() or 'none'}"
        )

    def train_loader(
        self, job_config, layout, dp_rank: int, dp_world_size: int, *, accumulation: int,
        continuous_frames,
    ):  # fmt: skip
        chunk = job_config.checkpoint.interval * accumulation
        self.train.continuous_frames = continuous_frames
        if dp_rank == 0:
            logger.info(self.describe(job_config, dp_world_size, accumulation))
        return EspnetTrainLoader(self.train, layout, chunk, dp_rank, dp_world_size)

    def valid_dataset(self, name: str, layout, *, continuous_frames):
        self.valid[name].continuous_frames = continuous_frames
        return EspnetValidSet(self.valid[name], layout)
