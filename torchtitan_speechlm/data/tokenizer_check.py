"""Does the text tokenizer give back the texts it encodes? Checked by prepare and by train.

A tokenizer whose decoder cannot undo its pre-tokenizer (a ``Whitespace`` pre-tokenizer with a
plain BPE decoder, or none) trains without a hitch: every text gets ids, the loss goes down. But
everything the model later writes is decoded without its spaces, so ``torchtitan eval`` scored
transcripts that were right word for word ("thequietcatseesthecat") as WER 1.000, and nothing
said why. So ``torchtitan prepare`` and ``torchtitan train`` check, on up to ``SAMPLE_SIZE``
texts spread deterministically over the corpus, that ``decode(ids)`` is the text again up to
whitespace (runs collapsed, ends stripped), and refuse a tokenizer that loses spaces or
characters, naming the first failing text, unless told to accept it (then one warning line).

- prepare encodes the sampled input texts itself (before any output or codec work) and records
  the outcome in ``metadata.json`` (``tokenizer_roundtrip``);
- train decodes the ids the prepared shards store and compares them with the original text the
  shards also store (``items.jsonl``), with the tokenizer of the dataset's metadata (the one
  generate and eval will decode with), so it checks the data it trains on, datasets prepared
  before this check included. Only when that tokenizer cannot be found does it fall back on the
  prepare-time record.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torchtitan_speechlm.data.format import KINDS
from torchtitan_speechlm.utils.text_tokenizer import load_text_tokenizer, tokenizer_fingerprint

SAMPLE_SIZE = 200
FIX = (
    "use a byte-level BPE (pre_tokenizers.ByteLevel + decoders.ByteLevel) or a "
    "SentencePiece-style Metaspace tokenizer (pre_tokenizers.Metaspace + decoders.Metaspace)"
)
PREPARE_ACCEPT = "pass --allow-lossy-tokenizer (prepare_dataset(allow_lossy_tokenizer=True))"
TRAIN_ACCEPT = "set speechlm_data.allow_lossy_tokenizer = true"


class LossyTokenizerError(ValueError):
    """The text tokenizer does not reproduce the corpus' texts; the message names the first one."""


@dataclass(frozen=True)
class Sample:
    """One text to check: ``where`` names it (file line, item id, turn); ``ids`` are the stored
    token ids (train), or None to encode ``text`` here (prepare)."""

    where: str
    text: str
    ids: tuple[int, ...] | None = None


def normalise_whitespace(text: str) -> str:
    """Runs of whitespace collapsed to one space, ends stripped."""
    return " ".join(text.split())


def sample_indices(n: int, k: int = SAMPLE_SIZE) -> list[int]:
    """Up to ``k`` indices spread evenly over ``range(n)``, first and last included."""
    if n <= k:
        return list(range(n))
    if k <= 1:
        return [0][:k]
    return [round(i * (n - 1) / (k - 1)) for i in range(k)]


def roundtrip_report(tok, samples: Iterable[Sample]) -> dict:
    """``{"checked": N, "failed": K, "ok": K == 0}`` plus ``"first_failure": {"where", "text",
    "decoded"}`` when K > 0. Texts that are blank, cannot be encoded or encode to no ids are
    not counted (prepare records those items as failures on its own)."""
    checked, failed, first = 0, 0, None
    for s in samples:
        ids = s.ids
        if ids is None:
            if not s.text.strip():
                continue
            try:
                ids = tok(s.text, add_special_tokens=False)["input_ids"]
            except Exception:  # noqa: BLE001  (tokenizers raise assorted errors on odd input)
                continue
            if not len(ids):  # no ids at all: an untokenizable item, recorded by prepare
                continue
        checked += 1
        decoded = tok.decode(list(ids))  # exactly as generate and eval decode
        if normalise_whitespace(decoded) != normalise_whitespace(s.text):
            failed += 1
            if first is None:
                first = {"where": s.where, "text": s.text, "decoded": decoded}
    report = {"checked": checked, "failed": failed, "ok": failed == 0}
    if first is not None:
        report["first_failure"] = first
    return report


def _clip(text: str, n: int = 160) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def lossy_message(report: dict, tokenizer_path: str, accept: str) -> str:
    """The refusal: the first failing text, what came back, the tokenizer, the fix."""
    f = report["first_failure"]
    return (
        f"the text tokenizer {tokenizer_path} does not give back the texts it encodes "
        f"({report['failed']} of {report['checked']} sampled texts differ after decoding, "
        f"whitespace runs aside); first: {f['where']}: {_clip(f['text'])!r} came back as "
        f"{_clip(f['decoded'])!r}. Training would run, but every text the model writes (ASR "
        f"transcripts, replies) would come back the same way and eval would score it as "
        f"wrong: {FIX}, or {accept} to accept it knowingly"
    )


def enforce(report: dict, tokenizer_path: str, allow: bool, accept: str,
            warn: Callable[[str], None]) -> None:  # fmt: skip
    """Raise :class:`LossyTokenizerError` on a failed report, or ``warn`` one line if ``allow``."""
    if report.get("ok", True):
        return
    if not allow:
        raise LossyTokenizerError(lossy_message(report, tokenizer_path, accept))
    f = report["first_failure"]
    warn(
        f"the text tokenizer {tokenizer_path} does not reproduce {report['failed']} of "
        f"{report['checked']} sampled texts (e.g. {_clip(f['text'], 60)!r} -> "
        f"{_clip(f['decoded'], 60)!r}); accepted (allow_lossy_tokenizer): generated text "
        "will come back the same way"
    )


# --- prepare ---------------------------------------------------------------------------------
def input_samples(items) -> list[Sample]:
    """The texts of up to ``SAMPLE_SIZE`` input items that have text (``ManifestItem``s), spread
    over the corpus (every text turn of a sampled dialogue)."""

    def texts(it) -> list[Sample]:
        name = f"{it.where}: item {it.id!r}" if it.where else f"item {it.id!r}"
        if it.turns is None:
            return [Sample(name, it.text)] if it.text and it.text.strip() else []
        return [Sample(f"{name} turn {k}", t.text) for k, t in enumerate(it.turns)
                if t.audio is None and t.text and t.text.strip()]  # fmt: skip

    # two passes (count, then take): the items may be a source of 10^8 read from disk
    n = sum(1 for it in items if texts(it))
    want, out, k = set(sample_indices(n)), [], 0
    for it in items:
        got = texts(it)
        if got:
            if k in want:
                out += got
            k += 1
    return out


def check_inputs(tok, items, tokenizer_path: str, allow: bool) -> dict:
    """prepare's check (refuses, or warns with ``allow``); returns the report it records in
    metadata.json, with ``"allowed": true`` when a failed one was accepted."""
    report = roundtrip_report(tok, input_samples(items))
    enforce(report, tokenizer_path, allow, PREPARE_ACCEPT,
            lambda m: print(f"prepare: warning: {m}", file=sys.stderr, flush=True))  # fmt: skip
    return dict(report, allowed=True) if not report["ok"] else report


# --- train -----------------------------------------------------------------------------------
def dataset_samples(ds, name: str = "") -> list[Sample]:
    """The stored texts and ids of up to ``SAMPLE_SIZE`` items of a ``PreparedDataset`` that have
    text, spread over it."""
    import numpy as np

    with_text = ("speech", "text", "dialogue", "preference")
    codes = getattr(ds, "kind_codes", None)
    if codes is not None:  # the index's uint8 kinds: no string per item
        want = [KINDS.index(k) for k in with_text]
        idx = np.nonzero(np.isin(np.asarray(codes), want))[0]
    else:
        idx = np.nonzero(np.isin(np.asarray(ds.kinds), with_text))[0]
    out = []
    for j in sample_indices(len(idx)):
        it = ds[int(idx[j])]
        where = f"{name} item {it.id!r}".strip()
        if it.turns is None:
            out.append(Sample(where, it.text, tuple(int(x) for x in it.text_tokens)))
        else:
            out += [Sample(f"{where} turn {k}", t.text, tuple(int(x) for x in t.tokens))
                    for k, t in enumerate(it.turns) if t.modality == "text"]  # fmt: skip
    return out


def find_tokenizer(meta: dict, backbone_path: str = ""):
    """``(tokenizer, path)``: the tokenizer a dataset was prepared with, from the path its
    metadata records or else the backbone folder, if its vocabulary hash is the recorded one;
    ``(None, recorded path)`` when neither holds it."""
    want = meta.get("tokenizer", {})
    for path in dict.fromkeys(p for p in (want.get("path"), backbone_path) if p):
        if not any(os.path.isfile(os.path.join(path, f))
                   for f in ("tokenizer.json", "tokenizer_config.json")):  # fmt: skip
            continue
        try:
            tok = load_text_tokenizer(path)
        except Exception:  # noqa: BLE001  (not a loadable tokenizer: try the next folder)
            continue
        if tokenizer_fingerprint(tok)["hash"] == want.get("hash"):
            return tok, path
    return None, want.get("path", "")
