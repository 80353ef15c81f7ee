"""Speaker-prompted TTS scored as Seed-TTS-eval scores it: ``torchtitan eval --valid
tts_prompt:NAME``.

Each test item is spoken with a prompt of *another* utterance of its speaker from the same test
set (never the item itself; the next of that speaker's utterances in the set, cyclically, so the
draw is fixed). An item whose speaker has no other utterance in the set has no prompt: it is left
out and counted. The set is then scored as ``tts`` sets are (evaluation/tts_scores.py: WER by the
independent ASR judge, SIM to the reference, ...) and, by the speaker judge:

- ``sim_prompt``: SIM(generated, its prompt, as the model heard it: cut to ``prompt_seconds`` and
  resynthesised by the codec);
- ``sim_other``: SIM(generated, every other speaker of the set), each speaker enrolled as the mean
  embedding of its utterances' prompts;
- ``speaker_id_accuracy``: the share of items whose generated voice's nearest enrolled speaker
  is its own (the prompt's).

The prompts as heard (``heard_prompts``) are decoded once, by ``tts_scores.score_tts``, for both
the speaker judge and ``--report`` (which plays them beside the reference and generated audio):
what the listener hears is exactly what was scored.
"""

from __future__ import annotations

import numpy as np

from torchtitan_speechlm.data.catalog import open_prepared, split_indices
from torchtitan_speechlm.generation import tasks
from torchtitan_speechlm.generation.loading import Loaded
from torchtitan_speechlm.judges.base import JudgeError


def prompted_set(path: str, valid_fraction: float, limit: int) -> dict:
    """The items of the prepared set ``path`` to score (those held out with ``valid_fraction``,
    or all), each with its prompt item and speaker: ``{"items", "prompts", "speakers" (an int
    per item), "skipped" (items without a second utterance of their speaker)}``."""
    ds = open_prepared(path)
    if not ds.has_speakers:
        raise ValueError(
            f"{path}: tts_prompt sets need speaker labels, and this prepared set has none "
            "(prepare it from a source with speakers: docs/data.md)"
        )
    split = "valid" if valid_fraction > 0 else "all"
    idx = [int(i) for i in split_indices(ds, valid_fraction, split) if ds.kinds[i] == "speech"]
    by_speaker: dict[int, list[int]] = {}
    for i in idx:
        by_speaker.setdefault(int(ds.speaker_of(i)), []).append(i)
    chosen, prompts, skipped = [], [], 0
    for i in idx:
        same = by_speaker[int(ds.speaker_of(i))]
        if len(same) < 2:
            skipped += 1
            continue
        chosen.append(i)
        prompts.append(same[(same.index(i) + 1) % len(same)])
    if limit:
        chosen, prompts = chosen[:limit], prompts[:limit]
    if not chosen:
        raise ValueError(f"{path}: no speaker has two utterances in the set: nothing to prompt")
    return {
        "items": [ds[i] for i in chosen],
        "prompts": [ds[j] for j in prompts],
        "speakers": [int(ds.speaker_of(i)) for i in chosen],
        "skipped": skipped,
    }


def heard_prompts(loaded: Loaded, prompt_codes: list) -> list[np.ndarray]:
    """Each prompt as the model heard it: its codes cut to ``prompt_seconds`` (as training and
    ``generate --prompt`` cut them), resynthesised by the codec. SIM to the prompt is measured
    against this, not the full recording, since this is all the model was given."""
    return tasks.decode_audio(loaded, [loaded.builder.cut_prompt(c) for c in prompt_codes])


def speaker_scores(
    loaded: Loaded,
    spk,
    generated: list,
    prompt_codes: list,
    speakers: list[int],
    heard: list | None = None,
) -> dict:
    """``sim_prompt``, ``sim_other`` and ``speaker_id_accuracy`` (the module docstring) from the
    generated waveforms (None where there is none) and the prompts' codes; ``heard``: those
    prompts already decoded by ``heard_prompts`` (``score_tts`` decodes them once for the judge
    and the report), else decoded here."""
    rate = int(loaded.codec.sample_rate)
    if heard is None:
        heard = heard_prompts(loaded, prompt_codes)
    prompt_emb = [_unit(spk.embed(w, rate)) for w in heard]
    names = sorted(set(speakers))
    enrolled = np.stack(
        [
            _unit(np.mean([e for e, s in zip(prompt_emb, speakers, strict=True) if s == n], 0))
            for n in names
        ]
    )
    per_item, own_sims, other_sims, correct = [], [], [], []
    for wav, emb, s in zip(generated, prompt_emb, speakers, strict=True):
        failure = "no audio generated" if wav is None or not len(wav) else None
        if failure is None:
            try:
                g = _unit(spk.embed(wav, rate))
            except JudgeError as e:  # e.g. no speech in the clip: this item's failure
                failure = str(e)
        if failure is not None:  # no voice to compare: SIM unknown, not identified
            per_item.append({"sim_prompt": None, "speaker_id_correct": False, "failure": failure})
            correct.append(False)
            continue
        sims = enrolled @ g
        own = names.index(s)
        sim_prompt = float(emb @ g)
        others = [float(x) for k, x in enumerate(sims) if k != own]
        own_sims.append(sim_prompt)
        other_sims += others
        correct.append(int(np.argmax(sims)) == own)
        per_item.append({"sim_prompt": sim_prompt, "speaker_id_correct": correct[-1]})
    return {
        "speakers": len(names),
        "sim_prompt": float(np.mean(own_sims)) if own_sims else None,
        "sim_other": float(np.mean(other_sims)) if other_sims else None,
        "speaker_id_accuracy": float(np.mean(correct)) if correct else None,
        "per_item": per_item,
    }


def _unit(v) -> np.ndarray:
    v = np.asarray(v, dtype=np.float64).reshape(-1)
    return v / max(float(np.linalg.norm(v)), 1e-12)
