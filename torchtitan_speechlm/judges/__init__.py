"""Independent judges of generated speech (ASR, speaker similarity, quality) and the text
scoring that goes with ASR: ``normalise_text``, ``error_rates`` and ``item_errors``.

Importing this package registers the built-in judges without importing any of their models'
packages: each judge imports its package in its constructor (``require``), so a missing one is
a ``JudgeError`` naming the ``pip install`` line only when that judge is built. See the
"Judges" section of docs/generation.md.
"""

from __future__ import annotations

import inspect

from torchtitan_speechlm.judges import dnsmos as _dnsmos  # noqa: F401  (registers "dnsmos")
from torchtitan_speechlm.judges import pocketsphinx_asr as _pocketsphinx  # noqa: F401
from torchtitan_speechlm.judges import resemblyzer_sim as _resemblyzer  # noqa: F401
from torchtitan_speechlm.judges import transformers_asr as _transformers_asr  # noqa: F401
from torchtitan_speechlm.judges import transformers_sv as _transformers_sv  # noqa: F401
from torchtitan_speechlm.judges.base import (
    EVAL_EXTRA,
    JUDGES,
    ASRJudge,
    Judge,
    JudgeError,
    QualityJudge,
    SpeakerJudge,
    adapt_audio,
    register_judge,
    require,
)
from torchtitan_speechlm.judges.text_scoring import error_rates, item_errors, normalise_text

__all__ = [
    "EVAL_EXTRA",
    "JUDGES",
    "ASRJudge",
    "Judge",
    "JudgeError",
    "QualityJudge",
    "SpeakerJudge",
    "adapt_audio",
    "build_judge",
    "error_rates",
    "item_errors",
    "normalise_text",
    "register_judge",
    "require",
]


def build_judge(name: str, **options) -> Judge:
    """The judge registered as ``name``, built with ``options`` (its constructor's keywords).

    An unknown name lists the registered ones; an unknown option lists the judge's options,
    so a typo in an eval config fails before any model loads.
    """
    cls = JUDGES.get(name, key="judge")
    params = inspect.signature(cls).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = sorted(set(options) - set(params))
    if unknown and not takes_any:
        accepted = ", ".join(n for n in params if n != "self") or "none"
        raise JudgeError(f"judge {name!r} has no option {', '.join(unknown)}; options: {accepted}")
    return cls(**options)
