"""Scoring TTS with *independent judges*: models that are not the model being scored.

The model's own ASR of its own TTS is circular (a model that mumbles consistently understands
itself), so ``torchtitan eval`` scores TTS the way Seed-TTS-eval does, with other models
(``torchtitan_speechlm.judges``, chosen by ``judge_setup``): per TTS set, the speech generated
from each item's text is decoded by the data's codec and

- an ASR judge transcribes it: WER / CER against the reference text (after ``normalise_text``);
- the same judge transcribes the reference audio: the *floor* (what the judge itself gets wrong);
- a speaker judge compares it with the reference audio: SIM (cosine of embeddings);
- a quality judge predicts its MOS (DNSMOS), and the reference's;
- its length against the reference's (duration ratio), and whether the model ended it itself
  before ``max_frames`` (end-of-speech rate);
- its harmonicity (``harmonicity.py``: are the harmonics sharp or smeared), the reference's
  and the recording's: a signal measure, no model.

The prepared data holds codec codes, not recordings, so the reference audio is the codec's
resynthesis of the reference codes: ``floor`` and ``sim`` are against it (the fair floor for
codec speech: the generated speech goes through the same decoder). Where the original
recording is found (``evaluation/recordings.py``: a JSONL manifest line whose audio file still
exists; ``score_tts(recordings=...)``), the item is also judged against it: ``floor_recording``
and ``sim_recording`` (over the items that have one; ``recordings_found`` counts them), and
``reference_audio`` says ``"recording+resynthesised"``. The model's own ASR of its TTS and the
teacher-forced codec-token accuracy (``token_accuracy``, here: a TTS set's only other use of
the model) are kept under ``self``. An empty generation or audio a judge cannot take is a
recorded failure of that item (WER and CER 1.0, listed), never a crash. The set's numbers are
``tts_summary``'s, the report's wavs ``item_wavs``'.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from torchtitan_speechlm.evaluation.harmonicity import harmonicity
from torchtitan_speechlm.evaluation.item_wavs import save_item_wavs
from torchtitan_speechlm.evaluation.judge_setup import Judges
from torchtitan_speechlm.evaluation.phase_clock import PhaseClock
from torchtitan_speechlm.evaluation.prompted_tts import heard_prompts, speaker_scores
from torchtitan_speechlm.evaluation.rates import item_rates
from torchtitan_speechlm.evaluation.tts_summary import summarise_tts
from torchtitan_speechlm.generation import tasks
from torchtitan_speechlm.generation.decode import DecodeConfig
from torchtitan_speechlm.generation.loading import Loaded
from torchtitan_speechlm.generation.progress_lines import FrameCounter
from torchtitan_speechlm.generation.requests import batches_by_length
from torchtitan_speechlm.judges.base import JudgeError
from torchtitan_speechlm.utils.audio import BadAudioError, load_audio
from torchtitan_speechlm.utils.progress import Progress


def score_tts(
    loaded: Loaded,
    items: list,
    cfg: DecodeConfig,
    judges: Judges,
    audio_root: str | None = None,
    audio_dir: str = "",
    batch: int = 8,
    recordings: dict[str, str | None] | None = None,
    progress: Progress | None = None,
    prompts: list | None = None,
    speakers: list[int] | None = None,
    reference_audio: bool = True,
) -> dict:
    """Generate each item's speech from its text and score it with ``judges`` (see the module
    docstring). Audio is decoded only when a judge hears it or ``audio_root`` is given;
    ``reference_audio=False``: not the references' (pair sampling without judges or a report
    keeps only the generated wavs). ``recordings``: ``{item id: its original audio file or
    None}`` (``recordings.find_recordings``), read at the codec's rate with ``audio.load_audio``. With
    ``audio_root``, the generated, reference and recording wavs are written under
    ``audio_root/audio_dir`` (the recording re-encoded as it was judged) and each item's
    ``audio`` gives their paths relative to ``audio_root`` (the report's links). ``progress``
    says a line after each item (items done, seconds per phase), and the phase and frames
    decoded as its status while a batch runs. ``prompts`` (a speaker-prompted
    set, evaluation/prompted_tts.py): per item, the item whose codes prompt it, and ``speakers``
    its speaker; the result then has ``prompted``: SIM to the prompt and to the other speakers,
    and the speaker-identification accuracy, and each item ``prompt_id`` and ``prompt_seconds``
    (as heard); with ``audio_root`` also the prompt's wavs (``_prompt_audio``), so that the
    report plays what the model was given beside what it made."""
    rate = int(loaded.codec.sample_rate)
    listened = audio_root is not None or judges.hears_audio()  # else no decode is needed
    per_item: dict[int, dict] = {}
    generated: dict[int, np.ndarray | None] = {}
    heard: dict[int, np.ndarray] = {}  # the prompts as the model heard them
    clock = PhaseClock(progress)
    for part in batches_by_length([len(it.text) for it in items], batch):
        chunk = [items[i] for i in part]
        frames = None
        if progress is not None:
            label = clock.working_on(len(per_item), len(part), len(items)) + ": generate"
            frames = FrameCounter(float(loaded.codec.frame_rate), progress, label=label)
        with clock("generate"):
            given = None if prompts is None else [prompts[i].audio_codes for i in part]
            codes, ended = tasks.tts_with_ends(
                loaded, [it.text for it in chunk], cfg, on_frames=frames, prompts_codes=given
            )
        spoken = [i for i, c in enumerate(codes) if len(c)]
        self_hyps = [""] * len(chunk)
        with clock("model's own ASR"):
            texts = tasks.asr(loaded, [codes[i] for i in spoken], cfg)
        for i, text in zip(spoken, texts, strict=True):
            self_hyps[i] = text
        gen = ref = [None] * len(chunk)
        if listened:
            with clock("codec decode"):  # the chunk's generated and reference audio together
                gen = _decoded(loaded, codes)
                if reference_audio:
                    ref = _decoded(loaded, [it.audio_codes for it in chunk])
                if given is not None and (audio_root is not None or judges.speaker is not None):
                    heard.update(zip(part, heard_prompts(loaded, given), strict=True))
        for k, (i, it) in enumerate(zip(part, chunk, strict=True)):
            recording = (recordings or {}).get(it.id)
            rec, wavs = _score_item(
                loaded, it, codes[k], bool(ended[k]), self_hyps[k], judges.for_item(i),
                recording, clock, (gen[k], ref[k]),
            )  # fmt: skip
            if prompts is not None:
                rec.update(prompt_id=prompts[i].id, prompt_seconds=_seconds(heard.get(i), rate))
            if audio_root is not None:
                rec["audio"] = save_item_wavs(audio_root, audio_dir, i, it, wavs, rate)
                if prompts is not None:
                    found = (recordings or {}).get(prompts[i].id)
                    rec["audio"].update(
                        _prompt_audio(audio_root, audio_dir, i, it, heard.get(i), found, rate, rec)
                    )
            per_item[i] = rec
            generated[i] = wavs["generated"]
            if progress is not None:
                progress.say(clock.line(len(per_item), len(items)))
    per_item = [per_item[i] for i in range(len(items))]
    result = summarise_tts(per_item, judges, token_accuracy(loaded, items))
    # generations the limit cut (not the model): results_table says so under the table
    result["max_frames"], result["frame_rate"] = cfg.max_frames, float(loaded.codec.frame_rate)
    result["hit_max_frames"] = sum(1 for r in per_item if r["frames"] and not r["ended"])
    if prompts is not None and judges.speaker is not None:
        with clock("speaker judge"):
            result["prompted"] = speaker_scores(
                loaded, judges.speaker, [generated[i] for i in range(len(items))],
                [p.audio_codes for p in prompts], list(speakers),
                heard=[heard[i] for i in range(len(items))],
            )  # fmt: skip
        for rec, row in zip(result["per_item"], result["prompted"].pop("per_item"), strict=True):
            rec.update(row)
    return result


def _prompt_audio(
    root: str, sub: str, i: int, it, heard: np.ndarray | None, recording: str | None,
    rate: int, rec: dict,
) -> dict:  # fmt: skip
    """The report's wavs of item ``i``'s prompt: ``prompt`` (as the model heard it) and
    ``prompt_recording`` (the prompt item's original recording, whole, at the codec's rate;
    None where none is found), ``{kind: path relative to root}``; ``rec["prompt_recording"]``
    is that recording's path. One that cannot be read is listed in ``rec["failures"]``: the
    listener should know why it is missing."""
    failures: list[str] = []
    orig = _load_recording(recording, rate, failures)
    rec["failures"] += [f"prompt {f}" for f in failures]
    rec["prompt_recording"] = recording if orig is not None else None
    wavs = {"prompt": heard, "prompt_recording": orig}
    return save_item_wavs(root, sub, i, it, wavs, rate)


def _seconds(wav: np.ndarray | None, rate: int) -> float | None:
    return None if wav is None else len(wav) / rate


def _decoded(loaded, codes: list) -> list:
    """The codec's audio of each [F, N] codes, decoded together; None for no frames."""
    have = [i for i, c in enumerate(codes) if len(c)]
    wavs = dict(zip(have, tasks.decode_audio(loaded, [codes[i] for i in have]), strict=True))
    return [wavs.get(i) for i in range(len(codes))]


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
    decoded: tuple | None = None,
):
    """One item's record and its {generated, reference, recording} waveforms (None where there
    is none); ``recording`` is the item's original audio file, if found; ``decoded``: the
    (generated, reference) audio already decoded (``_decoded``; None where nothing listens
    to it: durations and failures come from the frame counts, which is what decoding
    gives), else decoded here."""
    rate, failures, clock = int(loaded.codec.sample_rate), [], clock or PhaseClock()
    if decoded is None:
        with clock("codec decode"):
            decoded = (_decoded(loaded, [codes])[0], _decoded(loaded, [it.audio_codes])[0])
    gen, ref = decoded
    if not len(codes):
        failures.append("empty generation (0 frames)")
    if not len(it.audio_codes):
        failures.append("the reference has no audio codes")
    orig = _load_recording(recording, rate, failures)
    per_s = int(loaded.codec.samples_per_frame) / rate  # a decode is frames x samples_per_frame
    rec = {
        "id": it.id,
        "text": it.text,
        "ended": ended,
        "frames": int(len(codes)),
        "reference_frames": int(len(it.audio_codes)),
        "seconds": len(codes) * per_s,
        "reference_seconds": len(it.audio_codes) * per_s,
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
            rec["recording_wer"], rec["recording_cer"] = item_rates(it.text, orig_hyp)
        rec["wer"], rec["cer"] = item_rates(it.text, hyp)
        rec["reference_wer"], rec["reference_cer"] = item_rates(it.text, ref_hyp)
    else:
        rec["wer"] = rec["cer"] = rec["reference_wer"] = rec["reference_cer"] = None
    if judges.word_loop is not None:
        with clock("asr judge"):
            rec["word_loop"] = _word_loop(failures, judges.word_loop, it.text, gen, ref, orig, rate)
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
    self_wer, self_cer = item_rates(it.text, self_hyp if len(codes) else None)
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
        harmonicity={
            what: harmonicity(wav, rate) if wav is not None else None
            for what, wav in (("generated", gen), ("reference", ref), ("recording", orig))
        },
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


def _word_loop(failures: list[str], asr, text: str, gen, ref, orig, rate: int) -> dict:
    """The second ASR judge's (``--judge-word-loop``) transcripts and WERs of the generated
    speech, the reference's resynthesis and the recording."""
    hyp, ref_hyp, orig_hyp = _transcripts(failures, asr, gen, ref, orig, rate)
    return {
        "transcript": hyp,
        "wer": item_rates(text, hyp)[0],
        "reference_wer": item_rates(text, ref_hyp)[0],
        "recording_wer": item_rates(text, orig_hyp)[0] if orig is not None else None,
    }


def _similarity(failures: list[str], spk, gen_embedding, wav, rate: int, what: str):
    """cosine(generated, ``wav``) by the speaker judge; None without either."""
    if gen_embedding is None or wav is None:
        return None
    b = _ask(failures, f"speaker judge ({what})", spk.embed, wav, rate)
    return float(spk.similarity(gen_embedding, b)) if b is not None else None


def _floats(d: dict | None) -> dict | None:
    return None if d is None else {k: float(v) for k, v in d.items()}


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


@torch.no_grad()
def token_accuracy(loaded: Loaded, items: list) -> dict:
    """Codec-token accuracy under teacher forcing with the training template: overall and per
    stream, over audio targets only (stream 0's text/special targets are left out)."""
    model, builder, n = loaded.model, loaded.builder, loaded.layout.num_streams
    correct, count = np.zeros(n), np.zeros(n)
    for it in items:
        ex = builder.build("tts", it)
        frames = torch.from_numpy(ex.frames)[None]
        weights = torch.from_numpy(ex.weights)[None, 1:]
        weights[..., 0] *= torch.from_numpy(ex.frames[1:, 0] >= loaded.layout.stream_offset(0))
        out = model(frames[:, :-1], targets=frames[:, 1:], loss_weights=weights)
        # audio targets only: stream 0's text/special targets are left out
        correct += out.stats["acc_stream"].numpy()
        count += out.stats["count_stream"].numpy()
    return {
        "token_accuracy": float(correct.sum() / max(count.sum(), 1)),
        "token_accuracy_per_stream": (correct / np.maximum(count, 1)).tolist(),
    }
