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
from torchtitan_speechlm.data.collation import data_stats_keys
from torchtitan_speechlm.data.planner import Unit
from torchtitan_speechlm.data.tasks import TASKS
from torchtitan_speechlm.model.vocab import SPECIAL_TOKENS, VocabLayout

ESPNET_SHARED_SPECIALS = 9  # <|pad|> .. <|audio|>: same names, same ids as ours


class EspnetBatchError(ValueError):
    """An ESPnet batch that cannot be converted; the message says why and what to do."""


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
        self.vocab_intervals = {
            k: [tuple(map(int, iv)) for iv in v] for k, v in vocab_intervals.items()
        }
        self.text, self.frame_rate = text, float(frame_rate)
        others = [k for k in self.vocab_intervals if k not in ("special_token", text)]
        if audio is None:
            if len(others) != 1:
                raise ConfigError(
                    f"EspnetData: vocab_intervals has the modalities {others}; say which one is "
                    "the audio codec with audio=NAME"
                )
            audio = others[0]
        if audio not in self.vocab_intervals or text not in self.vocab_intervals:
            raise ConfigError(
                f"EspnetData: vocab_intervals needs {text!r} and {audio!r} entries, has "
                f"{sorted(self.vocab_intervals)}"
            )
        self.audio = audio
        streams = self.vocab_intervals[audio]
        sizes = {e - s for s, e in streams}
        if len(sizes) != 1:
            raise ConfigError(
                f"EspnetData: the {audio!r} streams have codebooks of sizes {sorted(sizes)}; "
                "one size for every stream is needed"
            )
        (self.text_start, self.text_end) = self.vocab_intervals[text][0]
        self.streams = streams
        self.codebook_size = sizes.pop()
        self._lut: dict[int, torch.Tensor] = {}
        # LM frames of n waveform samples: the run's audio encoder (set by EspnetExternal)
        self.continuous_frames = None

    @property
    def codec(self) -> dict:
        return {
            "num_streams": len(self.streams),
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

    # ---- conversion ----------------------------------------------------------------------
    def lookup(self, layout: VocabLayout) -> torch.Tensor:
        """ESPnet id -> our id (-1: not representable)."""
        key = id(layout)
        if key in self._lut:
            return self._lut[key]
        if self.text_end - self.text_start > layout.text_size:
            raise ConfigError(
                f"EspnetData: ESPnet's text interval has {self.text_end - self.text_start} ids "
                f"but the backbone has {layout.text_size} text rows; use the same backbone"
            )
        size = max(e for ivs in self.vocab_intervals.values() for _, e in ivs)
        lut = torch.full((size,), -1, dtype=torch.long)
        assert SPECIAL_TOKENS[:ESPNET_SHARED_SPECIALS][-1] == "<|audio|>"
        lut[:ESPNET_SHARED_SPECIALS] = torch.arange(ESPNET_SHARED_SPECIALS)
        lut[self.text_start : self.text_end] = layout.text_offset + torch.arange(
            self.text_end - self.text_start
        )
        for k, (s, e) in enumerate(self.streams):
            lut[s:e] = layout.code(k, 0) + torch.arange(e - s)
        self._lut[key] = lut
        return lut

    def convert(self, batch: Mapping, layout: VocabLayout) -> tuple[dict, torch.Tensor]:
        """One ESPnet batch -> our ``(input_dict, labels)`` (see the module docstring)."""
        if not isinstance(batch, Mapping) or "seqs" not in batch or "loss_masks" not in batch:
            got = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
            raise EspnetBatchError(
                f"an ESPnet batch is a dict with `seqs` [B,T,N] and `loss_masks` [B,T,N] "
                f"(optional: position_ids, key, data_stats, cu_seq_lens); got {got}"
            )
        feats = [
            k
            for k, v in batch.items()
            if k != "conti_feats" and k.endswith("_feats") and v is not None and len(v) > 0
        ]
        if feats:
            raise EspnetBatchError(
                f"the batch carries raw features ({feats}) that ESPnet encodes inside its model; "
                "this trainer maps only `conti_feats` (one continuous io) onto [audio_encoder]: "
                "tokenise that audio offline (ESPnet's offline codec tokens, or `torchtitan "
                "prepare` and PreparedData)"
            )
        seqs = torch.as_tensor(np.asarray(batch["seqs"])).long()
        masks = torch.as_tensor(np.asarray(batch["loss_masks"])).float()
        n = layout.num_streams
        if seqs.ndim != 3 or seqs.shape[-1] != n or masks.shape != seqs.shape:
            raise EspnetBatchError(
                f"seqs {tuple(seqs.shape)} and loss_masks {tuple(masks.shape)} must both be "
                f"[B, T, {n}] ({n} = streams of the {self.audio!r} intervals)"
            )
        if seqs.shape[1] < 2:
            raise EspnetBatchError("seqs need at least 2 frames (input and target)")
        lut = self.lookup(layout)
        if int(seqs.min()) < 0 or int(seqs.max()) >= len(lut):
            raise EspnetBatchError(
                f"token id {int(seqs.max())} is outside ESPnet's vocab_intervals (size {len(lut)})"
            )
        ids = lut[seqs]
        bad = ids < 0
        if bad.any():
            raise EspnetBatchError(
                f"ESPnet token id {int(seqs[bad][0])} (a special token other than pad, bos, eos, "
                "eot, system, user, assistant, text, audio) has no place in our vocabulary"
            )
        pad = seqs == 0
        pads = torch.tensor(layout.pad_frame())
        ids = torch.where(pad, pads.expand_as(ids), ids)
        b, t = seqs.shape[0], seqs.shape[1] - 1
        if batch.get("position_ids") is not None:
            pos = torch.as_tensor(np.asarray(batch["position_ids"])).long()[:, :t]
        else:
            pos = torch.arange(t).expand(b, t)
        inp, tgt, w = ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), masks[:, 1:].contiguous()
        loss_frames = (w > 0).any(-1)
        stats = self._stats(inp, pad[:, :-1], pos.contiguous(), loss_frames, layout, batch)
        input_dict = {
            "input": inp,
            "targets": tgt,
            "loss_weights": w,
            "position_ids": pos.contiguous(),
            "data_stats": stats,
        }
        if batch.get("conti_feats"):
            input_dict.update(self.continuous(batch["conti_feats"], b, t))
        return input_dict, torch.where(loss_frames, 0, IGNORE_INDEX)

    def continuous(self, conti: Mapping, b: int, t: int) -> dict[str, torch.Tensor]:
        """ESPnet's ``conti_feats`` -> our continuous inputs (the module docstring)."""
        if self.continuous_frames is None:
            raise EspnetBatchError(
                f"the batch carries conti_feats ({sorted(conti)}) but the run has no audio "
                "encoder: set [audio_encoder] path (docs/audio-encoder.md)"
            )
        if len(conti) != 1:
            raise EspnetBatchError(
                f"conti_feats has the continuous ios {sorted(conti)}; one maps onto "
                "[audio_encoder], tokenise the others offline"
            )
        ((io, (segments, padded)),) = conti.items()
        wave, lengths = padded
        wave = torch.as_tensor(np.asarray(wave), dtype=torch.float32)
        wave = wave.squeeze(-1) if wave.ndim == 3 and wave.shape[-1] == 1 else wave
        lengths = torch.as_tensor(np.asarray(lengths)).long()
        index, done = torch.full((b, t), -1, dtype=torch.long), 0
        for (row, start, length), n in zip(segments, lengths.tolist(), strict=True):
            ours = int(self.continuous_frames(n))
            if ours != int(length) or start + length > t:
                raise EspnetBatchError(
                    f"conti_feats[{io!r}]: a segment of row {row} at frame {start} has {length} "
                    f"frames in ESPnet's sequence, our audio encoder makes {ours} of its {n} "
                    f"samples (sequence of {t + 1} frames); match [audio_encoder] stack to "
                    "ESPnet's adaptor"
                )
            index[int(row), int(start) : int(start) + ours] = done + torch.arange(ours)
            done += ours
        return {"audio_wave": wave, "audio_lengths": lengths, "audio_index": index}

    def _stats(self, inp, pad, pos, loss_frames, layout, batch) -> torch.Tensor:
        """The ``data_stats`` vector our statistics expect (data/stream.py)."""
        keys = data_stats_keys(layout.num_streams)
        real = ~pad.all(-1)
        stats = dict.fromkeys(keys, 0.0)
        stats["rows"] = float(inp.shape[0])
        stats["frames"] = float(real.sum())
        stats["pad_frames"] = float(real.numel() - real.sum())
        stats["loss_frames"] = float(loss_frames.sum())
        stats["examples"] = (
            float(((pos == 0) & real).sum())
            if batch.get("position_ids") is not None
            else float(real.any(-1).sum())
        )
        rel = inp - layout.stream_offset(0)
        codes = (rel >= 0) & (inp < layout.size) & (rel % (layout.codebook_size + 1) != 0)
        stats["audio_frames"] = float(codes.sum()) / layout.num_streams
        for k in range(layout.num_streams):
            stats[f"tokens_stream{k}"] = float((~pad[..., k]).sum())
        names = set(TASKS.names())
        for key in batch.get("key") or []:
            task = key[0] if isinstance(key, (tuple, list)) else None
            if task in names:
                stats[f"task_{task}"] += 1
        return torch.tensor([[stats[k] for k in keys]], dtype=torch.float32)

    def pad_batch(self, layout: VocabLayout, t: int) -> tuple[dict, torch.Tensor]:
        """One all-padding row of ``t`` frames with no loss (a validation stand-in)."""
        n = layout.num_streams
        frame = torch.tensor(layout.pad_frame())
        ids = frame.expand(1, t, n).contiguous()
        input_dict = {
            "input": ids,
            "targets": ids.clone(),
            "loss_weights": torch.zeros(1, t, n),
            "position_ids": torch.arange(t).expand(1, t).contiguous(),
            "data_stats": torch.zeros(1, len(data_stats_keys(n))),
        }
        return input_dict, torch.full((1, t), IGNORE_INDEX)


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
        return self.data.pad_batch(self.layout, unit.t)


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
