"""What tokenises ESPnet's discrete audio in the training step (components/step_codec.py).

ESPnet's preprocessor leaves zeros in ``seqs`` where a discrete audio io's tokens go and hands
the raw waveform in ``conti_feats[io]``; ESPnet's model encodes it with the io's
``encode_batch(data [B, samples, channels], lengths) -> ids [B, frames(+N-1), N]`` (each stream's
codes offset by its interval's start + 1, the delay interleave applied with each stream's pad)
and adds the io's first interval start. Two tokenizers do the same here:

- ``EspnetIoTokenizer``: that io's own ``encode_batch`` (the io from the user's job template or
  ESPnet model object), so the tokens are exactly ESPnet's; then our ids through the table.
- ``CodecTokenizer``: a codec folder of ours (``speechlm_data.step_codec``: k-means, Encodec,
  Mimi, DAC, ...), its codes laid out as such an io would lay them out (frames = samples //
  frame shift, the delay interleave when the vocabulary's io has it). Each segment is encoded
  alone, so a short clip never carries codes of another clip's padding (ESPnet's batched
  encode does: its shorter rows' delay tails hold codes of the zero padding).

``check_codec`` compares a codec of ours with ESPnet's vocabulary and io (streams, codebook
size, frame rate) and says in one line what differs.
"""

from __future__ import annotations

import numpy as np
import torch

from torchtitan_speechlm.codecs import load_codec
from torchtitan_speechlm.components.step_codec import module_megabytes
from torchtitan_speechlm.config import ConfigError
from torchtitan_speechlm.model.patterns import get_pattern
from torchtitan_speechlm.model.vocab import VocabLayout
from torchtitan_speechlm.python_api.espnet_batch import EspnetBatchError
from torchtitan_speechlm.python_api.espnet_vocab import EspnetVocab


def io_frame_rate(io) -> float:
    """Frames per second of an ESPnet audio io (0: unknown)."""
    shift, rate = getattr(io, "frame_shift", None), getattr(io, "sample_rate", None)
    return float(rate) / float(shift) if shift and rate else 0.0


def io_delay(io) -> bool | None:
    """Whether an ESPnet discrete audio io delay-interleaves its streams (None: unknown)."""
    value = getattr(io, "delay_interleave", None)
    return None if value is None else bool(value)


def _as_batch(wave: torch.Tensor) -> torch.Tensor:
    return wave if wave.ndim == 3 else wave[..., None]  # [n, samples, channels]


class EspnetIoTokenizer:
    """An ESPnet discrete io's ``encode_batch``, its ids mapped onto ours."""

    def __init__(self, name: str, io, vocab: EspnetVocab, layout: VocabLayout):
        self.name, self.io, self.vocab, self.layout = name, io, vocab, layout
        self.io_start = vocab.intervals[name][0][0]

    def describe(self) -> str:
        delay = {True: "on", False: "off", None: "?"}[io_delay(self.io)]
        return (
            f"ESPnet's io {self.name!r} ({type(self.io).__name__}.encode_batch): "
            f"{self.vocab.num_streams} streams x {self.vocab.codebook_size} codes, "
            f"{io_frame_rate(self.io):g} frames/s, delay interleave {delay}"
        )

    def to(self, device: torch.device) -> None:
        if isinstance(self.io, torch.nn.Module):
            self.io.to(device)

    def megabytes(self) -> float:
        return module_megabytes([self.io] if isinstance(self.io, torch.nn.Module) else [])

    def tokenize(self, wave, lengths, frames) -> torch.Tensor:
        ids = self.io.encode_batch(_as_batch(wave), lengths)
        if ids.ndim != 3 or ids.shape[1] < int(frames.max()):
            raise EspnetBatchError(
                f"{type(self.io).__name__}.encode_batch gave ids {tuple(ids.shape)} for segments "
                f"of up to {int(frames.max())} frames in ESPnet's sequence"
            )
        return self.vocab.to_ours(ids.long() + self.io_start, self.layout)


class CodecTokenizer:
    """A codec folder of ours, laid out in ESPnet's stream intervals (the module docstring)."""

    def __init__(self, path: str, layout: VocabLayout, delay: bool, codec=None):
        self.path, self.layout, self.delay = path, layout, delay
        self.pattern = get_pattern("delay" if delay else "parallel")
        self.codec = codec if codec is not None else load_codec(path)
        if self.codec.num_streams > layout.num_streams:  # ESPnet keeps the first K as well
            self.codec.keep_streams(layout.num_streams)
        self.device = torch.device("cpu")
        self.pads = np.array([layout.stream_pad(k) for k in range(layout.num_streams)])
        self.offsets = np.array([layout.code(k, 0) for k in range(layout.num_streams)])

    def describe(self) -> str:
        c = self.codec
        return (
            f"codec {self.path} ({c.name}, config_hash {c.config_hash}): {c.num_streams} streams "
            f"x {c.codebook_size} codes, {c.frame_rate:g} frames/s, delay interleave "
            f"{'on' if self.delay else 'off'}"
        )

    def to(self, device: torch.device) -> None:
        if device != self.device:
            self.codec = load_codec(
                self.path, device=str(device), num_streams=self.codec.num_streams
            )
            self.device = device

    def megabytes(self) -> float:
        c, total = self.codec, 0.0
        for value in vars(c).values():
            if isinstance(value, torch.nn.Module):
                total += module_megabytes([value])
            elif isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size() / 2**20
        return total

    def tokenize(self, wave, lengths, frames) -> torch.Tensor:
        spf = self.codec.samples_per_frame
        wave = _as_batch(wave)
        clips = [wave[i, : int(n), 0].float().cpu().numpy() for i, n in enumerate(lengths)]
        n_frames = [int(n) // spf for n in lengths]
        codes = self.codec.encode(
            [c[: f * spf] if f else c[:spf] for c, f in zip(clips, n_frames, strict=True)]
        )
        out = np.empty((len(clips), int(frames.max()), self.layout.num_streams), dtype=np.int64)
        out[:] = self.pads
        for i, (c, f) in enumerate(zip(codes, n_frames, strict=True)):
            c = np.concatenate([c[:f], np.repeat(c[-1:], max(0, f - len(c)), 0)])[:f]
            rows = self.pattern.interleave(c + self.offsets, self.pads)
            if len(rows) != int(frames[i]):
                raise EspnetBatchError(
                    f"a segment of {int(lengths[i])} samples is {int(frames[i])} frames in "
                    f"ESPnet's sequence, but codec {self.path} makes {len(rows)} of it "
                    f"({spf} samples per frame, delay {'on' if self.delay else 'off'}): use "
                    "the codec with the frame shift of the job's io"
                )
            out[i, : len(rows)] = rows
        return torch.from_numpy(out)


def check_codec(codec, path: str, vocab: EspnetVocab, io=None) -> None:
    """A codec of ours against ESPnet's vocabulary (and its io, when known): one line naming
    what differs and the fix, else nothing."""
    where = f"speechlm_data.step_codec = {path!r}"
    if codec.total_streams < vocab.num_streams or codec.codebook_size != vocab.codebook_size:
        raise ConfigError(
            f"{where}: the codec has {codec.total_streams} streams of {codec.codebook_size} "
            f"codes, ESPnet's vocabulary {vocab.audio!r} {vocab.num_streams} streams of "
            f"{vocab.codebook_size}: name a codec of that shape (or build the job's vocabulary "
            "from this codec)"
        )
    rate = io_frame_rate(io) if io is not None else 0.0
    if rate and abs(rate - codec.frame_rate) > 1e-6:
        raise ConfigError(
            f"{where}: the codec makes {codec.frame_rate:g} frames/s, ESPnet's io "
            f"{vocab.audio!r} {rate:g} (its preprocessor sized the sequences with that frame "
            "shift): name a codec with the io's frame rate"
        )
    sr = getattr(io, "sample_rate", None) if io is not None else None
    if sr and int(sr) != int(codec.sample_rate):
        raise ConfigError(
            f"{where}: the codec reads {codec.sample_rate} Hz, ESPnet's io {vocab.audio!r} "
            f"{sr} Hz: name a codec at the io's sample rate"
        )
