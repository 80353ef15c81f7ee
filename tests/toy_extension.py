"""An extension written outside the package, as a user would (docs/extending.md): one codec,
one prepare source, one interleave pattern, one task, one backbone with its TrainSpec. Each is
a class or object plus one registration line. Loaded by `torchtitan prepare --import
tests.toy_extension` and `[experimental] custom_import = "tests.toy_extension"`."""

from __future__ import annotations

import json
import math
import os

import numpy as np
from torch import nn

import torchtitan_speechlm  # noqa: F401  (first: selects the CPU device before torchtitan)
from torchtitan_speechlm.codecs import config_hash, register_codec
from torchtitan_speechlm.data.tasks import Task, register_task
from torchtitan_speechlm.model.backbones import Backbone, register_backbone
from torchtitan_speechlm.model.patterns import Pattern, register_pattern
from torchtitan_speechlm.prepare.items import ManifestError, ManifestItem
from torchtitan_speechlm.prepare.sources import PrepareSource, SourceRead, register_source
from torchtitan_speechlm.trainer.spec import register_speechlm_spec


# ---- a codec: loudness, zero-crossing rate and slope of each 20 ms frame ------------------------
class ToneCodec:
    """3 codebooks of 16: per frame of 320 samples, quantised log-RMS, zero-crossing rate and
    mean absolute slope; decodes to a sine whose loudness and pitch follow the codes."""

    name, class_name = "toy_tone", "ToneCodec"
    sample_rate, samples_per_frame, codebook_size = 16000, 320, 16
    frame_rate = 16000 / 320

    def __init__(self, path: str, config: dict, device: str = "cpu"):
        self.path = path
        self.total_streams = self.num_streams = int(config["num_codebooks"])
        self.config_hash = config_hash(config, path)

    def keep_streams(self, n: int) -> None:
        self.num_streams = n

    def encode(self, wavs):
        out = []
        for w in wavs:
            n = math.ceil(len(w) / 320)
            x = np.zeros(n * 320, np.float32)
            x[: len(w)] = w
            f = x.reshape(n, 320)
            rms = np.sqrt((f**2).mean(1) + 1e-9)
            zcr = (np.diff(np.sign(f), axis=1) != 0).mean(1)
            slope = np.abs(np.diff(f, axis=1)).mean(1)
            feats = [np.clip((np.log10(rms) + 4) * 4, 0, 15), zcr * 15 * 4, slope * 60]
            codes = np.stack([np.clip(v, 0, 15).astype(np.int64) for v in feats], 1)
            out.append(codes[:, : self.num_streams])
        return out

    def decode(self, codes):
        codes = np.asarray(codes)
        t = np.arange(320) / 16000
        frames = [
            (10 ** (c[0] / 4 - 4)) * np.sin(2 * np.pi * (100 + 50 * c[-1]) * t) for c in codes
        ]
        return np.concatenate(frames).astype(np.float32) if frames else np.zeros(0, np.float32)


register_codec("toy_tone", ToneCodec)


def save_tone_codec(path: str, num_codebooks: int = 3) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "toy_tone", "num_codebooks": num_codebooks}, f)
    return path


# ---- a prepare source: tab-separated `id <TAB> wav path <TAB> transcript` -------------------------
def read_tsv(path: str) -> SourceRead:
    items, base = [], os.path.dirname(os.path.abspath(path))
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            parts = line.rstrip("\n").split("\t")
            if len(parts) != 3:
                raise ManifestError(f"{path}:{lineno}: expected id, path, text")
            audio = os.path.join(base, parts[1])
            items.append(ManifestItem(parts[0], audio, parts[2], lineno, f"{path}:{lineno}"))
    return SourceRead(items, {"type": "tsv"})


register_source(PrepareSource("tsv", "--tsv", "FILE", "id<TAB>wav<TAB>text lines", read_tsv))


# ---- an interleave pattern: the delay pattern mirrored (the last codebook first) --------------
@register_pattern
class ReverseDelay(Pattern):
    name = "reverse_delay"

    def num_frames(self, audio_frames, segments, num_streams):
        return audio_frames + (num_streams - 1) * segments

    def interleave(self, codes, pads):
        n, k = codes.shape
        out = np.broadcast_to(np.asarray(pads, dtype=codes.dtype), (n + k - 1, k)).copy()
        for s in range(k):
            out[k - 1 - s : k - 1 - s + n, s] = codes[:, s]
        return out

    def deinterleave(self, frames):
        k = frames.shape[1]
        n = frames.shape[0] - (k - 1)
        return np.stack([frames[k - 1 - s : k - 1 - s + n, s] for s in range(k)], axis=1)


# ---- a task: transcribe, then say it again -------------------------------------------------------
register_task(
    Task(
        "asr_then_tts",
        ("speech",),
        (("user", "audio"), ("assistant", "text"), ("assistant", "audio")),
    )
)


# ---- a backbone: residual position-wise MLP blocks (causal by construction) ---------------------
class MLPStack(nn.Module):
    def __init__(self, dim: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim)
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)

    def forward(self, h):
        for block in self.layers:
            h = h + block(h)
        return self.norm(h)


class MLPBackbone(Backbone):
    """Config: a folder with config.json {"vocab_size", "hidden_size", "num_hidden_layers"}."""

    def read_config(self, path: str) -> dict:
        file = os.path.join(path, "config.json")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"model.hf_assets_path = {path!r}: no config.json")
        with open(file) as f:
            return json.load(f)

    def build(self, config, attn_implementation):
        return MLPStack(config["hidden_size"], config["num_hidden_layers"])

    def run(self, module, inputs_embeds, position_ids, real):
        return module(inputs_embeds), None


register_backbone("toy_mlp", MLPBackbone())
register_speechlm_spec("speechlm_toy", backbone="toy_mlp")
