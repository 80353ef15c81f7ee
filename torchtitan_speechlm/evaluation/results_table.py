"""The results of ``torchtitan eval`` as a table: one row per set, Seed-TTS-eval's columns
first and the model's own scores after them, with a line per set naming its judges (or, for a
dialogue set, its exact-answer share) and what the floor and self columns are.

The command prints it and the report page puts the same rows on top (``summary_rows``,
``COLUMNS``: the column names and their meaning, the page's tooltips and legend).
"""

from __future__ import annotations

from torchtitan_speechlm.generation.progress_lines import frame_limit_line

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
            if r.get("word_loop"):
                w = r["word_loop"]
                out.append(
                    f"{spec}: the free word loop over its words (--judge-word-loop): WER "
                    f"{_fmt(w['wer'])}, floor {_fmt(w['floor_wer'])}, rec floor "
                    f"{_fmt(w['recording_wer'])}"
                )
            if r.get("hit_max_frames"):
                limit = frame_limit_line(
                    r["hit_max_frames"], r["items"], r["max_frames"], r["frame_rate"]
                )
                out.append(f"{spec}: {limit}")
        elif r.get("task") == "dialogue":
            out.append(
                f"{spec}: answers exactly right (after normalisation) {_fmt(r['exact'])}; "
                "WER/CER = the model's answers against the dialogues' last turns"
            )
    return "\n".join(out)
