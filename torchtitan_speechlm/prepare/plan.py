"""Planning and bookkeeping for ``torchtitan prepare``: sources, shards, resume, final files.

The *plan* (``<out>/plan.json``) records what a run was asked to do: the source, the codec and
tokenizer identity, the shard size and a hash of each shard's inputs. A rerun with the same plan
resumes (finished shards whose ``shard.json`` matches are kept); a different plan in the same
folder is refused, naming the first differing key, unless ``--overwrite``. Shard input hashes
cover each item's id, text, audio reference and audio file size (and its speaker, if the source
names one), so editing the corpus invalidates exactly the shards it touches.
"""

from __future__ import annotations

import json
import os
import re
import shutil

from torchtitan_speechlm.data.format import (
    FORMAT_VERSION,
    METADATA,
    SHARD_META,
    SHARDS_DIR,
    codec_of,
    fingerprint_shard,
    first_difference,
    read_json,
    shard_name,
    speaker_summary,
)
from torchtitan_speechlm.model.codec_identity import CodecIdentity
from torchtitan_speechlm.prepare.items import ManifestItem
from torchtitan_speechlm.prepare.parts import STATE_DIR
from torchtitan_speechlm.prepare.worker import FAILURES
from torchtitan_speechlm.utils.fileio import json_hash, write_json_atomic, write_text_atomic

PLAN = "plan.json"
SUMMARY = "summary.json"


class PlanMismatchError(ValueError):
    """``--out-dir`` holds a different preparation (or other files); the message names the key."""


def _size(path: str | None) -> int:
    try:
        return os.path.getsize(path) if path else -1
    except OSError:
        return -1


# 2: fileio.json_hash of the shard's item keys (plans without it were hashed another way; a
# rerun on such a folder asks for --overwrite, while the finished dataset trains unchanged)
INPUTS_HASH_VERSION = 2


def _item_key(it: ManifestItem) -> list:
    def ref(r):
        if r is None:
            return None
        key = [r.path, r.start, r.end, r.row, r.channel, _size(r.path)]
        return key if r.lhotse is None else [*key, r.lhotse]  # older plans' keys unchanged

    turns = [[t.role, t.text, ref(t.audio)] for t in it.turns] if it.turns is not None else None
    key = [it.id, it.kind, it.text, ref(it.ref), turns]
    key = key if it.speaker is None else [*key, it.speaker]  # unlabelled items' keys unchanged
    return key if it.extra is None else [*key, {"extra": it.extra}]  # (items without: unchanged)


def build_plan(items, source: dict, codec, tokenizer: dict, shard_size: int,
               allow_audio_only: bool) -> dict:  # fmt: skip
    codec_meta = CodecIdentity.of_codec(codec).to_dict()  # metadata.json's codec entry
    hashes, speakers = [], False  # one pass over the items (a spilled source: one read)
    for s in range(0, len(items), shard_size):
        shard = items[s : s + shard_size]
        speakers = speakers or any(it.speaker is not None for it in shard)
        hashes.append(json_hash([_item_key(it) for it in shard]))
    plan = {"format_version": FORMAT_VERSION, "source": source, "codec": codec_meta,
            "tokenizer": tokenizer, "shard_size": shard_size,
            "allow_audio_only": allow_audio_only, "num_inputs": len(items),
            "inputs_hash_version": INPUTS_HASH_VERSION, "shard_inputs": hashes}  # fmt: skip
    if speakers:  # absent without: older plans unchanged
        plan["speakers"] = True
    return json.loads(json.dumps(plan))  # same types as when read back from plan.json


def plan_difference(old: dict, new: dict) -> str | None:
    """First key that makes two plans different preparations (paths may move freely)."""
    key = first_difference(old, new)
    if key is not None:
        return key
    for k in (
        "format_version",
        "inputs_hash_version",
        "source",
        "speakers",
        "shard_size",
        "allow_audio_only",
        "num_inputs",
    ):
        if old.get(k) != new.get(k):
            return k
    key = codec_of(old).difference(codec_of(new), ("sample_rate", "total_streams"))
    if key is not None:
        return f"codec.{key}"
    pairs = zip(old.get("shard_inputs", []), new["shard_inputs"], strict=False)
    for s, (a, b) in enumerate(pairs):
        if a != b:
            return f"shard_inputs (inputs of shard {shard_name(s)} changed)"
    return None


def _clear(out_dir: str) -> None:
    meta = os.path.join(out_dir, METADATA)
    if os.path.exists(meta):
        os.remove(meta)  # first: the folder must stop looking like a finished dataset
    for name in os.listdir(out_dir):
        if name == STATE_DIR:  # the locks of the running parts (prepare/parts.py)
            continue
        p = os.path.join(out_dir, name)
        shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.remove(p)


def open_out_dir(out_dir: str, plan: dict, overwrite: bool, own: set[int] | None = None) -> bool:
    """Make ``out_dir`` ready for ``plan`` (resume, or refuse/replace another one); write
    plan.json; return True if this call created the folder. Stale temporary shard folders are
    deleted, only those of the shards in ``own`` (this part's; None: all)."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise FileExistsError(f"output path {out_dir} exists and is not a directory")
    created = not os.path.isdir(out_dir)
    if not created and set(os.listdir(out_dir)) - {STATE_DIR}:
        plan_file = os.path.join(out_dir, PLAN)
        if not os.path.isfile(plan_file):
            why = f"output directory {out_dir} is not empty and holds no {PLAN} of a preparation"
        else:
            try:
                key = plan_difference(read_json(plan_file), plan)
            except ValueError:
                key = PLAN
            why = (
                None
                if key is None
                else (f"{out_dir} holds a different preparation ({key} differs from this run's)")
            )
        if why is not None:
            if not overwrite:
                raise PlanMismatchError(
                    f"{why}; pass overwrite=True (--overwrite) to replace it, or use another "
                    "--out-dir"
                )
            _clear(out_dir)
    shards = os.path.join(out_dir, SHARDS_DIR)
    os.makedirs(shards, exist_ok=True)
    for name in os.listdir(shards):
        m = re.match(r"\.tmp-(\d+)-", name)
        if m and (own is None or int(m.group(1)) in own):  # left by an interrupted run
            shutil.rmtree(os.path.join(shards, name), ignore_errors=True)
    write_json_atomic(os.path.join(out_dir, PLAN), plan)
    return created


def shard_done(out_dir: str, index: int, inputs_hash: str, plan: dict) -> bool:
    """A finished shard of this plan exists (same inputs, codec layout and tokenizer)."""
    path = os.path.join(out_dir, SHARDS_DIR, shard_name(index), SHARD_META)
    try:
        meta = read_json(path)
    except ValueError:
        return False
    return (meta.get("format_version") == FORMAT_VERSION and meta.get("inputs_hash") == inputs_hash
            and first_difference(meta, plan) is None)  # fmt: skip


def finalize(out_dir: str, plan: dict, run_info: dict, checks: dict | None = None) -> dict:
    """Merge shard failures into failures.jsonl, write summary.json and (if any item survived)
    metadata.json, last; return the summary. ``checks``: the outcome of whole-corpus checks
    (``tokenizer_roundtrip``), recorded in metadata.json for training to read."""
    shards, failures, speakers = [], [], {}
    for s in range(len(plan["shard_inputs"])):
        sdir = os.path.join(out_dir, SHARDS_DIR, shard_name(s))
        meta = read_json(os.path.join(sdir, SHARD_META))
        shards.append({"name": shard_name(s), "num_items": meta["num_items"],
                       "total_audio_seconds": meta["total_audio_seconds"],
                       "total_text_tokens": meta["total_text_tokens"],
                       "total_frames": meta["total_frames"], "kinds": meta["kinds"],
                       "num_failed": meta["num_failed"],
                       "files": fingerprint_shard(sdir)})  # fmt: skip
        for name, n in meta.get("speakers", {}).items():
            speakers[name] = speakers.get(name, 0) + n
        with open(os.path.join(sdir, FAILURES), encoding="utf-8") as f:
            failures.extend(f.readlines())
    reasons: dict[str, int] = {}
    for line in failures:
        r = json.loads(line)["reason"]
        reasons[r] = reasons.get(r, 0) + 1
    kinds: dict[str, int] = {}
    for sh in shards:
        for k, v in sh["kinds"].items():
            kinds[k] = kinds.get(k, 0) + v
    totals = {
        "num_items": sum(s["num_items"] for s in shards),
        "total_audio_seconds": round(sum(s["total_audio_seconds"] for s in shards), 3),
        "total_text_tokens": sum(s["total_text_tokens"] for s in shards),
        "total_frames": sum(s["total_frames"] for s in shards),
        "kinds": dict(sorted(kinds.items())),
    }
    codec = codec_of(plan)
    n_streams = codec.num_streams
    voices = speaker_summary(speakers, totals["num_items"] - sum(speakers.values()))
    summary = dict(totals, out_dir=out_dir, hours=totals["total_audio_seconds"] / 3600,
                   num_streams=n_streams, audio_tokens_per_stream=totals["total_frames"],
                   audio_tokens=totals["total_frames"] * n_streams, items_written=totals["num_items"],
                   items_skipped=len(failures), skipped_by_reason=dict(sorted(reasons.items())),
                   num_shards=len(shards), speakers=voices, **run_info)  # fmt: skip
    write_text_atomic(os.path.join(out_dir, FAILURES), "".join(failures))
    write_json_atomic(os.path.join(out_dir, SUMMARY), summary)
    meta_path = os.path.join(out_dir, METADATA)
    if totals["num_items"] == 0:
        if os.path.exists(meta_path):
            os.remove(meta_path)
        return summary
    meta = {"format_version": FORMAT_VERSION, "codec": codec.to_dict(), "tokenizer": plan["tokenizer"],
            "source": plan["source"], "shard_size": plan["shard_size"], "shards": shards,
            "num_failed": len(failures), **(checks or {}), **totals}  # fmt: skip
    if speakers:  # only where the source named speakers: other datasets' metadata unchanged
        meta["speakers"] = voices
    write_json_atomic(meta_path, meta)
    return summary
