"""``torchtitan eval --report DIR``: one self-contained HTML page to *listen to* an evaluation.

Numbers alone hide what went wrong (a WER of 0.4 may be one dropped word per utterance or
gibberish half the time), so the page puts, per TTS item, the reference (resynthesised) and
generated audio side by side (players and spectrograms), and the original recording as a third
where it was found (a speaker-prompted item, ``tts_prompt``, first its prompt as the model heard
it and the prompt's original recording, with SIM to the prompt and whether the voice was
identified as the prompt's speaker: does the voice follow the prompt?), the reference text and
each transcript with its errors marked (substitutions, insertions, deletions from
``judges.item_errors``), SIM and DNSMOS; per ASR item, the reference and the model's
transcript marked the same way. The summary table (``results_table.summary_rows``) is on top.

Everything the page uses lies in DIR beside ``index.html`` (wavs written by
``tts_scores.score_tts``, the recordings re-encoded there as they were judged, spectrogram PNGs
written here, ``results.json``) and is linked relatively: no external URL, no script, so the
folder can be copied or archived and opened anywhere.
"""

from __future__ import annotations

import json
import os
from html import escape
from urllib.parse import quote

import numpy as np

from torchtitan_speechlm.evaluation.results_table import COLUMNS, summary_rows
from torchtitan_speechlm.judges import item_errors

STYLE = """
body { font-family: sans-serif; margin: 1.5em; color: #222; }
table.summary { border-collapse: collapse; margin-bottom: 0.5em; }
table.summary th, table.summary td { border: 1px solid #bbb; padding: 0.25em 0.6em; }
table.summary td { text-align: right; } table.summary td:first-child { text-align: left; }
.item { border-top: 1px solid #ccc; padding: 0.8em 0; }
.pair { display: flex; gap: 1.5em; flex-wrap: wrap; }
.pair figure { margin: 0; } .pair img { display: block; width: 480px; height: 200px; }
.meta { color: #555; font-size: 0.9em; }
.sub { background: #ffe08a; } .ins { background: #b9f0b9; }
.del { background: #f5b5b5; text-decoration: line-through; }
.fail { color: #b00; font-weight: bold; }
dt { font-weight: bold; margin-top: 0.3em; } dd { margin-left: 1em; }
"""


def slug(spec: str) -> str:
    """A folder name for a set spec: ``tts:librispeech`` -> ``tts-librispeech``, a prepared
    folder by its last component (``tts:/data/ls/prepared`` -> ``tts-prepared``)."""
    task, _, name = spec.partition(":")
    name = os.path.basename(name.rstrip("/\\")) or name
    return "".join(c if c.isalnum() or c in "._-" else "-" for c in f"{task}-{name}") or "set"


def _link(rel: str) -> str:
    return escape(quote(rel.replace(os.sep, "/")), quote=True)


def _words(words) -> str:
    return words if isinstance(words, str) else " ".join(words)


def marked(ref: str, hyp: str | None) -> str:
    """``hyp`` as HTML with its errors against ``ref`` marked: substituted words (their
    reference in the tooltip), inserted words, deleted reference words struck through."""
    if hyp is None:
        return '<span class="fail">(no transcript)</span>'
    parts = []
    for op, r, h in item_errors(ref, hyp)["ops"]:
        r_s, h_s = escape(_words(r)), escape(_words(h))
        if op == "equal":
            parts.append(h_s)
        elif op == "substitute":
            parts.append(f'<span class="sub" title="reference: {r_s}">{h_s}</span>')
        elif op == "insert":
            parts.append(f'<span class="ins" title="inserted">{h_s}</span>')
        elif op == "delete":
            parts.append(f'<span class="del" title="deleted">{r_s}</span>')
    return " ".join(p for p in parts if p) or "<i>(empty)</i>"


def dithered(wav: np.ndarray) -> np.ndarray:
    """``wav`` plus seeded noise at -100 dBFS: digitally silent stretches (espeak-ng's pauses)
    would otherwise have log(0) power, drawn as blank stripes with a divide-by-zero warning."""
    rng = np.random.default_rng(0)
    return wav + 1e-5 * rng.standard_normal(len(wav)).astype(wav.dtype)


def spectrogram_png(wav_path: str, png_path: str, seconds: float | None = None) -> None:
    """A matplotlib specgram of a wav (no pyplot state: safe in any process); ``seconds`` fixes
    the time axis, so that a pair drawn with the same value compares lengths at a glance."""
    import soundfile as sf
    from matplotlib.figure import Figure

    wav, rate = sf.read(wav_path, dtype="float32", always_2d=True)
    wav = wav.mean(axis=1)
    nfft = 512
    if len(wav) < nfft:
        wav = np.pad(wav, (0, nfft - len(wav)))
    fig = Figure(figsize=(6, 2.5), dpi=80)
    ax = fig.add_subplot()
    ax.specgram(dithered(wav), NFFT=nfft, Fs=rate, noverlap=nfft * 3 // 4, cmap="magma")
    if seconds:
        ax.set_xlim(0, seconds)
    ax.set_xlabel("s")
    ax.set_ylabel("Hz")
    fig.tight_layout()
    fig.savefig(png_path)


def _fmt(v, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _summary(results: dict) -> str:
    head = "".join(f'<th title="{escape(t, quote=True)}">{escape(c)}</th>' for c, t in COLUMNS)
    body = "".join(
        "<tr>" + "".join(f"<td>{escape(r[c])}</td>" for c, _ in COLUMNS) + "</tr>"
        for r in summary_rows(results)
    )
    legend = "".join(f"<li><b>{escape(c)}</b>: {escape(t)}</li>" for c, t in COLUMNS[2:])
    return f'<table class="summary"><tr>{head}</tr>{body}</table><ul class="meta">{legend}</ul>'


def _side(root: str, label: str, rel: str | None, seconds: float) -> str:
    if rel is None:
        return (
            f'<figure><figcaption>{escape(label)}</figcaption><p class="fail">no audio</p></figure>'
        )
    png = rel[: -len(".wav")] + ".png"
    spectrogram_png(os.path.join(root, rel), os.path.join(root, png), seconds)
    return (
        f"<figure><figcaption>{escape(label)}</figcaption>"
        f'<audio controls preload="metadata" src="{_link(rel)}"></audio>'
        f'<img src="{_link(png)}" alt="spectrogram of {escape(label, quote=True)}"></figure>'
    )


def _prompt_meta(r: dict) -> str:
    """A prompted item's line: which utterance prompted it, SIM to the prompt as heard, and
    whether its voice was identified as the prompt's speaker (the numbers of ``prompted``)."""
    if "prompt_id" not in r:
        return ""
    ident = r.get("speaker_id_correct")
    who = "-" if ident is None else ("correct" if ident else "wrong")
    heard = r.get("prompt_seconds")
    return (
        f"prompt {r['prompt_id']} ({'-' if heard is None else f'{heard:.2f}'} s heard) · "
        f"SIM to prompt {_fmt(r.get('sim_prompt'))} · speaker ID {who}"
    )


def _tts_item(root: str, r: dict) -> str:
    audio = r.get("audio") or {}
    prompted = "prompt_id" in r
    q = (r.get("dnsmos") or {}).get("dnsmos_ovrl")
    rq = (r.get("reference_dnsmos") or {}).get("dnsmos_ovrl")
    recorded = audio.get("recording") is not None
    by_rec = (
        f" · SIM to recording {_fmt(r.get('sim_recording'))} · "
        f"recording {r.get('recording_seconds') or 0.0:.2f} s · "
        f"recording floor WER {_fmt(r.get('recording_wer'))}"
        if recorded
        else ""
    )
    meta = (
        f"SIM {_fmt(r['sim'])} · DNSMOS {_fmt(q)} (reference {_fmt(rq)}) · "
        f"{r['seconds']:.2f} s / reference {r['reference_seconds']:.2f} s · "
        f"{'ended by the model' if r['ended'] else 'cut at --max-frames'} · "
        f"WER {_fmt(r['wer'])} · floor WER {_fmt(r['reference_wer'])} · self WER {_fmt(r['self_wer'])}"
        + by_rec
    )
    fails = "".join(f'<li class="fail">{escape(f)}</li>' for f in r["failures"])
    text = r["text"]
    longest = max(
        r["seconds"], r["reference_seconds"], r.get("recording_seconds") or 0.0,
        _wav_seconds(root, audio.get("prompt")), _wav_seconds(root, audio.get("prompt_recording")),
    )  # fmt: skip
    prompt_meta = _prompt_meta(r)
    return (
        f'<div class="item"><h3>{escape(r["id"])}</h3><p class="meta">{escape(meta)}</p>'
        + (f'<p class="meta prompt">{escape(prompt_meta)}</p>' if prompt_meta else "")
        + (f"<ul>{fails}</ul>" if fails else "")
        + '<div class="pair">'
        + (
            _side(root, "prompt (as the model heard it)", audio.get("prompt"), longest)
            if prompted
            else ""
        )
        + (
            _side(root, "prompt, original recording", audio["prompt_recording"], longest)
            if audio.get("prompt_recording")
            else ""
        )
        + _side(root, "reference (resynthesised)", audio.get("reference"), longest)
        + _side(root, "generated", audio.get("generated"), longest)
        + (_side(root, "original recording", audio["recording"], longest) if recorded else "")
        + "</div><dl>"
        + f"<dt>reference text</dt><dd>{escape(text)}</dd>"
        + f"<dt>ASR judge, generated</dt><dd>{marked(text, r['transcript'])}</dd>"
        + f"<dt>ASR judge, reference (floor)</dt><dd>{marked(text, r['reference_transcript'])}</dd>"
        + (
            "<dt>ASR judge, original recording (recording floor)</dt>"
            f"<dd>{marked(text, r.get('recording_transcript'))}</dd>"
            if recorded
            else ""
        )
        + "<dt>self (model's own ASR), generated</dt>"
        + f"<dd>{marked(text, r['self_transcript'] if r['frames'] else None)}</dd>"
        + "</dl></div>"
    )


def _wav_seconds(root: str, rel: str | None) -> float:
    """A written wav's length (0 without one): the shared time axis must fit the prompts too."""
    if rel is None:
        return 0.0
    import soundfile as sf

    return float(sf.info(os.path.join(root, rel)).duration)


def _prompted_meta(r: dict) -> str:
    """A prompted set's speaker numbers (prompted_tts.py) under its judges' line."""
    q = r.get("prompted")
    if not q:
        return ""
    acc = q.get("speaker_id_accuracy")
    return (
        f'<p class="meta">speaker prompts: SIM to prompt {_fmt(q.get("sim_prompt"))} vs SIM to '
        f"other speakers {_fmt(q.get('sim_other'))}; speaker ID "
        f"{'-' if acc is None else f'{acc:.2f}'} among {q.get('speakers', '-')} speakers; "
        f"{q.get('skipped', 0)} items without a second utterance of their speaker left out</p>"
    )


def _asr_items(r: dict) -> str:
    rows = "".join(
        f"<tr><td>{escape(x['id'])}</td><td>{escape(x['text'])}</td>"
        f"<td>{marked(x['text'], x['transcript'])}</td><td>{_fmt(x['wer'])}</td></tr>"
        for x in r["per_item"]
    )
    what = "model's answer" if r.get("task") == "dialogue" else "model's transcript"
    return (
        '<table class="summary"><tr><th>id</th><th>reference</th>'
        f"<th>{what}</th><th>WER</th></tr>{rows}</table>"
    )


def write_report(results: dict, root: str, title: str = "torchtitan eval") -> str:
    """Write ``root/index.html`` (+ spectrograms and ``results.json``) for ``results`` as
    ``torchtitan eval`` makes them (TTS items' ``audio`` paths relative to ``root``); returns
    the page's path."""
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        '<link rel="icon" href="data:,">',
        f"<title>{escape(title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        _summary(results),
        '<p class="meta">Marked transcripts: <span class="sub">substituted</span> '
        '<span class="ins">inserted</span> <span class="del">deleted</span> '
        '(words after normalisation). Numbers in <a href="results.json">results.json</a>.</p>',
    ]
    for spec, r in results.items():
        parts.append(f"<h2>{escape(spec)}</h2>")
        if r.get("task") == "tts":
            j = r["judges"]
            parts.append(
                f'<p class="meta">judges: asr {escape(str(j["asr"]))}, speaker '
                f"{escape(str(j['speaker']))}, quality {escape(str(j['quality']))}; "
                f"original recordings found for {r.get('recordings_found', 0)} of {r['items']} "
                "items</p>" + _prompted_meta(r)
            )
            parts += [_tts_item(root, x) for x in r["per_item"]]
        else:
            parts.append(_asr_items(r))
    parts.append("</body></html>\n")
    path = os.path.join(root, "index.html")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(parts))
    return path
