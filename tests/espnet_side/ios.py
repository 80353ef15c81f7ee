"""ESPnet SpeechLM's multimodal ios, as the tests need them.

Written from espnet/espnet ``espnet2/speechlm/model/speechlm/multimodal_io/audio.py`` (commit
0488053393837b24c12a1f00b6c77122fb2aa275), ``.../multimodal_io/text.py`` (42bce49d10d4) and
``.../multimodal_io/abs_io.py`` (3fb2101639d2). What the trainer sees of them is reproduced:
the stream intervals (each stream's pad first, then its codes), the vocabulary, ``find_length``,
``preprocess`` (zeros in the sequence, the waveform as a continuous feature) and
``encode_batch`` (frames cut to the frame shift, codes offset by their interval's start + 1,
the delay interleave filled with each stream's pad). ESPnet's codec comes from the HF hub; here
``LocalCodecModel`` puts a local codec folder of ours (k-means, Encodec, ...) behind the same three calls.
"""

from __future__ import annotations

import numpy as np
import torch


class LocalCodecModel(torch.nn.Module):
    """A codec folder of ours with the interface ESPnet's ``DiscreteAudioIO`` calls on its codec model:
    ``meta_info()``, ``encode(x [B, 1, S]) -> [streams, B, frames]`` and ``decode``."""

    def __init__(self, path: str):
        super().__init__()
        from torchtitan_speechlm.codecs import load_codec

        self.path = path
        self.codec = load_codec(path)
        self.register_buffer("anchor", torch.zeros(1), persistent=False)  # follows .to(device)

    def meta_info(self) -> dict:
        c = self.codec
        return {
            "num_streams": c.num_streams,
            "code_size_per_stream": [c.codebook_size] * c.num_streams,
            "fs": c.sample_rate,
            "frame_shift": c.samples_per_frame,
        }

    @torch.no_grad()
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        rows = [r[0].float().cpu().numpy() for r in x]
        codes = self.codec.encode(rows)  # each [frames, streams]
        out = torch.as_tensor(np.stack(codes), dtype=torch.long, device=self.anchor.device)
        return out.permute(2, 0, 1)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        batch = codes.permute(1, 2, 0).cpu().numpy()
        return torch.as_tensor(np.stack(self.codec.decode_batch(list(batch))))


class AbsIO(torch.nn.Module):
    """abs_io.py: a modality, discrete or continuous, as a torch module."""

    def __init__(self, modality: str, is_discrete: bool):
        super().__init__()
        self.modality, self.is_discrete = modality, is_discrete


class DiscreteAudioIO(AbsIO):
    """audio.py's ``DiscreteAudioIO`` with a codec only (no SSL tokenizer)."""

    def __init__(
        self,
        codec_choice: str | None = None,
        codec_hf_model_tag: str | None = None,
        codec_max_token_per_frame: int = 8,
        stream_weights: list[float] | None = None,
        delay_interleave: bool = False,
        device: str = "cpu",
        load: bool = True,
    ):
        super().__init__("audio", True)
        if codec_choice != "local":
            raise NotImplementedError(
                f"codec_choice {codec_choice!r} (tests: 'local', a codec folder of ours)"
            )
        self.codec_choice, self.codec_hf_model_tag = codec_choice, codec_hf_model_tag
        self.codec_max_token_per_frame = codec_max_token_per_frame
        self.delay_interleave, self.device_name = delay_interleave, device
        self.codec_model = LocalCodecModel(codec_hf_model_tag).to(device)
        meta = self.codec_model.meta_info()
        n = min(meta["num_streams"], codec_max_token_per_frame)
        self.codec_n_streams = n
        self.codec_vocab_size = list(meta["code_size_per_stream"][:n])
        self.sample_rate, self.frame_shift = meta["fs"], meta["frame_shift"]
        self.frame_per_second = self.sample_rate // self.frame_shift
        self.stream_weights = list(stream_weights) if stream_weights else [1.0] * n
        if len(self.stream_weights) != n:
            raise ValueError(f"{len(self.stream_weights)} stream weights for {n} streams")
        # each stream: its pad token, then its codes
        self._stream_intervals, self.vocabulary, at = [], [], 0
        for k, size in enumerate(self.codec_vocab_size):
            self._stream_intervals.append((at, at + size + 1))
            self.vocabulary += [f"<codec_layer{k}_pad>"]
            self.vocabulary += [f"<codec_layer{k}_{c}>" for c in range(size)]
            at += size + 1
        self.audio_pad = len(self.vocabulary) - 1
        if not load:
            self.codec_model = None

    def num_stream(self) -> int:
        return self.codec_n_streams

    def get_vocabulary(self) -> list[str]:
        return self.vocabulary

    def get_stream_interval(self) -> list[tuple[int, int]]:
        return self._stream_intervals

    def get_stream_weight(self) -> list[float]:
        return self.stream_weights

    def find_length(self, data) -> int:
        wav, _ = data
        frames = wav.shape[-1] // self.frame_shift
        return int(frames + (self.num_stream() - 1 if self.delay_interleave else 0))

    def preprocess(self, data):
        """Zeros in the sequence (the codes are made in the step), the waveform [samples,
        channels] as the continuous feature, the stream weights as the loss mask."""
        wav, _ = data
        length = self.find_length(data)
        ones = np.ones((length, self.num_stream()), dtype=np.int32)
        return ones * 0, (length, wav.T), ones * np.array(self.stream_weights).reshape(1, -1)

    @torch.no_grad()
    def encode_batch(self, data: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[B, samples, channels], [B] -> the io's ids [B, frames(+delay), streams]."""
        if data.dim() != 3:
            raise ValueError(f"Expected 3D tensor [batch, samples, num_channel], got {data.dim()}D")
        data = data.transpose(1, 2)
        frames = lengths // self.frame_shift
        lengths = frames * self.frame_shift
        data = data[:, :, : int(max(lengths))]
        if data.size(1) > 1:
            raise ValueError("ESPnet codec model doesn't support multi-channel audio")
        codec = self.codec_model.encode(data[:, :, : int(lengths.max())])
        codec = codec.permute(1, 2, 0)[:, :, : self.codec_n_streams]
        t = int(max(frames))
        pads = torch.tensor([s for s, _ in self._stream_intervals], device=data.device)
        codes = pads.tile(data.size(0), t, 1)
        if codec.size(1) > t:
            codec = codec[:, :t]
        elif codec.size(1) < t:  # replicate the last frame
            codec = torch.nn.functional.pad(codec, (0, 0, 0, t - codec.size(1)), mode="replicate")
        codes[:, :, :] = codec
        for k, (start, _) in enumerate(self._stream_intervals):
            codes[..., k] = codes[..., k] + start + 1
        if self.delay_interleave:
            codes = self._apply_delay_interleave(codes)
        return codes

    def _apply_delay_interleave(self, codes: torch.Tensor) -> torch.Tensor:
        b, t, n = codes.size()
        pads = torch.tensor([s for s, _ in self._stream_intervals], device=codes.device)
        out = pads.tile(b, t + self.num_stream() - 1, 1)
        for k in range(n):
            out[:, k : k + t, k] = codes[:, :, k]
        return out

    def copy_for_worker(self) -> DiscreteAudioIO:
        return DiscreteAudioIO(
            self.codec_choice,
            self.codec_hf_model_tag,
            self.codec_max_token_per_frame,
            self.stream_weights,
            self.delay_interleave,
            "cpu",
            load=False,
        )


class ContinuousAudioIO(AbsIO):
    """audio.py's ``ContinuousAudioIO`` as the data side sees it: 128-bin mel features of the
    Whisper feature extractor (Qwen2.5-Omni's) [frames, 128] in ``conti_feats``, and the
    sequence length of Qwen2.5-Omni's encoder. Its encoder (a downloaded Qwen model) is not
    reproduced: ``d_model`` stands for its output width."""

    def __init__(self, d_model: int = 32, sample_rate: int = 16000, load: bool = True):
        super().__init__("audio", False)
        from transformers import WhisperFeatureExtractor

        self.d_model, self.sample_rate = d_model, sample_rate
        self.processor = WhisperFeatureExtractor(feature_size=128, sampling_rate=sample_rate)
        self.hop_length, self.n_samples = self.processor.hop_length, self.processor.n_samples
        self.model = None

    def feature_dim(self) -> int:
        return self.d_model

    @staticmethod
    def _encoder_output_length(length):
        for k, s, p in ((3, 1, 1), (3, 2, 1), (2, 2, 0)):  # Qwen2.5-Omni's downsampling
            length = (length + 2 * p - (k - 1) - 1) // s + 1
        return length

    def find_length(self, data) -> int:
        wav, _ = data
        frames = wav.shape[-1] // self.hop_length
        frames = (frames - 1) // 2 + 1
        return int((frames - 2) // 2 + 1)

    def preprocess(self, data):
        wav, fs = data
        if fs != self.sample_rate:
            raise ValueError("Imcompatible sampling rate")
        wav = wav[0][: self.n_samples]
        out = self.processor(
            [wav], truncation=False, return_tensors="np", do_normalize=True,
            return_attention_mask=True, sampling_rate=self.sample_rate,
        )  # fmt: skip
        before = int(out["attention_mask"].sum())
        feat = out["input_features"][0, :, :before].T
        after = int(self._encoder_output_length(before))
        paddings = np.zeros((after, 1), dtype=np.int32)
        return paddings, (after, feat), paddings

    def copy_for_worker(self) -> ContinuousAudioIO:
        return ContinuousAudioIO(self.d_model, self.sample_rate)


class HuggingFaceTextIO(AbsIO):
    """text.py's ``HuggingFaceTextIO``: one stream, the tokenizer's ids with its special tokens,
    the interval [0, config vocab_size)."""

    def __init__(self, tokenizer_name: str):
        super().__init__("text", True)
        from transformers import AutoConfig, AutoTokenizer

        self.tokenizer_name = tokenizer_name
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_name, use_fast=True)
        self.vocab_size = AutoConfig.from_pretrained(tokenizer_name).vocab_size

    def preprocess(self, data: str):
        ids = self.tokenizer.encode(data, truncation=True, add_special_tokens=True)
        tokens = np.array(ids, dtype=np.int32).reshape(-1, 1)
        return tokens, None, (tokens * 0 + 1).astype(np.float32)

    def find_length(self, data: str) -> int:
        return len(self.tokenizer.encode(data, truncation=True, add_special_tokens=True))

    def copy_for_worker(self) -> HuggingFaceTextIO:
        return HuggingFaceTextIO(self.tokenizer_name)

    def num_stream(self) -> int:
        return 1

    def get_vocabulary(self) -> list[str]:
        vocab = [t for t, _ in sorted(self.tokenizer.get_vocab().items(), key=lambda x: x[1])]
        while len(vocab) < self.vocab_size:
            vocab.append(f"<unused_{len(vocab)}>")
        return vocab

    def get_stream_interval(self) -> list[tuple[int, int]]:
        return [(0, self.vocab_size)]

    def get_stream_weight(self) -> list[float]:
        return [1.0]
