"""The continuous audio input of a SpeechLM: waveform -> features -> encoder -> adaptor -> the
input embeddings of a segment of the packed sequence (NeMo SALM / Qwen2-Audio style).

A continuous segment is a run of frames in a packed row whose input embeddings are *replaced* by
adaptor outputs (``audio_index`` >= 0 there; the token ids under them are ignored). The batch
carries the segments' waveforms ``audio_wave`` [A, S] (float in [-1, 1], or int16), their lengths
``audio_lengths`` [A] in samples, and ``audio_index`` [B, T]: -1 on token frames, else the row of
that frame in the concatenation of every segment's adaptor frames (segment 0's frames, then
segment 1's, ...). The data side never puts loss on those frames (they have no token to predict).

Padding never leaks: samples past an item's length are zeroed before the features (Whisper's own
padding, so an item padded in a batch encodes exactly as alone), encoder frames past its real
frames are zeroed before stacking, and adaptor frames past its length are never gathered.

The adaptor stacks ``stack`` consecutive encoder frames (the last group zero-filled) and maps
them with Linear -> GELU -> Linear to the backbone width. Its own init: the first layer
N(0, 1/fan_in) (keeps the encoder's scale), the second N(0, init_std) like the text embedding, so
continuous frames start at the scale of token embeddings; biases zero.

MFU counts the tower per clip (``training_flops_per_clip``): the encoder always runs on the
full window, so every clip costs the same, whatever its length.
"""

from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from torchtitan_speechlm.config import ConfigError
from torchtitan_speechlm.model import families  # noqa: F401  (the built-in families register)
from torchtitan_speechlm.model.audio.encoders import (
    AudioEncoder,
    AudioEncoderError,
    get_audio_encoder,
    load_audio_encoder_config,
)


@dataclass
class AudioEncoderArgs:
    """What the model stores about its audio encoder (``SpeechLMModelArgs.audio_encoder``)."""

    model_type: str = ""
    path: str = ""
    config: dict = field(default_factory=dict)
    stack: int = 4
    adaptor_hidden: int = 0  # 0: the backbone's width
    freeze_encoder: bool = True
    freeze_adaptor: bool = False

    @classmethod
    def from_config(cls, section) -> dict:
        """``[audio_encoder]`` as the model args' ``audio_encoder``: the folder's encoder config
        read and checked against its feature extractor, with the section's options; {} without
        a path. Raises ConfigError naming the key."""
        if section.stack < 1 or section.adaptor_hidden < 0:
            raise ConfigError(
                f"audio_encoder.stack = {section.stack} must be >= 1 and "
                f"audio_encoder.adaptor_hidden = {section.adaptor_hidden} >= 0 (0: the "
                "backbone's width)"
            )
        if not section.path:
            return {}
        options = dict(
            stack=section.stack,
            adaptor_hidden=section.adaptor_hidden,
            freeze_encoder=section.freeze_encoder,
            freeze_adaptor=section.freeze_adaptor,
        )
        try:
            return cls.from_folder(section.path, **options).to_dict()
        except AudioEncoderError as e:
            raise ConfigError(str(e)) from None

    @classmethod
    def from_folder(cls, path: str, **options) -> AudioEncoderArgs:
        model_type, config = load_audio_encoder_config(path)
        return cls(model_type=model_type, path=path, config=config, **options)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def family(self) -> AudioEncoder:
        return get_audio_encoder(self.model_type)

    @property
    def sample_rate(self) -> int:
        return self.family.sample_rate(self.config)

    @property
    def window_samples(self) -> int:
        return self.family.window_samples(self.config)

    def output_frames(self, samples: torch.Tensor | int) -> torch.Tensor:
        """LM frames of a continuous segment of ``samples`` samples (what the data budgets)."""
        enc = self.family.encoder_frames(self.config, torch.as_tensor(samples))
        return (enc + self.stack - 1).div(self.stack, rounding_mode="floor")

    def frames_of(self, samples):
        """``output_frames`` of an int or a numpy array, as an int or a numpy array (what the
        data side budgets and lays out, data/tasks.py)."""
        out = self.output_frames(torch.as_tensor(np.asarray(samples, dtype=np.int64))).numpy()
        return int(out) if out.ndim == 0 else out


class Adaptor(nn.Module):
    """Encoder states [A, F, De] -> [A, ceil(F / stack), D]: frame stacking, Linear-GELU-Linear."""

    def __init__(self, in_dim: int, out_dim: int, stack: int, hidden: int):
        super().__init__()
        self.stack = stack
        self.proj_in = nn.Linear(in_dim * stack, hidden)
        self.proj_out = nn.Linear(hidden, out_dim)

    def forward(self, x: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        x = x * real.unsqueeze(-1).to(x.dtype)
        x = F.pad(x, (0, 0, 0, (-x.shape[1]) % self.stack))
        x = x.reshape(x.shape[0], -1, self.stack * x.shape[2])
        return self.proj_out(F.gelu(self.proj_in(x)))

    def initial_state(self, std: float, seed: int) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in self.named_parameters():
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            if name.endswith("bias"):
                out[name] = torch.zeros(p.shape)
            else:
                s = p.shape[1] ** -0.5 if name.startswith("proj_in") else std
                out[name] = torch.empty(p.shape).normal_(0.0, s, generator=gen)
        return out


class AudioTower(nn.Module):
    """Features, encoder and adaptor: parameters ``encoder.*`` and ``adaptor.*``."""

    def __init__(self, args: AudioEncoderArgs, dim: int):
        super().__init__()
        self.args = args
        family = args.family
        self.features = family.features(args.config)
        self.encoder = family.build(args.config)
        hidden = args.adaptor_hidden or dim
        self.adaptor = Adaptor(family.hidden_size(args.config), dim, args.stack, hidden)
        for part, frozen in (
            (self.encoder, args.freeze_encoder),
            (self.adaptor, args.freeze_adaptor),
        ):
            if frozen:
                part.requires_grad_(False)

    def reset_buffers(self, device: torch.device) -> None:
        self.features.reset_buffers(device)

    def initial_state(self, std: float, seed: int, load: bool) -> dict[str, torch.Tensor]:
        """Full initial values by parameter name (``encoder.`` from the folder when ``load``,
        else the family's own init; ``adaptor.`` its own init). The caller checks that every
        parameter got one (SpeechLM.init_weights, under wrapper-free names)."""
        enc = self.args.family.initial_state(self.args.config, self.args.path if load else "", seed)
        out = {f"encoder.{k}": v for k, v in enc.items()}
        out.update({f"adaptor.{k}": v for k, v in self.adaptor.initial_state(std, seed).items()})
        return out

    def encode(
        self, wave: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Adaptor outputs [A, L, D] and each item's real frames [A]."""
        window = self.args.window_samples
        if wave.shape[-1] > window:
            raise ValueError(
                f"audio_wave holds {wave.shape[-1]} samples, more than the audio encoder's "
                f"window of {window} ({window / self.args.sample_rate:g} s); the data must cut "
                "longer audio (see docs/audio-encoder.md)"
            )
        wave = wave.float() / 32768.0 if wave.dtype == torch.int16 else wave.float()
        lengths = lengths.to(wave.device)
        keep = torch.arange(wave.shape[-1], device=wave.device) < lengths[:, None]
        family, config = self.args.family, self.args.config
        frames = family.encoder_frames(config, lengths)
        h = family.run(self.encoder, self.features(wave * keep), frames)
        real = torch.arange(h.shape[1], device=h.device) < frames[:, None]
        return self.adaptor(h, real), self.args.output_frames(lengths)

    def forward(
        self,
        h: torch.Tensor,
        wave: torch.Tensor | None,
        lengths: torch.Tensor | None,
        index: torch.Tensor | None,
    ) -> torch.Tensor:
        """``h`` [B, T, D] with the continuous frames' embeddings replaced (module docstring).
        The tower's entry point is ``forward``: FSDP gathers its parameters there."""
        if wave is None or wave.shape[0] == 0:
            if self.training or (dist.is_available() and dist.is_initialized()):
                # every rank runs the tower (FSDP gathers its shards; backward reduces them)
                dummy = h.new_zeros(1, self.args.config["feature_extractor"]["hop_length"])
                out, _ = self.encode(dummy, torch.tensor([dummy.shape[1]], device=h.device))
                h = h + 0.0 * out.sum().to(h.dtype)
            return h
        emb, frames = self.encode(wave, lengths)
        ends = frames.cumsum(0)
        flat = index.reshape(-1)
        at = flat.clamp(min=0)
        item = torch.searchsorted(ends, at, right=True).clamp(max=emb.shape[0] - 1)
        frame = (at - (ends - frames)[item]).clamp(0, emb.shape[1] - 1)
        rows = emb[item, frame].to(h.dtype)
        out = torch.where((flat >= 0).unsqueeze(-1), rows, h.reshape(-1, h.shape[-1]))
        return out.view_as(h)


def training_flops_per_clip(args: AudioEncoderArgs, dim: int) -> int:
    """Training FLOPs of one clip through the tower (features, encoder, adaptor), counted by
    torch's ``FlopCounterMode`` over one forward and the backward that training really runs, on
    a tower built on the meta device (no memory, no compute; works for any registered family).

    Forward counts once. The backward is autograd's own, to the parameters that train: a
    trained part costs ~2x its forward again; a frozen encoder runs forward only, because
    nothing before it trains (the features have no parameters and the waveform needs no
    gradient), so the backward stops at the adaptor's input (no input gradient for its first
    layer). Attention is counted as the matmuls it is (on meta, SDPA runs as the math path's
    bmm). The clip is a full window: the encoder pads every clip to it (Whisper: 30 s), so the
    count is exact for any length. Not counted: the STFT (an FFT: FlopCounterMode has no rule
    for it; well under 0.1% of a Whisper encoder) and what ``speechlm.freeze`` freezes later (as for the
    decoder, the count follows the model's own settings, here ``freeze_encoder`` and
    ``freeze_adaptor``)."""
    with torch.device("meta"):
        tower = AudioTower(args, dim)
    window = args.window_samples
    wave = torch.zeros(1, window, device="meta")
    lengths = torch.full((1,), window, dtype=torch.long, device="meta")
    trained = [p for p in tower.parameters() if p.requires_grad]
    with FlopCounterMode(display=False) as counter, torch.enable_grad():
        out, _ = tower.encode(wave, lengths)
        if trained:
            torch.autograd.grad(out, trained, torch.ones_like(out))
    return int(counter.get_total_flops())
