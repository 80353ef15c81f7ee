"""The wavs of one TTS item written for ``torchtitan eval --report``: the generated speech, the
reference's resynthesis and the original recording as the judges heard it, under
``root/sub/NNNN-ID.{gen,ref,rec}.wav``; for a speaker-prompted item also its prompt as the model
heard it and the prompt's original recording, ``NNNN-ID.{prompt,prompt-rec}.wav``.

The report page links them by these paths, relative to its folder, so the names are stable
(the item's place in its set, then its id made safe for a file name) and nothing here knows
about scoring.
"""

from __future__ import annotations

import os
import re

import numpy as np

# kinds whose first three letters would collide (prompt, prompt_recording) are named in full
SUFFIXES = {"prompt": "prompt", "prompt_recording": "prompt-rec"}


def save_item_wavs(root: str, sub: str, i: int, it, wavs: dict, rate: int) -> dict:
    """``{kind: path relative to root}`` of each of ``wavs`` (``{kind: waveform or None}``)
    written as ``sub/NNNN-ID.SUFFIX.wav`` (``SUFFIXES``, else the kind's first three letters);
    None where there is no waveform."""
    stem = os.path.join(sub, _safe_name(i, it.id))
    return {
        kind: (
            _write_wav(root, f"{stem}.{SUFFIXES.get(kind, kind[:3])}.wav", wav, rate)
            if wav is not None
            else None
        )
        for kind, wav in wavs.items()
    }


def _safe_name(i: int, item_id: str) -> str:
    return f"{i:04d}-" + (re.sub(r"[^A-Za-z0-9._-]+", "_", item_id)[:60] or "item")


def _write_wav(root: str, rel: str, wav: np.ndarray, rate: int) -> str:
    import soundfile as sf

    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    sf.write(path, np.asarray(wav, dtype=np.float32), rate)
    return rel
