"""Which judges score each TTS set of ``torchtitan eval``: the ``--judge-*`` flags turned into
built judges (``torchtitan_speechlm.judges``), all of them before anything is generated.

Kept apart from the scoring because it fails differently: a judge that cannot load, a folder
that is not a model, a vocabulary file with no words is the command's one-line error at once
(``JudgeError``: the flag and the fix), while scoring records an item's failure and goes on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from torchtitan_speechlm.judges import build_judge, normalise_text
from torchtitan_speechlm.judges.base import JUDGES, JudgeError


@dataclass
class JudgeOptions:
    """What the ``--judge-*`` flags ask for. ``asr`` / ``speaker``: a judge name, a model
    folder (``transformers-asr`` / ``transformers-sv``) or ``none``; ``vocabulary`` (pocketsphinx):
    ``eval`` (None: the words of the evaluated set's texts), ``open`` (its shipped LM) or a
    word-list file; ``grammar``: a JSGF file for pocketsphinx instead."""

    asr: str = "pocketsphinx"
    vocabulary: str | None = None
    grammar: str | None = None
    speaker: str = "resemblyzer"
    quality: str = "dnsmos"
    quality_items: int = 0  # the quality judge scores the first N items of a set; 0: all
    word_loop: bool = False  # also PocketSphinx's free word loop over each set's words


@dataclass
class Judges:
    """The judges of one TTS set (None: that kind is not scored)."""

    asr: object | None = None  # judges.base.ASRJudge
    speaker: object | None = None  # judges.base.SpeakerJudge
    quality: object | None = None  # judges.base.QualityJudge
    quality_items: int = 0  # score quality on the first N items only (0: every item)
    word_loop: object | None = None  # a second ASR judge: the free word loop (--judge-word-loop)

    def for_item(self, index: int) -> Judges:
        """The judges of a set's ``index``-th item: without the quality judge past
        ``quality_items`` (DNSMOS is the slowest judge by far: about 1.5 s per short clip)."""
        if self.quality is None or not self.quality_items or index < self.quality_items:
            return self
        return replace(self, quality=None)

    def hears_audio(self) -> bool:
        """Whether any judge listens to the decoded audio (else a set needs no decode: the
        model's own ASR reads codes)."""
        return any(j is not None for _, j in self._pairs())

    def describe(self) -> dict:
        """Each judge's description (None where there is none): the results' ``judges``."""
        return {k: (j.describe() if j is not None else None) for k, j in self._pairs()}

    def _pairs(self):
        pairs = (("asr", self.asr), ("speaker", self.speaker), ("quality", self.quality))
        return (*pairs, ("word_loop", self.word_loop)) if self.word_loop is not None else pairs


def _resolve(flag: str, value: str, folder_judge: str | None) -> tuple[str, dict] | None:
    """``none`` -> None; a folder -> (folder_judge, {path}); else a judge name."""
    if value.strip().lower() == "none":
        return None
    looks_like_path = os.sep in value or value.startswith((".", "~"))
    if folder_judge is not None and os.path.isdir(value):
        return folder_judge, {"path": os.path.abspath(value)}
    if folder_judge is not None and looks_like_path:
        raise JudgeError(
            f"{flag} {value}: no such folder (give a {folder_judge} model folder, a judge name, "
            "or none)"
        )
    if looks_like_path:
        raise JudgeError(f"{flag} {value}: give a judge name or none, not a path")
    return value, {}


def _build(flag: str, name: str, options: dict):
    try:
        return build_judge(name, **options)
    except JudgeError as e:  # its message names the judge
        raise JudgeError(f"{flag}: {e}") from e
    except ValueError as e:  # an option the judge does not take: build_judge lists its options
        raise JudgeError(f"{flag}: {e}") from e


def _check_kind(flag: str, kind: str, name: str) -> None:
    """``name`` is a registered judge of ``kind`` (an unknown name lists the registered ones)."""
    try:
        registered = getattr(JUDGES.get(name, key=flag), "kind", "")  # a class, not built
    except ValueError as e:
        raise JudgeError(str(e)) from e
    if registered != kind:
        raise JudgeError(f"{flag} {name}: that is a {registered or '?'} judge, not an {kind} one")


def _resolved(opts: JudgeOptions) -> tuple:
    """(speaker, quality, asr): each (judge name, options) or None (``none``)."""
    return (
        _resolve("--judge-speaker", opts.speaker, "transformers-sv"),
        _resolve("--judge-quality", opts.quality, None),
        _resolve("--judge-asr", opts.asr, "transformers-asr"),
    )


def check_judge_flags(opts: JudgeOptions) -> None:
    """Everything about the ``--judge-*`` flags that needs neither the model nor a judge built:
    each judge is a registered one of its kind (or a model folder where one is taken), the
    pocketsphinx files exist and are used with pocketsphinx, the counts are counts. ``torchtitan
    eval`` calls it before it loads the model, so a typo is the one-line error at once, not after
    the model and the other judges have loaded (about 9 s on 2 cores); ``build_judges`` calls it
    first as well. Raises ``JudgeError``."""
    if opts.quality_items < 0:
        raise JudgeError(f"--judge-quality-items {opts.quality_items}: give 0 (all) or more")
    speaker, quality, asr = _resolved(opts)
    for flag, kind, judge in (("--judge-speaker", "speaker", speaker),
                              ("--judge-quality", "quality", quality),
                              ("--judge-asr", "asr", asr)):  # fmt: skip
        if judge is not None:
            _check_kind(flag, kind, judge[0])
    if opts.grammar is not None and opts.vocabulary is not None:
        raise JudgeError("give --judge-grammar or --judge-vocabulary, not both")
    name = asr[0] if asr is not None else "none"
    if name != "pocketsphinx" and (opts.grammar is not None or opts.vocabulary is not None):
        raise JudgeError(
            f"--judge-vocabulary / --judge-grammar are pocketsphinx options, not {name}'s"
        )
    if opts.grammar is not None and not os.path.isfile(opts.grammar):
        raise JudgeError(f"--judge-grammar {opts.grammar}: no such file (a JSGF grammar)")
    if opts.vocabulary not in (None, "eval", "open"):
        if not os.path.isfile(opts.vocabulary):
            raise JudgeError(
                f"--judge-vocabulary {opts.vocabulary}: no such file (eval, open, or a file of "
                "words)"
            )
        if not _file_words(opts.vocabulary):
            raise JudgeError(f"--judge-vocabulary {opts.vocabulary}: the file has no words")


def vocabulary_words(texts: list[str]) -> list[str]:
    """The distinct words of ``texts`` after ``normalise_text``, sorted: the free word loop a
    restricted recogniser gets for ``--judge-vocabulary eval``."""
    return sorted({w for t in texts for w in normalise_text(t).split()})


def _file_words(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return vocabulary_words([f.read()])


def _asr_options(opts: JudgeOptions, name: str, texts: list[str]) -> dict:
    """The ASR judge's options for a set of ``texts`` (the flags checked already)."""
    if name != "pocketsphinx":
        return {}
    if opts.grammar is not None:
        return {"grammar": os.path.abspath(opts.grammar)}
    vocab = opts.vocabulary or "eval"
    if vocab == "open":
        return {}
    if vocab == "eval":
        return {"vocabulary": vocabulary_words(texts)}
    return {"vocabulary": _file_words(vocab)}


def build_judges(opts: JudgeOptions, sets: dict[str, list[str]]) -> dict[str, Judges]:
    """The judges of each TTS set (``{set: its texts}``), all built before anything is
    generated so that a judge that cannot load fails the command at once. Speaker and quality
    judges are shared; the ASR judge is one per set with ``--judge-vocabulary eval`` (each set's
    own words), else shared. Raises ``JudgeError`` (one line: the flag, the fix)."""
    if not sets:
        return {}
    check_judge_flags(opts)
    speaker, quality, asr = _resolved(opts)
    shared = Judges(
        speaker=_build("--judge-speaker", *speaker) if speaker else None,
        quality=_build("--judge-quality", *quality) if quality else None,
        quality_items=opts.quality_items,
    )
    per_set = asr is not None and asr[0] == "pocketsphinx" and opts.grammar is None
    per_set = per_set and (opts.vocabulary or "eval") == "eval"
    out, common = {}, None
    for name, texts in sets.items():
        judge = None
        if asr is not None and (per_set or common is None):
            options = {**asr[1], **_asr_options(opts, asr[0], texts)}
            try:
                judge = _build("--judge-asr", asr[0], options)
            except JudgeError as e:
                hint = f" (--judge-vocabulary eval: the words of {name}; give a word file, open, "
                raise JudgeError(f"{e}{hint}or --judge-grammar)" if per_set else str(e)) from e
            common = common if per_set else judge
        loop = None
        if opts.word_loop:  # its own words: a grammar or a file may allow others
            loop = _build("--judge-word-loop", "pocketsphinx",
                          {"vocabulary": vocabulary_words(texts)})  # fmt: skip
        out[name] = Judges(
            judge if per_set else common, shared.speaker, shared.quality, shared.quality_items, loop
        )
    return out
