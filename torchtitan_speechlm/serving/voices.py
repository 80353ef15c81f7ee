"""``torchtitan serve --voices DIR``: the speaker prompts ``voice`` selects, read once before the
server listens (docs/serving.md *Speaker prompts*).

Each file of DIR (hidden ones aside) is one voice named by its file name without the
extension: ``alice.wav`` is ``voice="alice"``. It is read as ``generate --prompt`` reads its
file (any format libsndfile reads, any rate, any channels: resampled to the codec's rate and
downmixed), encoded and cut to the model's ``prompt_seconds`` (``tasks.speaker_prompt``), so
that a request with that voice speaks what ``generate --prompt FILE`` speaks. Anything wrong
(a model trained without prompts, a file that is not audio, two files of one name, an empty
folder, a link that leads out of the folder) is a ValueError of one line naming it: the server
does not start. A request names a voice, never a file: ``voice`` is looked up among these names
(serving/prompts.py), so ``"../x"`` or ``"/etc/passwd"`` is just a name that is not there; and a
symlink in DIR that points outside it is refused here, so that DIR is the only place voices are
read from.
"""

from __future__ import annotations

import os

from torchtitan_speechlm.generation import tasks
from torchtitan_speechlm.generation.loading import Loaded
from torchtitan_speechlm.serving.prompts import Voice
from torchtitan_speechlm.utils.audio import BadAudioError, load_audio


def voice_files(folder: str) -> dict[str, str]:
    """The voice names of ``folder`` and their files."""
    if not os.path.isdir(folder):
        raise ValueError(f"--voices {folder}: no such folder")
    files: dict[str, str] = {}
    root = os.path.realpath(folder)
    for entry in sorted(os.listdir(folder)):
        path = os.path.join(folder, entry)
        if entry.startswith(".") or not os.path.isfile(path):
            continue
        if os.path.commonpath([root, os.path.realpath(path)]) != root:
            raise ValueError(
                f"--voices {folder}: {entry} is a link to {os.path.realpath(path)}, outside the "
                "folder; copy the file into the folder instead"
            )
        name = os.path.splitext(entry)[0]
        if name in files:
            raise ValueError(
                f"--voices {folder}: {os.path.basename(files[name])} and {entry} are both "
                f"voice {name!r}; keep one"
            )
        files[name] = path
    if not files:
        raise ValueError(f"--voices {folder}: the folder holds no audio files")
    return files


def load_voices(loaded: Loaded, folder: str) -> dict[str, Voice]:
    """Every voice of ``folder`` read, encoded and cut (on this thread: before the worker
    starts, the only other user of the codec)."""
    tasks.check_prompted(loaded, "--voices")  # before reading any file: the reason comes first
    rate = loaded.codec.sample_rate
    voices = {}
    for name, path in voice_files(folder).items():
        try:
            wave = load_audio(path, rate)
        except BadAudioError as e:
            raise ValueError(
                f"--voices: {path} is not audio this server can read: {e.reason}"
            ) from None
        codes = tasks.speaker_prompt(loaded, wave, f"voice {name} ({path})", what="--voices")
        seconds = len(wave) / rate
        voices[name] = Voice(name, path, seconds, min(seconds, loaded.prompt_seconds), codes)
    return voices
