"""A flatten SpeechLM's decoding masks as a vLLM v1 logits processor: ``FlattenAudioMask``.

Standalone: the standard library, torch and vLLM only (it runs in vLLM's environment, imported
as the top-level module ``speechlm_vllm_mask`` with its folder on ``PYTHONPATH``: this one, or
the exported model's folder, where generation/vllm_export.py writes a copy). vLLM builds it once per engine (``--logits-processors
speechlm_vllm_mask:FlattenAudioMask``); it reads the model folder's ``speechlm_layout.json``
(written by ``generation/vllm_export.py``) and acts on the requests that ask for it through
``vllm_xargs`` (the completions API's per-request ``extra_args``, scalar values):

- ``speechlm_audio_min_frames: M``: an audio turn. Output step t may pick only codebook
  ``k = t % N``'s codes and, where ``k == 0`` and ``t // N >= M``, also the end ids (our
  decoder's masks: generation/decode.py; ``vllm_export.audio_allowed`` states the same);
- ``speechlm_text: 1``: a text turn: the text ids and the end ids (one range, not a list of
  every text id in each request as ``allowed_token_ids`` would send);
- ``speechlm_probe: 1``: output step t may pick only ``probe_ids(note)[t]``, a sequence derived
  from the layout's fingerprint and ending in an end id; the server checks at start-up that it
  comes back as computed from its own layout, which proves this processor is loaded and reads
  the same layout (``vllm_xargs`` a processor does not know are ignored silently).

Other requests are untouched. The masks are not argmax-invariant, so vLLM applies them before
greedy sampling too.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch

try:
    from vllm.v1.sample.logits_processor import LogitsProcessor
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates
except ImportError:  # outside vLLM (this repository's tests): the masks without the interface
    LogitsProcessor = object  # type: ignore[assignment,misc]
    process_dict_updates = None

NOTE_FILE = "speechlm_layout.json"  # generation/vllm_export.py NOTE_FILE
AUDIO = "speechlm_audio_min_frames"
TEXT = "speechlm_text"
PROBE = "speechlm_probe"
KEYS = (AUDIO, TEXT, PROBE)


def probe_ids(note: dict) -> list[int]:
    """One frame of codes (codebook k at step k, each code drawn from a hash of the layout's
    fingerprint and k) and the first end id: what a ``speechlm_probe`` request returns."""
    ids = []
    for k, first in enumerate(note["codebook_first_ids"]):
        digest = hashlib.sha256(f"{note['vocab_fingerprint']}:{k}".encode()).digest()
        ids.append(first + int.from_bytes(digest[:4], "big") % note["codebook_size"])
    return ids + [note["end_ids"][0]]


def request_mode(extra_args: dict | None) -> tuple[str, int] | None:
    """A request's mode and its argument, or None (not ours). Raises ValueError (vLLM answers
    400) for a malformed value or more than one mode."""
    given = [k for k in KEYS if (extra_args or {}).get(k) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"vllm_xargs: give one of {', '.join(KEYS)}, not {', '.join(given)}")
    value = extra_args[given[0]]
    if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
        raise ValueError(f"vllm_xargs {given[0]}: an integer, not {value!r}")
    if value < 0:
        raise ValueError(f"vllm_xargs {given[0]}: at least 0, not {value}")
    return given[0], int(value)


class FlattenAudioMask(LogitsProcessor):
    """The masks above over vLLM's persistent batch (rows added, removed, moved between steps:
    ``process_dict_updates``)."""

    def __init__(self, vllm_config, device, is_pin_memory: bool = False) -> None:
        with open(os.path.join(vllm_config.model_config.model, NOTE_FILE)) as f:
            note = json.load(f)
        self._setup(note, vllm_config.model_config.get_vocab_size(), device)

    @classmethod
    def from_note(cls, note: dict, vocab: int, device="cpu") -> FlattenAudioMask:
        """The processor without vLLM's config (tests)."""
        self = cls.__new__(cls)
        self._setup(note, vocab, device)
        return self

    def _setup(self, note: dict, vocab: int, device) -> None:
        self.note, self.n = note, note["num_streams"]
        size = note["codebook_size"]
        self.codebook = torch.zeros(self.n, vocab, dtype=torch.bool, device=device)
        for k, first in enumerate(note["codebook_first_ids"]):
            self.codebook[k, first : first + size] = True
        self.end = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.end[note["end_ids"]] = True
        self.first_or_end = self.codebook[0] | self.end  # a frame's first step, past min_frames
        self.text = self.end.clone()
        self.text[note["text_ids"][0] : note["text_ids"][1]] = True
        self.probe = torch.zeros(len(probe_ids(note)), vocab, dtype=torch.bool, device=device)
        for t, i in enumerate(probe_ids(note)):
            self.probe[t, i] = True
        # batch row -> (mode, its argument, the request's output ids: vLLM's live list)
        self.rows: dict[int, tuple[str, int, list[int]]] = {}

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        request_mode(sampling_params.extra_args)

    def is_argmax_invariant(self) -> bool:
        return False  # it decides which ids greedy may pick

    @staticmethod
    def _state(params, _prompt, outputs):
        mode = request_mode(params.extra_args)
        return None if mode is None else (*mode, outputs)

    def update_state(self, batch_update) -> None:
        process_dict_updates(self.rows, batch_update, self._state)

    def allowed(self, mode: str, arg: int, step: int) -> torch.Tensor:
        """The ids output step ``step`` of a ``mode`` request may pick: a [vocab] bool mask."""
        if mode == TEXT:
            return self.text
        if mode == PROBE:
            return self.probe[min(step, len(self.probe) - 1)]
        k = step % self.n
        if k == 0 and step // self.n >= arg:
            return self.first_or_end
        return self.codebook[k]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        rows = sorted(self.rows)
        allowed = torch.stack(
            [self.allowed(mode, arg, len(out)) for mode, arg, out in map(self.rows.get, rows)]
        )
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
        return logits
