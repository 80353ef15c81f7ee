"""Scoring a model with *independent judges*: models that are not the model being scored.

The model's own ASR of its own TTS is circular (a model that mumbles consistently understands
itself), so ``torchtitan eval`` scores TTS the way Seed-TTS-eval does, with other models
(``torchtitan_speechlm.judges``): per TTS set, the speech generated from each item's text is
decoded by the data's codec and

- an ASR judge transcribes it: WER / CER against the reference text (after ``normalise_text``);
- the same judge transcribes the reference audio: the *floor* (what the judge itself gets wrong);
- a speaker judge compares it with the reference audio: SIM (cosine of embeddings);
- a quality judge predicts its MOS (DNSMOS), and the reference's;
- its length against the reference's (duration ratio), and whether the model ended it itself
  before ``max_frames`` (end-of-speech rate).

The prepared data holds codec codes, not recordings, so the reference audio is the codec's
resynthesis of the reference codes: ``floor`` and ``sim`` are against it (the fair floor for
codec speech: the generated speech goes through the same decoder). Where the original
recording is found (``evaluation/recordings.py``: a JSONL manifest line whose audio file still
exists; ``score_tts(recordings=...)``), the item is also judged against it: ``floor_recording``
and ``sim_recording`` (over the items that have one; ``recordings_found`` counts them), and
``reference_audio`` says ``"recording+resynthesised"``. The model's own ASR of its TTS and the
teacher-forced token accuracy are kept under ``self``. An empty generation or audio a judge
cannot take is a recorded failure of that item (WER and CER 1.0, listed), never a crash.

Set-level WER / CER are means over items (Seed-TTS-eval's figure); ``wer_corpus`` pools edits
over all reference words.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np

from torchtitan_speechlm.evaluation.evaluate import token_accuracy
from torchtitan_speechlm.generation import tasks
from torchtitan_speechlm.generation.decode import DecodeConfig
from torchtitan_speechlm.generation.loading import Loaded
from torchtitan_speechlm.judges import build_judge, error_rates, item_errors, normalise_text
from torchtitan_speechlm.judges.base import JudgeError
from torchtitan_speechlm.utils.audio import BadAudioError, load_audio

REFERENCE_AUDIO = "resynthesised"  # the codec's decoding of the prepared reference codes
WITH_RECORDING = "recording+resynthesised"  # also the original recordings, for some items
JUDGE_KINDS = ("asr", "speaker", "quality")


# ---- which judges -----------------------------------------------------------------------------
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


@dataclass
class Judges:
    asr: object | None = None  # judges.base.ASRJudge
    speaker: object | None = None  # judges.base.SpeakerJudge
    quality: object | None = None  # judges.base.QualityJudge
    quality_items: int = 0  # score quality on the first N items only (0: every item)

    def for_item(self, index: int) -> Judges:
        """The judges of a set's ``index``-th item: without the quality judge past
        ``quality_items`` (DNSMOS is the slowest judge by far: about 1.5 s per short clip)."""
        if self.quality is None or not self.quality_items or index < self.quality_items:
            return self
        return replace(self, quality=None)

    def describe(self) -> dict:
        return {k: (j.describe() if j is not None else None) for k, j in self._pairs()}

    def _pairs(self):
        return (("asr", self.asr), ("speaker", self.speaker), ("quality", self.quality))


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


def _build(flag: str, kind: str, name: str, options: dict):
    try:
        judge = build_judge(name, **options)
    except JudgeError as e:  # its message names the judge
        raise JudgeError(f"{flag}: {e}") from e
    except ValueError as e:  # an unknown name: the registry lists the registered ones
        raise JudgeError(f"{flag}: {e}") from e
    if getattr(judge, "kind", None) != kind:
        raise JudgeError(f"{flag} {name}: that is a {judge.kind or '?'} judge, not an {kind} one")
    return judge


def vocabulary_words(texts: list[str]) -> list[str]:
    """The distinct words of ``texts`` after ``normalise_text``, sorted: the free word loop a
    restricted recogniser gets for ``--judge-vocabulary eval``."""
    return sorted({w for t in texts for w in normalise_text(t).split()})


def _asr_options(opts: JudgeOptions, name: str, texts: list[str]) -> dict:
    if opts.grammar is not None and opts.vocabulary is not None:
        raise JudgeError("give --judge-grammar or --judge-vocabulary, not both")
    if name != "pocketsphinx":
        if opts.grammar is not None or opts.vocabulary is not None:
            raise JudgeError(
                f"--judge-vocabulary / --judge-grammar are pocketsphinx options, not {name}'s"
            )
        return {}
    if opts.grammar is not None:
        if not os.path.isfile(opts.grammar):
            raise JudgeError(f"--judge-grammar {opts.grammar}: no such file (a JSGF grammar)")
        return {"grammar": os.path.abspath(opts.grammar)}
    vocab = opts.vocabulary or "eval"
    if vocab == "open":
        return {}
    if vocab == "eval":
        return {"vocabulary": vocabulary_words(texts)}
    if not os.path.isfile(vocab):
        raise JudgeError(
            f"--judge-vocabulary {vocab}: no such file (eval, open, or a file of words)"
        )
    with open(vocab, encoding="utf-8") as f:
        words = vocabulary_words([f.read()])
    if not words:
        raise JudgeError(f"--judge-vocabulary {vocab}: the file has no words")
    return {"vocabulary": words}


def build_judges(opts: JudgeOptions, sets: dict[str, list[str]]) -> dict[str, Judges]:
    """The judges of each TTS set (``{set: its texts}``), all built before anything is
    generated so that a judge that cannot load fails the command at once. Speaker and quality
    judges are shared; the ASR judge is one per set with ``--judge-vocabulary eval`` (each set's
    own words), else shared. Raises ``JudgeError`` (one line: the flag, the fix)."""
    if not sets:
        return {}
    speaker = _resolve("--judge-speaker", opts.speaker, "transformers-sv")
    quality = _resolve("--judge-quality", opts.quality, None)
    asr = _resolve("--judge-asr", opts.asr, "transformers-asr")
    if opts.quality_items < 0:
        raise JudgeError(f"--judge-quality-items {opts.quality_items}: give 0 (all) or more")
    shared = Judges(
        speaker=_build("--judge-speaker", "speaker", *speaker) if speaker else None,
        quality=_build("--judge-quality", "quality", *quality) if quality else None,
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
                judge = _build("--judge-asr", "asr", asr[0], options)
            except JudgeError as e:
                hint = f" (--judge-vocabulary eval: the words of {name}; give a word file, open, "
                raise JudgeError(f"{e}{hint}or --judge-grammar)" if per_set else str(e)) from e
            common = common if per_set else judge
        out[name] = Judges(
            judge if per_set else common, shared.speaker, shared.quality, shared.quality_items
        )
    return out


# ---- scoring ----------------------------------------------------------------------------------
def _errors(ref: str, hyp: str | None) -> tuple[float, float]:
    """(WER, CER) of one item; a failure (``hyp`` None) counts 1.0."""
    if hyp is None:
        return 1.0, 1.0
    e = item_errors(ref, hyp)
    return float(e["wer"]), float(e["cer"])


def _corpus(refs: list[str], hyps: list[str | None]) -> dict:
    """Edits pooled over all reference words; a failure is an empty hypothesis (all deleted)."""
    rates = error_rates(refs, [h or "" for h in hyps])
    return {"wer": float(rates["wer"]), "cer": float(rates["cer"])}


def _mean(values) -> float | None:
    kept = [v for v in values if v is not None]
    return float(np.mean(kept)) if kept else None


def _ask(failures: list[str], what: str, fn: Callable, *args):
    """A judge's answer, or None with the reason appended to ``failures`` (a judge that cannot
    take an audio is that item's recorded failure, not the end of the evaluation)."""
    try:
        return fn(*args)
    except JudgeError as e:
        failures.append(f"{what}: {e}")
    except Exception as e:  # a judge's own library refusing an input (too short, ...)
        failures.append(f"{what}: {type(e).__name__}: {e}")
    return None


def _safe_name(i: int, item_id: str) -> str:
    return f"{i:04d}-" + (re.sub(r"[^A-Za-z0-9._-]+", "_", item_id)[:60] or "item")


def _write_wav(root: str, rel: str, wav: np.ndarray, rate: int) -> str:
    import soundfile as sf

    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    sf.write(path, np.asarray(wav, dtype=np.float32), rate)
    return rel


def score_asr(
    loaded: Loaded,
    items: list,
    cfg: DecodeConfig,
    batch: int = 8,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """The model's transcripts of each item's reference codes, WER / CER after
    ``normalise_text`` (per item, their mean, and pooled); ``progress`` as in ``score_tts``."""
    refs = [it.text for it in items]
    return _score_text("asr", items, refs, tasks.transcribe_items, loaded, cfg, batch, progress)


def score_answers(
    loaded: Loaded,
    items: list,
    cfg: DecodeConfig,
    batch: int = 8,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Dialogue sets (spoken question answering and other audio-conditioned text tasks): the
    model's answer to each dialogue (its last turn, assistant text, generated from the turns
    before it) against the reference answer: WER / CER as ``score_asr``, and the share of
    answers exactly right after normalisation (``exact``)."""
    refs = [tasks.reference_answer(it) for it in items]
    out = _score_text("dialogue", items, refs, tasks.answer_items, loaded, cfg, batch, progress)
    out["exact"] = _mean(float(r["wer"] == 0.0) for r in out["per_item"])
    return out


def _score_text(task: str, items, refs, generate, loaded, cfg, batch, progress) -> dict:
    """Text the model generates per item (``generate(loaded, items, cfg)``) scored against
    ``refs``: per item, the mean, and pooled."""
    hyps: list[str] = []
    clock = PhaseClock()
    for s in range(0, len(items), batch):
        with clock("generate"):
            hyps += generate(loaded, items[s : s + batch], cfg)
        if progress is not None:
            progress(clock.line(len(hyps), len(items)))
    per_item = []
    for it, ref, hyp in zip(items, refs, hyps, strict=True):
        wer, cer = _errors(ref, hyp)
        per_item.append(
            {"id": it.id, "text": ref, "transcript": hyp, "wer": wer, "cer": cer, "failures": []}
        )
    corpus = _corpus(refs, hyps)
    return {
        "task": task,
        "items": len(items),
        "wer": _mean(r["wer"] for r in per_item),
        "cer": _mean(r["cer"] for r in per_item),
        "wer_corpus": corpus["wer"],
        "cer_corpus": corpus["cer"],
        "failures": [],
        "per_item": per_item,
    }


class PhaseClock:
    """Wall seconds per phase of one set's evaluation, for the progress lines on stderr (not
    in the results: they are not a property of the model)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.start = time.perf_counter()

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t

    def line(self, done: int, total: int) -> str:
        parts = ", ".join(f"{k} {v:.0f}s" for k, v in self.seconds.items())
        return f"{done}/{total} items, {time.perf_counter() - self.start:.0f}s ({parts})"


def score_tts(
    loaded: Loaded,
    items: list,
    cfg: DecodeConfig,
    judges: Judges,
    audio_root: str | None = None,
    audio_dir: str = "",
    batch: int = 8,
    recordings: dict[str, str | None] | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Generate each item's speech from its text and score it with ``judges`` (see the module
    docstring). ``recordings``: ``{item id: its original audio file or None}``
    (``recordings.find_recordings``), read at the codec's rate with ``audio.load_audio``. With
    ``audio_root``, the generated, reference and recording wavs are written under
    ``audio_root/audio_dir`` (the recording re-encoded as it was judged) and each item's
    ``audio`` gives their paths relative to ``audio_root`` (the report's links). ``progress``
    gets a line after each batch (items done, seconds per phase)."""
    rate = int(loaded.codec.sample_rate)
    per_item: list[dict] = []
    clock = PhaseClock()
    for s in range(0, len(items), batch):
        chunk = items[s : s + batch]
        with clock("generate"):
            codes, ended = tasks.tts_with_ends(loaded, [it.text for it in chunk], cfg)
        spoken = [i for i, c in enumerate(codes) if len(c)]
        self_hyps = [""] * len(chunk)
        with clock("model's own ASR"):
            texts = tasks.asr(loaded, [codes[i] for i in spoken], cfg)
        for i, text in zip(spoken, texts, strict=True):
            self_hyps[i] = text
        for k, it in enumerate(chunk):
            recording = (recordings or {}).get(it.id)
            rec, wavs = _score_item(
                loaded, it, codes[k], bool(ended[k]), self_hyps[k], judges.for_item(s + k),
                recording, clock,
            )  # fmt: skip
            if audio_root is not None:
                rec["audio"] = _save(audio_root, audio_dir, s + k, it, wavs, rate)
            per_item.append(rec)
        if progress is not None:
            progress(clock.line(len(per_item), len(items)))
    return summarise_tts(per_item, judges, token_accuracy(loaded, items))


def _load_recording(path: str | None, rate: int, failures: list[str]) -> np.ndarray | None:
    """The original recording at the codec's rate, or None (none found, or unreadable: then
    the reason is in ``failures`` and the item is judged on the resynthesis alone)."""
    if path is None:
        return None
    try:
        return load_audio(path, rate)
    except BadAudioError as e:
        failures.append(f"recording: {e}")
    return None


def _score_item(
    loaded,
    it,
    codes,
    ended: bool,
    self_hyp: str,
    judges: Judges,
    recording: str | None = None,
    clock: PhaseClock | None = None,
):
    """One item's record and its {generated, reference, recording} waveforms (None where there
    is none); ``recording`` is the item's original audio file, if found."""
    rate, failures, clock = int(loaded.codec.sample_rate), [], clock or PhaseClock()
    with clock("codec decode"):
        ref = loaded.codec.decode(it.audio_codes) if len(it.audio_codes) else None
        gen = loaded.codec.decode(codes) if len(codes) else None
    if gen is None:
        failures.append("empty generation (0 frames)")
    if ref is None:
        failures.append("the reference has no audio codes")
    orig = _load_recording(recording, rate, failures)
    rec = {
        "id": it.id,
        "text": it.text,
        "ended": ended,
        "frames": int(len(codes)),
        "reference_frames": int(len(it.audio_codes)),
        "seconds": len(gen) / rate if gen is not None else 0.0,
        "reference_seconds": len(ref) / rate if ref is not None else 0.0,
        "recording": recording if orig is not None else None,
        "recording_seconds": len(orig) / rate if orig is not None else None,
    }
    rec["duration_ratio"] = (
        rec["seconds"] / rec["reference_seconds"] if rec["reference_seconds"] > 0 else None
    )
    asr, spk, qual = judges.asr, judges.speaker, judges.quality
    hyp = ref_hyp = orig_hyp = sim = sim_orig = dnsmos = ref_dnsmos = None
    rec["recording_wer"] = rec["recording_cer"] = None
    with clock("asr judge"):
        hyp, ref_hyp, orig_hyp = _transcripts(failures, asr, gen, ref, orig, rate)
    if asr is not None:
        if orig is not None:
            rec["recording_wer"], rec["recording_cer"] = _errors(it.text, orig_hyp)
        rec["wer"], rec["cer"] = _errors(it.text, hyp)
        rec["reference_wer"], rec["reference_cer"] = _errors(it.text, ref_hyp)
    else:
        rec["wer"] = rec["cer"] = rec["reference_wer"] = rec["reference_cer"] = None
    if spk is not None and gen is not None and (ref is not None or orig is not None):
        with clock("speaker judge"):
            a = _ask(failures, "speaker judge", spk.embed, gen, rate)
            sim = _similarity(failures, spk, a, ref, rate, "reference")
            sim_orig = _similarity(failures, spk, a, orig, rate, "recording")
    if qual is not None:
        with clock("quality judge"):
            if gen is not None:
                dnsmos = _ask(failures, "quality judge", qual.score, gen, rate)
            if ref is not None:
                ref_dnsmos = _ask(failures, "quality judge (reference)", qual.score, ref, rate)
    self_wer, self_cer = _errors(it.text, self_hyp if gen is not None else None)
    rec.update(
        transcript=hyp,
        reference_transcript=ref_hyp,
        recording_transcript=orig_hyp,
        self_transcript=self_hyp,
        self_wer=self_wer,
        self_cer=self_cer,
        sim=sim,
        sim_recording=sim_orig,
        dnsmos=_floats(dnsmos),
        reference_dnsmos=_floats(ref_dnsmos),
        failures=failures,
    )
    return rec, {"generated": gen, "reference": ref, "recording": orig}


def _transcripts(failures: list[str], asr, gen, ref, orig, rate: int) -> tuple:
    """The ASR judge's transcripts of the generated speech, the reference's resynthesis and
    the original recording (None where there is no judge or no such audio)."""
    if asr is None:
        return None, None, None
    return tuple(
        _ask(failures, what, asr.transcribe, wav, rate) if wav is not None else None
        for what, wav in (
            ("asr judge", gen),
            ("asr judge (reference)", ref),
            ("asr judge (recording)", orig),
        )
    )


def _similarity(failures: list[str], spk, gen_embedding, wav, rate: int, what: str):
    """cosine(generated, ``wav``) by the speaker judge; None without either."""
    if gen_embedding is None or wav is None:
        return None
    b = _ask(failures, f"speaker judge ({what})", spk.embed, wav, rate)
    return float(spk.similarity(gen_embedding, b)) if b is not None else None


def _floats(d: dict | None) -> dict | None:
    return None if d is None else {k: float(v) for k, v in d.items()}


def _save(root: str, sub: str, i: int, it, wavs: dict, rate: int) -> dict:
    stem = os.path.join(sub, _safe_name(i, it.id))
    return {
        kind: (_write_wav(root, f"{stem}.{kind[:3]}.wav", wav, rate) if wav is not None else None)
        for kind, wav in wavs.items()
    }


def _dnsmos_means(recs: list[dict], key: str) -> dict:
    names = sorted({k for r in recs if r.get(key) for k in r[key]})
    return {k: _mean(r[key].get(k) if r.get(key) else None for r in recs) for k in names}


def summarise_tts(per_item: list[dict], judges: Judges, self_acc: dict) -> dict:
    """A TTS set's numbers from its item records (a failed item counts WER/CER 1.0)."""
    refs = [r["text"] for r in per_item]
    judged = judges.asr is not None
    corpus = _corpus(refs, [r["transcript"] for r in per_item]) if judged else {}
    floor = _corpus(refs, [r["reference_transcript"] for r in per_item]) if judged else {}
    self_corpus = _corpus(refs, [r["self_transcript"] if r["frames"] else None for r in per_item])
    ratios = [r["duration_ratio"] for r in per_item if r["duration_ratio"] is not None]
    gen_q, ref_q = _dnsmos_means(per_item, "dnsmos"), _dnsmos_means(per_item, "reference_dnsmos")
    found = [r for r in per_item if r.get("recording")]
    by_rec = (
        _corpus([r["text"] for r in found], [r["recording_transcript"] for r in found])
        if judged and found
        else {}
    )
    return {
        "task": "tts",
        "items": len(per_item),
        "judges": judges.describe(),
        "reference_audio": WITH_RECORDING if found else REFERENCE_AUDIO,
        "recordings_found": len(found),
        "wer": _mean(r["wer"] for r in per_item) if judged else None,
        "cer": _mean(r["cer"] for r in per_item) if judged else None,
        "wer_corpus": corpus.get("wer"),
        "cer_corpus": corpus.get("cer"),
        "sim": _mean(r["sim"] for r in per_item),
        "sim_recording": _mean(r.get("sim_recording") for r in found),
        "dnsmos": gen_q.get("dnsmos_ovrl"),
        "dnsmos_items": sum(1 for r in per_item if r.get("dnsmos")),
        "dnsmos_all": gen_q,
        "reference_dnsmos": ref_q.get("dnsmos_ovrl"),
        "reference_dnsmos_all": ref_q,
        "duration_ratio": {
            "median": float(np.median(ratios)) if ratios else None,
            "mean": float(np.mean(ratios)) if ratios else None,
        },
        "eos_rate": _mean(float(r["ended"]) for r in per_item),
        "floor": {
            "wer": _mean(r["reference_wer"] for r in per_item) if judged else None,
            "cer": _mean(r["reference_cer"] for r in per_item) if judged else None,
            "wer_corpus": floor.get("wer"),
            "cer_corpus": floor.get("cer"),
        },
        "floor_recording": {  # the judge on the original recordings, over the items found
            "wer": _mean(r["recording_wer"] for r in found) if judged else None,
            "cer": _mean(r["recording_cer"] for r in found) if judged else None,
            "wer_corpus": by_rec.get("wer"),
            "cer_corpus": by_rec.get("cer"),
        },
        "self": {
            "note": "the model's own ASR of its TTS and teacher-forced token accuracy: "
            "not independent judges",
            "asr_of_tts": {
                "wer": _mean(r["self_wer"] for r in per_item),
                "cer": _mean(r["self_cer"] for r in per_item),
                "wer_corpus": self_corpus["wer"],
                "cer_corpus": self_corpus["cer"],
            },
            **self_acc,
        },
        "failures": [{"id": r["id"], "failure": f} for r in per_item for f in r["failures"]],
        "per_item": per_item,
    }


# ---- the table --------------------------------------------------------------------------------
COLUMNS = (
    ("set", "set"),
    ("items", "items"),
    (
        "WER",
        "ASR judge's WER of the generated speech (ASR sets: of the model's transcripts, "
        "dialogue sets: of its answers)",
    ),
    ("CER", "ASR judge's CER of the generated speech (ASR, dialogue sets: as WER)"),
    ("SIM", "speaker judge: cosine(generated, reference)"),
    ("DNSMOS", "quality judge: DNSMOS OVRL of the generated speech (over dnsmos_items)"),
    ("dur ratio", "median generated / reference duration"),
    ("EOS rate", "share of utterances the model ended itself before --max-frames"),
    ("floor WER", "the ASR judge's WER on the reference audio (resynthesised)"),
    ("rec floor", "the ASR judge's WER on the original recordings (the items that have one)"),
    ("self WER", "self (model's own ASR) of its TTS"),
    ("tok acc", "self: teacher-forced codec-token accuracy"),
    ("failures", "items with a recorded failure"),
)


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def summary_rows(results: dict) -> list[dict[str, str]]:
    """One row per set, the table's columns (``COLUMNS``) as formatted strings."""
    rows = []
    for spec, r in results.items():
        tts = r.get("task") == "tts"
        failed = len({f["id"] for f in r.get("failures", [])})
        rows.append(
            {
                "set": spec,
                "items": str(r["items"]),
                "WER": _fmt(r["wer"]),
                "CER": _fmt(r["cer"]),
                "SIM": _fmt(r["sim"]) if tts else "-",
                "DNSMOS": _fmt(r["dnsmos"]) if tts else "-",
                "dur ratio": _fmt(r["duration_ratio"]["median"]) if tts else "-",
                "EOS rate": _fmt(r["eos_rate"]) if tts else "-",
                "floor WER": _fmt(r["floor"]["wer"]) if tts else "-",
                "rec floor": _fmt((r.get("floor_recording") or {}).get("wer")) if tts else "-",
                "self WER": _fmt(r["self"]["asr_of_tts"]["wer"]) if tts else "-",
                "tok acc": _fmt(r["self"]["token_accuracy"]) if tts else "-",
                "failures": str(failed),
            }
        )
    return rows


def format_table(results: dict) -> str:
    """The per-set table (Seed-TTS-eval's columns, then the model's own scores), with a line
    naming the judges and what the floor and self columns are."""
    rows = summary_rows(results)
    names = [c for c, _ in COLUMNS]
    width = {c: max([len(c)] + [len(r[c]) for r in rows]) for c in names}
    line = lambda r: "  ".join(  # noqa: E731
        (r[c].ljust if c == "set" else r[c].rjust)(width[c]) for c in names
    )
    out = [line({c: c for c in names})] + [line(r) for r in rows]
    for spec, r in results.items():
        if r.get("task") == "tts":
            j = r["judges"]
            found = r.get("recordings_found", 0)
            scored = r.get("dnsmos_items", r["items"])
            quality = j["quality"] if scored == r["items"] else f"{j['quality']} ({scored} items)"
            out.append(
                f"{spec}: judges asr={j['asr']} speaker={j['speaker']} quality={quality}; "
                "floor = the ASR judge on the reference (resynthesised), rec floor = on the "
                f"original recordings ({found} of {r['items']} found); "
                "self = the model's own ASR / token accuracy"
            )
        elif r.get("task") == "dialogue":
            out.append(
                f"{spec}: answers exactly right (after normalisation) {_fmt(r['exact'])}; "
                "WER/CER = the model's answers against the dialogues' last turns"
            )
    return "\n".join(out)
