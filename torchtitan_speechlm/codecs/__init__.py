"""Audio codecs behind one interface (``base.Codec``), chosen by the ``model_type`` of a codec
folder's config.json: transformers' Encodec, Mimi and DAC, the offline k-means codec, the
mel codec decoded by a HiFi-GAN vocoder, and WORLD's parametric vocoder.
Shared by preparation (encode) and generation (decode); training never loads a codec.
A new codec is one module with a class and one ``register_codec`` line (docs/extending.md)."""

from __future__ import annotations

import json
import os

from torchtitan_speechlm.codecs.base import (
    CODECS,
    Codec,
    CodecError,
    config_hash,
    register_codec,
)
from torchtitan_speechlm.codecs.streaming import (
    ChunkedStreamDecoder,
    StreamDecoder,
    add_default_decoders,
)

# registration order = the order errors list them: neural codecs first
# isort: off
from torchtitan_speechlm.codecs import transformers_codecs  # noqa: F401, E402
from torchtitan_speechlm.codecs import kmeans  # noqa: F401, E402
from torchtitan_speechlm.codecs import mel_vocoder  # noqa: F401, E402
from torchtitan_speechlm.codecs import world  # noqa: F401, E402
# isort: on

SUPPORTED_CODECS = ("encodec", "mimi", "dac")  # the transformers ones (docs, tests)


def load_codec(path: str, device: str = "cpu", num_streams: int | None = None) -> Codec:
    """Load the codec in a local directory (config.json + weights). ``num_streams=K`` keeps
    only the first K codebooks (residual quantisers are coarse-to-fine, so this is a
    lower-bitrate version of the same codec, e.g. Moshi's 8 of Mimi's 32)."""
    path = os.path.abspath(path)
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(
            f"codec directory {path} not found or has no config.json: pass a local directory "
            "holding a transformers codec saved with save_pretrained (EncodecModel, MimiModel or "
            "DacModel), a k-means codec, or a registered one"
        )
    with open(cfg_file) as f:
        config = json.load(f)
    model_type = config.get("model_type")
    if model_type not in CODECS:
        raise CodecError(
            f"{path}: unsupported codec model_type {model_type!r}; supported: "
            f"{', '.join(CODECS.names())} (register_codec adds one)"
        )
    codec = CODECS.get(model_type)(path, config, device)
    codec.total_streams = getattr(codec, "total_streams", 0) or codec.num_streams
    add_default_decoders(codec)  # decode_batch / stream_decoder for a codec without its own
    if num_streams is not None:
        if not 1 <= num_streams <= codec.total_streams:
            raise CodecError(
                f"{path}: num_streams must be in 1..{codec.total_streams} (the "
                f"codec's codebooks), got {num_streams}"
            )
        codec.keep_streams(int(num_streams))
    return codec


__all__ = [
    "CODECS",
    "SUPPORTED_CODECS",
    "ChunkedStreamDecoder",
    "Codec",
    "CodecError",
    "StreamDecoder",
    "config_hash",
    "load_codec",
    "register_codec",
]
