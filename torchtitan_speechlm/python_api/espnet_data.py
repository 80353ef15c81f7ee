"""ESPnet SpeechLM's ``DataIteratorFactory`` as the data of a torchtitan run.

ESPnet's TitanTrainer asks its training factory for ``build_iter(global_step, length)`` (a
DataLoader of this rank's next ``length`` batches, ``global_step`` counting batches) and each
validation factory for ``build_iter()``; each rank builds its own factory, which shards the data
by rank. ``EspnetData`` wraps such a factory and converts every batch to ours:

ESPnet batch (dict)                           ours (``(input_dict, labels)``, components/dataloader.py)
``seqs`` int64 [B, T, N], ESPnet vocabulary   ``input`` = ids[:, :-1], ``targets`` = ids[:, 1:]
``loss_masks`` float [B, T, N]                ``loss_weights`` = loss_masks[:, 1:]
``position_ids`` [B, T] (packed; optional)    ``position_ids`` = position_ids[:, :-1] (else 0..T-2)
``key`` [(task, name, id), ...] (optional)    counted in ``data/task_{task}``
``data_stats``, ``cu_seq_lens`` (optional)    ignored (ours are recomputed from the batch)
``conti_feats`` {io: [segments, (wave, lens)]} ``audio_wave``, ``audio_lengths``, ``audio_index``
                                              (one continuous io, through ``[audio_encoder]``)
other ``{io}_feats``                          refused: tokenise that audio offline first

ESPnet shifts inside its model (``seqs[:, 1:]`` are the targets); ours expects shifted
inputs, so the shift happens here. Token ids are remapped by ``vocab_intervals`` (ESPnet's
``SpeechLMJobTemplate.vocab_intervals``): its first nine special tokens (pad, bos, eos, eot,
system, user, assistant, text, audio) have the same names and ids in our vocabulary, text ids
move by the difference of the text offsets, the audio stream intervals become our codebooks,
and ESPnet's pad 0 in stream k > 0 becomes our stream-k pad. Any other special (image,
video, toolcall, unused) is an error naming the id. ESPnet's delay interleave is applied by
its data side already, so the run uses ``speechlm.pattern`` only for the head's vocabulary
slices (``delay``, the default, as ESPnet's).

The training loader asks the factory for ``checkpoint.interval`` x accumulation batches at a
time, as ESPnet does, and saves (chunk start, batches taken) per rank: a resume rebuilds the
same chunk (ESPnet shuffles within a chunk by its start) and skips what was trained, so it
continues exactly; it needs the same number of data-parallel ranks (the factory shards).

ESPnet's ``conti_feats`` (``ContinuousAudioIO``: a waveform the model encodes) map onto the run's
audio encoder (docs/audio-encoder.md): each segment ``(row, start, length)`` of the one continuous
io becomes ``audio_index`` rows ``[start, start + length)`` (the shift leaves input positions
where they are), its waveform an ``audio_wave`` row. ``length`` must be what our encoder and
adaptor make of the waveform (``[audio_encoder] stack`` as ESPnet's adaptor), else an error
names both.

The id mapping is espnet_vocab.py's; the batch checks, continuous inputs, statistics and the
validation stand-in row are espnet_batch.py's.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import IGNORE_INDEX

from torchtitan_speechlm.config import ConfigError
from torchtitan_speechlm.data.planner import Unit
from torchtitan_speechlm.model.vocab import VocabLayout
from torchtitan_speechlm.python_api.espnet_batch import (
    EspnetBatchError,
    batch_arrays,
    batch_stats,
    continuous_inputs,
    pad_batch,
)
from torchtitan_speechlm.python_api.espnet_vocab import EspnetVocab, int_intervals


class EspnetData:
    """An ESPnet SpeechLM ``DataIteratorFactory`` (or anything with its ``build_iter``) whose
    token ids follow ``vocab_intervals`` ({"special_token": [(0, 256)], "text": [(a, b)],
    AUDIO: [(s_0, e_0), ..., (s_{N-1}, e_{N-1})]}): one interval per audio stream, all of
    the same size (the codebook size). ``frame_rate`` (codec frames per second) only feeds
    the audio-seconds throughput metric."""

    def __init__(
        self,
        factory: Any,
        vocab_intervals: Mapping[str, Any],
        *,
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
        self.text, self.frame_rate = text, float(frame_rate)
        self.vocab = EspnetVocab(self.vocab_intervals, audio, text)
        self.audio, self.codebook_size = self.vocab.audio, self.vocab.codebook_size
        # LM frames of n waveform samples: the run's audio encoder (set by EspnetExternal)
        self.continuous_frames = None

    @property
    def codec(self) -> dict:
        return {
            "num_streams": len(self.vocab.streams),
            "codebook_size": self.codebook_size,
            "frame_rate": self.frame_rate,
            "config_hash": "",
        }

    def like(self, factory: Any) -> EspnetData:
        """Another factory with the same vocabulary (a validation set)."""
        return EspnetData(
            factory,
            self.vocab_intervals,
            audio=self.audio,
            text=self.text,
            frame_rate=self.frame_rate,
        )

    def convert(self, batch: Mapping, layout: VocabLayout) -> tuple[dict, torch.Tensor]:
        """One ESPnet batch -> our ``(input_dict, labels)`` (see the module docstring)."""
        seqs, masks = batch_arrays(batch, layout.num_streams, self.audio)
        ids, pad = self.vocab.to_ours(seqs, layout)
        b, t = seqs.shape[0], seqs.shape[1] - 1
        if batch.get("position_ids") is not None:
            pos = torch.as_tensor(np.asarray(batch["position_ids"])).long()[:, :t]
        else:
            pos = torch.arange(t).expand(b, t)
        inp, tgt, w = ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), masks[:, 1:].contiguous()
        loss_frames = (w > 0).any(-1)
        stats = batch_stats(inp, pad[:, :-1], pos.contiguous(), loss_frames, layout, batch)
        input_dict = {
            "input": inp,
            "targets": tgt,
            "loss_weights": w,
            "position_ids": pos.contiguous(),
            "data_stats": stats,
        }
        if batch.get("conti_feats"):
            conti = continuous_inputs(batch["conti_feats"], b, t, self.continuous_frames)
            input_dict.update(conti)
        return input_dict, torch.where(loss_frames, 0, IGNORE_INDEX)


class EspnetTrainLoader(BaseDataLoader):
    """torchtitan's data loader over ``factory.build_iter(global_step, length)`` chunks."""

    def __init__(self, data: EspnetData, layout: VocabLayout, chunk: int, dp_rank: int, dp: int):
        self.data, self.layout, self.chunk = data, layout, max(1, chunk)
        self.dp_rank, self.dp_world_size = dp_rank, dp
        self.chunk_start, self.offset = 0, 0  # in batches of this rank

    def __iter__(self):
        while True:
            loader = self.data.factory.build_iter(global_step=self.chunk_start, length=self.chunk)
            it = iter(loader)
            for _ in range(self.offset):  # a resume inside a chunk: skip what was trained
                next(it)
            for batch in it:
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
            if v.codec["num_streams"] != train.codec["num_streams"] or (
                v.codebook_size != train.codebook_size
            ):
                raise ConfigError(
                    f"valid_data_factories[{name!r}] has another vocabulary than the training data"
                )

    @property
    def codec(self) -> dict:
        return self.train.codec

    def valid_names(self) -> list[str]:
        return list(self.valid)

    def train_loader(
        self, job_config, layout, dp_rank: int, dp_world_size: int, *, accumulation: int,
        continuous_frames,
    ):  # fmt: skip
        chunk = job_config.checkpoint.interval * accumulation
        self.train.continuous_frames = continuous_frames
        return EspnetTrainLoader(self.train, layout, chunk, dp_rank, dp_world_size)

    def valid_dataset(self, name: str, layout, *, continuous_frames) -> EspnetValidSet:
        self.valid[name].continuous_frames = continuous_frames
        return EspnetValidSet(self.valid[name], layout)
