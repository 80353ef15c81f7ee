"""Generation prompts, laid out exactly as the training template lays out an example
(``TemplateBuilder.build``): ``<bos>``, every complete turn, then the opening of the turn to
generate. A model so sees at generation time the frames it was trained on."""

from __future__ import annotations

import numpy as np

from torchtitan_speechlm.data.template_pieces import (
    MODALITY_TOKENS,
    ROLE_TOKENS,
    Segment,
    TemplatePieces,
    turn_end,
)


def prompt_frames(
    pieces: TemplatePieces,
    segments: list[Segment],
    role: str,
    modality: str,
    continuous: bool = False,
) -> tuple[np.ndarray, list[tuple[int, np.ndarray]]]:
    """The prompt's frames, opening a ``role``/``modality`` turn after ``segments``; with
    ``continuous`` the audio turns are waveforms (laid out as placeholder frames) and their
    segments ``(first frame, wave)`` come with it."""
    sp = pieces.layout.special
    parts, waves, at = [pieces.tokens([sp("<|bos|>")], False)[0]], [], 1
    for i, seg in enumerate(segments):
        opening = [sp(ROLE_TOKENS[seg.role]), sp(MODALITY_TOKENS[seg.modality])]
        parts.append(pieces.tokens(opening, False)[0])
        tokens = np.asarray(seg.tokens)
        if seg.modality == "text":
            parts.append(pieces.tokens(pieces.layout.text_offset + tokens, False)[0])
        elif continuous:
            if tokens.ndim != 1:
                raise ValueError("a continuous audio turn is a waveform [samples], not codes")
            waves.append((at + 2, tokens))
            parts.append(pieces.placeholders(len(tokens))[0])
        else:
            parts.append(pieces.audio(tokens, False)[0])
        following = segments[i + 1].role if i + 1 < len(segments) else role
        parts.append(pieces.tokens([sp(turn_end(pieces.chat_template, seg.role, following))],
                                   False)[0])  # fmt: skip
        at += sum(len(p) for p in parts[-3:])
    parts.append(pieces.tokens([sp(ROLE_TOKENS[role]), sp(MODALITY_TOKENS[modality])], False)[0])
    return np.concatenate(parts), waves
