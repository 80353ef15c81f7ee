"""The decoding flags (``DecodingArgs``, commands/generate_args.py) as the decoder's
``DecodeConfig``: what ``generate``, ``eval`` and ``serve`` decode with (each imports this, not
another command)."""

from __future__ import annotations

from torchtitan_speechlm.commands.generate_args import DecodingArgs
from torchtitan_speechlm.generation.decode import DecodeConfig
from torchtitan_speechlm.generation.sampling import Sampling


def decode_config(a: DecodingArgs) -> DecodeConfig:
    """The ``DecodeConfig`` of the decoding flags of ``a`` (any command's ``*Args`` holding
    ``DecodingArgs``' fields)."""
    return DecodeConfig(
        text=Sampling(a.text_temperature, a.text_top_k, a.text_top_p),
        audio=Sampling(a.temperature, a.top_k, a.top_p),
        cfg_scale=a.cfg_scale,
        min_frames=a.min_frames,
        max_frames=a.max_frames,
        max_text_tokens=a.max_text_tokens,
        use_cache=not a.no_cache,
        seed=a.seed,
        best_of=a.best_of,
        compile=a.compile,
    )
