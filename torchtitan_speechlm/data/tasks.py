"""Tasks and their templates: a prepared item becomes model frames [L, N] with per-stream loss
weights.

Every frame has N streams. A special/text frame puts its token in stream 0 and each other
stream's pad in stream k; audio is interleaved into frames by the pattern (``model/patterns.py``),
one segment at a time, so pattern padding never crosses a segment or sample boundary.

Chat-style template, one block per turn:  <|role|><|modality|> content <|eot|>
    tts:           <bos> [user text] [assistant audio] <eos>
    tts_prompt:    <bos> [user audio: speaker prompt] [user text] [assistant audio] <eos>
                   the prompt: the codes of another utterance of the item's speaker, cut to
                   speechlm.prompt_seconds (data/speaker_prompts.py draws it); an item whose
                   speaker has no other utterance in the split is laid out as tts
    asr:           <bos> [user audio] [assistant text] <eos>
    continuation:  <bos> [assistant audio] <eos>        (speech LM on audio alone)
    text:          <bos> [assistant text] <eos>         (text LM)
    dialogue:      <bos> [turn] [turn] ... <eos>        (roles and modalities from the data)
    tts_pref:      two tts documents of a preference item, its prompt with the chosen answer
                   and with the rejected one, side by side in one row (data/pairs.py)
    asr_pref:      the same for asr (user audio, chosen / rejected assistant text)
    tts_prompt_pref: the same for tts_prompt (the pair's own speaker prompt and text, chosen /
                   rejected assistant audio)
    asr_wave:      asr, its audio the waveform through the audio encoder (continuous)
    dialogue_wave: dialogue, its one (user/system) audio turn the waveform (continuous): spoken
                   question answering and other audio-conditioned text tasks
The last turn closes with <eos> instead of <eot>. Loss is on the task's loss roles (assistant:
from their modality tag through <eot>/<eos>) or, with loss_region = "all", on every frame after
<bos>. A target that is a stream's pad never carries loss, so pattern padding is never "learned",
except stream 0's first pad after its last code in a delayed segment: it marks the end of
codebook 0, the one decision about the audio's length generation has to make.

Classifier-free-guidance dropout (TTS, training only): the user text is replaced by a single
<|cfg_drop|> token, so the model also learns the unconditional distribution.

A task is one ``Task`` row registered with ``register_task`` (docs/extending.md). The frames of
each piece of a template are ``data/template_pieces.py``'s, generation prompts ``data/prompt.py``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import get_args

import numpy as np

from torchtitan_speechlm.config import ConfigError, LossRegion
from torchtitan_speechlm.data.format import KINDS, MODALITIES, PREFERENCE, ROLES
from torchtitan_speechlm.data.prompt import prompt_frames
from torchtitan_speechlm.data.template_pieces import (
    MODALITY_TOKENS,
    ROLE_TOKENS,
    Segment,
    TemplatePieces,
    turn_end,
)
from torchtitan_speechlm.model.patterns import get_pattern
from torchtitan_speechlm.model.vocab import VocabLayout
from torchtitan_speechlm.utils.registry import Registry

LOSS_REGIONS = get_args(LossRegion)


@dataclass(frozen=True)
class Task:
    """One row of the task table.

    ``turns``: (role, modality) of each turn, filled from the item's text (text turns) and
    codes (audio turns); None = the item's own turns (dialogue items). ``cfg_turn``: index of
    the text turn that CFG dropout replaces. ``loss_roles``: roles whose turns carry loss
    (``loss_region = "all"``: every turn)."""

    name: str
    kinds: tuple[str, ...]
    turns: tuple[tuple[str, str], ...] | None
    cfg_turn: int | None = None
    loss_roles: tuple[str, ...] = ("assistant",)
    continuous: bool = False
    """Audio turns are the item's waveform through the audio encoder (model/audio/tower.py):
    placeholder frames whose embeddings the adaptor replaces, never with loss."""
    prompt_turn: int | None = None
    """Index of the audio turn holding a speaker prompt: the codes of another utterance of the
    item's speaker (a draw's ``prompt``), cut to ``TemplateBuilder.max_prompt_frames``. A
    draw without a prompt (the speaker has no other utterance) leaves the turn out."""
    pair_of: str | None = None
    """A preference task: its example is two documents of task ``pair_of`` laid out by that
    task's template, the item's prompt with its chosen answer and with its rejected one
    (items of kind ``preference``: turns prompt..., chosen, rejected). The base task has fixed
    turns, one text and one codec audio turn besides its speaker prompt, if any (the pair
    holds its own), the last one, the answer, the only one with loss, so a pair's length comes
    from the index (``TemplateBuilder.length``). No CFG dropout, no drawn speaker prompt."""

    def __post_init__(self) -> None:
        bad = [k for k in self.kinds if k not in KINDS]
        if bad or not self.kinds:
            raise ValueError(f"task {self.name!r}: kinds {self.kinds} must be among {KINDS}")
        for role, modality in self.turns or ():
            if role not in ROLES or modality not in MODALITIES:
                raise ValueError(
                    f"task {self.name!r}: bad turn ({role!r}, {modality!r}); "
                    f"roles {ROLES}, modalities {MODALITIES}"
                )
        if self.cfg_turn is not None and (
            self.turns is None or self.turns[self.cfg_turn][1] != "text"
        ):
            raise ValueError(f"task {self.name!r}: cfg_turn must index a text turn")
        if self.prompt_turn is not None and (
            self.turns is None or self.continuous or self.turns[self.prompt_turn][1] != "audio"
        ):
            raise ValueError(f"task {self.name!r}: prompt_turn must index a codec audio turn")
        if self.pair_of is not None:
            _check_pair_task(self)

    def count(self, modality: str) -> int:
        return sum(m == modality for _, m in self.turns or ())

    @property
    def prompted(self) -> bool:
        """Whether the task's examples carry a speaker prompt drawn from another item."""
        return self.prompt_turn is not None

    @property
    def prompt_budget(self) -> bool:
        """Whether the task's examples carry a speaker prompt cut to ``prompt_seconds``: a
        prompted task's (drawn), or a preference pair's of one (the pair's own)."""
        return self.prompted or (self.pair_of is not None and TASKS.get(self.pair_of).prompted)


def _check_pair_task(task: Task) -> None:
    """A preference task mirrors a registered base task of fixed turns: besides its speaker
    prompt turn, if any, one text and one codec audio turn, the last one (the answer) the only
    one with loss (the layout ``build_pair`` and ``length`` assume); its examples carry no CFG
    drop, no drawn speaker prompt, no continuous audio."""
    base = TASKS.get(task.pair_of, f"task {task.name!r} pair_of")
    turns = list(base.turns or ())
    content = [m for i, (_, m) in enumerate(turns) if i != base.prompt_turn]
    base_ok = (
        len(turns) >= 2
        and sorted(content) == ["audio", "text"]
        and base.prompt_turn != len(turns) - 1
        and [r in base.loss_roles for r, _ in turns] == [False] * (len(turns) - 1) + [True]
        and not (base.continuous or base.pair_of)
    )
    mirrors = (task.turns, task.loss_roles, task.kinds) == (
        base.turns,
        base.loss_roles,
        (PREFERENCE,),
    )
    plain = task.cfg_turn is None and task.prompt_turn is None and not task.continuous
    if not (base_ok and mirrors and plain):
        raise ValueError(
            f"task {task.name!r}: a preference task takes kind {PREFERENCE!r} items and the "
            f"turns and loss roles of its base {base.name!r}, with no cfg, prompt or continuous "
            "turn; the base has fixed codec turns, one text and one audio besides a speaker "
            "prompt, the last one, the answer, the only one with loss"
        )


TASKS: Registry[Task] = Registry("task")


def register_task(task: Task) -> Task:
    return TASKS.register(task.name, task)


for _task in (
    Task("tts", ("speech",), (("user", "text"), ("assistant", "audio")), cfg_turn=0),
    Task(
        "tts_prompt",
        ("speech",),
        (("user", "audio"), ("user", "text"), ("assistant", "audio")),
        cfg_turn=1,
        prompt_turn=0,
    ),
    Task("asr", ("speech",), (("user", "audio"), ("assistant", "text"))),
    Task("continuation", ("speech", "audio"), (("assistant", "audio"),)),
    Task("text", ("speech", "text"), (("assistant", "text"),)),
    Task("dialogue", ("dialogue",), None),
    Task("asr_wave", ("speech",), (("user", "audio"), ("assistant", "text")), continuous=True),
    Task("dialogue_wave", ("dialogue",), None, continuous=True),
):
    register_task(_task)
PAIR_BASES = ("tts", "asr", "tts_prompt")  # the tasks with preference pairs (data/pairs.py)
for _base in PAIR_BASES:
    register_task(Task(f"{_base}_pref", (PREFERENCE,), TASKS.get(_base).turns, pair_of=_base))


def pair_layout(base: str) -> tuple[tuple[str, ...], str]:
    """A preference item's layout for pairs of task ``base`` (the one prepare writes and
    ``build_pair`` reads): its prompt turns' modalities in order, then the answers'
    modality (the item's turns: the prompt's, chosen, rejected)."""
    turns = TASKS.get(f"{base}_pref", "a preference task").turns
    return tuple(m for _, m in turns[:-1]), turns[-1][1]


def get_task(name: str, key: str = "speechlm_data.train") -> Task:
    return TASKS.get(name, key)


@dataclass(frozen=True)
class LossWeights:
    text: float
    audio: float
    streams: tuple[float, ...]  # sums to 1

    @classmethod
    def from_config(cls, speechlm, num_streams: int) -> LossWeights:
        """``[speechlm]``'s ``text_weight``, ``audio_weight`` and ``stream_weights`` (one per
        codec stream, normalised to sum 1; empty: uniform), checked here."""
        weights = list(speechlm.stream_weights)
        if any(w < 0 for w in weights) or (weights and sum(weights) <= 0):
            raise ConfigError("speechlm.stream_weights must be >= 0 with a positive sum")
        if weights and len(weights) != num_streams:
            raise ConfigError(
                f"speechlm.stream_weights has {len(weights)} values but the codec has "
                f"{num_streams} streams; give {num_streams} values or leave it empty (uniform)."
            )
        for key in ("text_weight", "audio_weight"):
            if getattr(speechlm, key) < 0:
                raise ConfigError(f"speechlm.{key} must be >= 0")
        return cls(
            speechlm.text_weight,
            speechlm.audio_weight,
            tuple(normalised_stream_weights(weights, num_streams)),
        )


def normalised_stream_weights(weights: list[float], n: int) -> list[float]:
    """Per-stream weights summing to 1 (empty: uniform over ``n`` streams)."""
    w = list(weights) if weights else [1.0] * n
    total = sum(w)
    return [x / total for x in w]


@dataclass
class Example:
    frames: np.ndarray  # int64 [L, N]
    weights: np.ndarray  # float32 [L, N]: weight of predicting frames[j] from frames[:j]
    continuous: list[tuple[int, np.ndarray]] = field(default_factory=list)
    """(first frame, int16 waveform) of each continuous segment (its frames are placeholders)."""

    @property
    def documents(self) -> tuple[Example, ...]:
        """The documents the example places in a row, each with its own positions: itself."""
        return (self,)


def item_wave(item, task: str) -> np.ndarray:
    """The item's stored waveform, which a continuous task reads instead of its codes."""
    if getattr(item, "wave", None) is None:
        raise ValueError(
            f"item {item.id!r}: task {task!r} needs its waveform, and its dataset has none "
            "(add them: python -m torchtitan_speechlm.prepare.waveforms)"
        )
    return item.wave


def continuous_turn(segs: list[Segment], item, task: str) -> list[Segment]:
    """A dialogue's turns with its one audio turn read as the item's waveform (the waveform
    store keeps one recording per item, so a continuous dialogue has exactly one audio turn,
    and it is an input: a user or system turn, as the question of spoken QA is)."""
    audio = [i for i, s in enumerate(segs) if s.modality == "audio"]
    if len(audio) != 1 or segs[audio[0]].role == "assistant":
        raise ValueError(
            f"item {item.id!r}: task {task!r} takes dialogues with exactly one audio turn, a "
            f"user or system turn (its input); this one has {len(audio)} audio turns"
            + (", spoken by the assistant" if audio and segs[audio[0]].role == "assistant" else "")
            + " (use task 'dialogue' for codec-token audio turns)"
        )
    out = list(segs)
    out[audio[0]] = Segment(segs[audio[0]].role, "audio", item_wave(item, task))
    return out


class TemplateBuilder:
    """A run's templates: a prepared item becomes a task's example (frames and loss weights,
    ``build``), its length comes from the index alone (``length``, for budgeting: it mirrors
    ``build``), and generation prompts are laid out as ``build`` lays out a training example."""

    def __init__(
        self,
        layout: VocabLayout,
        pattern: str,
        weights: LossWeights,
        loss_region: str = "assistant",
        continuous_frames: Callable | None = None,
        max_prompt_frames: int = 0,
        chat_template: str = "ours",
    ):
        """``continuous_frames``: LM frames of a continuous segment of ``n`` samples (ints or
        numpy arrays; the run's AudioEncoderArgs.output_frames), None without an encoder.
        ``max_prompt_frames``: codec frames a speaker prompt is cut to (``prompt_seconds`` x
        the codec's frame rate); 0: the run has no prompted task. ``chat_template``: how a
        turn ends before the next (template_pieces.py's ``turn_end``)."""
        if loss_region not in LOSS_REGIONS:
            raise ValueError(f"loss_region must be one of {LOSS_REGIONS}, got {loss_region!r}")
        self.layout = layout
        self.pattern = get_pattern(pattern)
        self.w = weights
        self.loss_region = loss_region
        self.continuous_frames = continuous_frames
        self.max_prompt_frames = int(max_prompt_frames)
        self.pieces = TemplatePieces(
            layout, self.pattern, weights.text, weights.audio, weights.streams, continuous_frames,
            chat_template,
        )  # fmt: skip

    def segments(self, task: str, item, cfg_drop: bool = False, prompt=None) -> list[Segment]:
        """The turns a task makes of a prepared item (``prompt``: the prepared item whose codes
        fill a prompted task's prompt turn; None: the turn is left out)."""
        spec = get_task(task)
        if spec.turns is None:
            turns = getattr(item, "turns", None)
            if not turns:
                raise ValueError(f"item {item.id!r} has no dialogue turns")
            segs = [Segment(t.role, t.modality, t.tokens) for t in turns]
            return continuous_turn(segs, item, task) if spec.continuous else segs
        drop = np.array([self.layout.special("<|cfg_drop|>") - self.layout.text_offset])
        out = []
        for i, (role, modality) in enumerate(spec.turns):
            if i == spec.prompt_turn:
                if prompt is not None:
                    out.append(Segment(role, modality, self.cut_prompt(prompt.audio_codes)))
                continue
            if modality == "audio" and spec.continuous:
                tokens = item_wave(item, task)
            elif modality == "audio":
                tokens = item.audio_codes
            else:
                tokens = drop if cfg_drop and i == spec.cfg_turn else item.text_tokens
            out.append(Segment(role, modality, np.asarray(tokens)))
        return out

    def require_prompt_budget(self) -> None:
        """Refuse a speaker prompt in a run without a prompt budget."""
        if self.max_prompt_frames <= 0:
            raise ValueError(
                "a speaker-prompted task in a run without a prompt budget: set "
                "speechlm.prompt_seconds > 0"
            )

    def cut_prompt(self, codes) -> np.ndarray:
        """A speaker prompt's codes [F, N], cut to its first ``max_prompt_frames``."""
        self.require_prompt_budget()
        return np.asarray(codes)[: self.max_prompt_frames]

    def prompt_length(self, n_prompt_frames):
        """Frames a speaker-prompt turn of ``n_prompt_frames`` codec frames (before the cut;
        ints or numpy arrays) adds to an example: its role, modality and end tokens and its
        interleaved codes."""
        n = np.minimum(n_prompt_frames, self.max_prompt_frames)
        return 3 + self.pattern.num_frames(n, 1, self.layout.num_streams)

    def prefix(self, segments: list[Segment], role: str, modality: str) -> np.ndarray:
        """Frames of a generation prompt: ``<bos>``, every complete turn, then the opening of
        the turn to generate (``<|role|><|modality|>``), exactly as ``build`` lays them out."""
        return self.prompt(segments, role, modality)[0]

    def continuous_prefix(
        self, wave: np.ndarray, role: str, modality: str
    ) -> tuple[np.ndarray, list[tuple[int, np.ndarray]]]:
        """A generation prompt whose one user turn is continuous audio (``asr_wave``), laid out
        as ``build`` does, and its segment ``(first frame, wave)``."""
        return self.prompt([Segment("user", "audio", wave)], role, modality, continuous=True)

    def prompt(
        self, segments: list[Segment], role: str, modality: str, continuous: bool = False
    ) -> tuple[np.ndarray, list[tuple[int, np.ndarray]]]:
        """``prefix`` for any turns; with ``continuous`` the audio turns are waveforms (laid
        out as placeholder frames) and their segments ``(first frame, wave)`` come with it."""
        return prompt_frames(self.pieces, segments, role, modality, continuous)

    def build(self, task: str, item, cfg_drop: bool = False, prompt=None) -> Example:
        lay, pieces = self.layout, self.pieces
        sp = lay.special
        spec = get_task(task)
        if spec.pair_of is not None:
            raise ValueError(f"task {task!r} makes pairs of documents (data/pairs.py)")
        segs = self.segments(task, item, cfg_drop, prompt)
        parts = [pieces.tokens([sp("<|bos|>")], False)]
        continuous = []
        for i, seg in enumerate(segs):
            if seg.role not in ROLE_TOKENS or seg.modality not in MODALITY_TOKENS:
                raise ValueError(f"bad turn role/modality {seg.role!r}/{seg.modality!r}")
            loss = self.loss_region == "all" or seg.role in spec.loss_roles
            parts.append(pieces.tokens([sp(ROLE_TOKENS[seg.role])], self.loss_region == "all"))
            parts.append(pieces.tokens([sp(MODALITY_TOKENS[seg.modality])], loss))
            if seg.modality == "text":
                parts.append(pieces.tokens(lay.text_offset + np.asarray(seg.tokens), loss))
            elif spec.continuous:
                continuous.append((sum(len(p[0]) for p in parts), seg.tokens))
                parts.append(pieces.placeholders(len(seg.tokens)))
            else:
                parts.append(pieces.audio(np.asarray(seg.tokens), loss))
            end = turn_end(pieces.chat_template, seg.role,
                           segs[i + 1].role if i + 1 < len(segs) else None)  # fmt: skip
            parts.append(pieces.tokens([sp(end)], loss))
        return Example(
            frames=np.concatenate([p[0] for p in parts]),
            weights=np.concatenate([p[1] for p in parts]),
            continuous=continuous,
        )

    def length(
        self, task: str, n_text, n_audio_frames, n_audio_turns=1, n_turns=2, cfg_drop: bool = False
    ):
        """Frames an example will take, from index lengths alone (for budgeting); ints or numpy
        arrays. ``n_audio_turns``/``n_turns`` are read only for tasks taking the item's turns.
        A prompted task's length is without its prompt turn (``prompt_length`` adds it)."""
        spec = get_task(task)
        if spec.pair_of is not None:
            return self.pair_length(spec, n_text, n_audio_frames)
        if spec.turns is not None:
            n_turns, n_audio_turns = len(spec.turns), spec.count("audio")
            if spec.prompted:
                n_turns, n_audio_turns = n_turns - 1, n_audio_turns - 1
            n_text_total = spec.count("text") * n_text
            if cfg_drop and spec.cfg_turn is not None:
                n_text_total = n_text_total - n_text + 1
            n_audio_frames = n_audio_turns * n_audio_frames
        else:
            n_text_total = n_text
        if spec.continuous:  # n_audio_frames: waveform samples of the (one) audio turn
            if self.continuous_frames is None:
                self.pieces.placeholders(0)  # the error
            audio = np.asarray(self.continuous_frames(n_audio_frames), dtype=np.int64)
            audio = int(audio) if audio.ndim == 0 else audio
        else:
            audio = self.pattern.num_frames(n_audio_frames, n_audio_turns, self.layout.num_streams)
        return 1 + 3 * n_turns + n_text_total + audio

    def pair_length(self, spec: Task, n_text, n_audio_frames):
        """A preference pair's length as one sample (both documents' frames less one: the
        pair fills ``len(chosen) - 1 + len(rejected) - 1`` input positions) from its index
        lengths: the prompt is in both documents, each answer in one. A speaker prompt (a
        ``tts_prompt`` pair's) is cut to ``max_prompt_frames`` in each document and the index
        has only the pair's total frames, so its length is budgeted as if the prompt had
        exactly ``max_prompt_frames`` ``M``: a prompt of ``P`` frames takes ``2 min(P, M)``
        of the pair's frames and ``P`` of the total, so the budget is exact for ``P = M`` (what
        ``eval --pairs`` writes: the prompt as the model heard it, unless its utterance is
        shorter than the budget) and over by ``|P - M|`` otherwise, never under."""
        base = get_task(spec.pair_of)
        answer = spec.turns[-1][1]
        text = n_text * (1 if answer == "text" else 2)
        frames = n_audio_frames * (1 if answer == "audio" else 2)
        segments = 2 * spec.count("audio")
        if base.prompted:
            self.require_prompt_budget()
            frames = frames + self.max_prompt_frames
        audio = self.pattern.num_frames(frames, segments, self.layout.num_streams)
        return 2 * (1 + 3 * len(spec.turns)) + text + audio - 1
