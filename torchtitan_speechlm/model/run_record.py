"""``{dump_folder}/speechlm_run.json``: what a run's checkpoints hold, written at training start.

A DCP checkpoint holds tensors only. Exporting it, generating from it or starting another run
from its weights needs the model's shape and meaning: the resolved model args (backbone family
and config, vocabulary layout, pattern, tied head), the codec and tokenizer the data was made
with, and the backbone folder. Rank 0 writes them next to ``vocab.json``; a rerun refuses a
record of another model (the same rule as vocab.json), so a dump folder never mixes two.

Its paths (the backbone, codec, tokenizer and datasets) are written relative to the dump
folder when they lie inside it or inside the folder the run was started from (the project: a
clone with its ``demo_work/``), so the record names no user's home and a moved project still
resolves; others (a shared model folder, a URL) stay as they are. ``read_run_record`` gives
them back absolute, and reads records written with absolute paths alike.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, replace

from torchtitan_speechlm.model.codec_identity import CodecIdentity
from torchtitan_speechlm.utils.fileio import DamagedFileError, read_checked_json, write_checked_json

RUN_RECORD = "speechlm_run.json"
# 2: the codec recorded once, whole (``codec``: model/codec_identity.py); a version 1 record
# also kept its hash in ``model_args.codec_hash`` (still read: ``recorded_codec``)
RECORD_VERSION = 2
# what version 1 records (and exports) kept in ``model_args`` that the model args no longer have
LEGACY_MODEL_KEYS = ("codec_hash",)
# the model args that define the parameters and what they mean (others may change on resume)
IDENTITY_KEYS = ("backbone", "backbone_config", "vocab", "pattern", "tie_embeddings")


# backbone_config entries that name where the config was read from, not what the model is:
# transformers' ``_name_or_path`` is the path as spelled (``demo_work/backbone``, or absolute)
NOT_IDENTITY = ("_name_or_path",)


def comparable(key: str, value):
    """An identity value as compared: a backbone config without ``NOT_IDENTITY`` entries, so a
    backbone read through another spelling of its path (relative, absolute, moved) is the same."""
    if key == "backbone_config" and isinstance(value, dict):
        return {k: v for k, v in value.items() if k not in NOT_IDENTITY}
    return value


class RunRecordError(ValueError):
    """A run record is missing or belongs to another model; the message says what to do."""


def model_record(args) -> dict:
    """The model args as JSON would give them back (lists, not tuples)."""
    return json.loads(json.dumps({k: v for k, v in asdict(args).items() if k != "hf_assets_path"}))


def record_run(
    job_config, args, *, backbone_path: str, codec: CodecIdentity, tokenizer: dict, datasets: dict
) -> dict:
    """Write (rank 0) or check the record of this run's model; returns it (paths absolute).
    ``datasets``: name -> path as given."""
    record = {
        "version": RECORD_VERSION,
        "model_name": job_config.model.name,
        "flavor": job_config.model.flavor,
        "model_args": model_record(args),
        "hf_assets_path": os.path.abspath(backbone_path),
        "codec": codec.to_dict(),
        "tokenizer": tokenizer,
        "datasets": {name: _absolute(p) for name, p in datasets.items()},
    }
    dump = job_config.job.dump_folder
    path = os.path.join(dump, RUN_RECORD)
    if os.path.isfile(path):
        check_same_model(read_run_record(path), record["model_args"], path)
    elif int(os.environ.get("RANK", "0")) == 0:
        os.makedirs(dump, exist_ok=True)
        write_checked_json(path, _map_paths(record, lambda p: _relative(p, dump)))
    return record


def read_run_record(path: str) -> dict:
    """A run record, its paths absolute (written relative to its folder: see the module)."""
    if not os.path.isfile(path):
        raise RunRecordError(
            f"{path} not found: it is written by `torchtitan train` when a run starts; the "
            "checkpoint must sit in {dump_folder}/{checkpoint.folder}/step-N of such a run"
        )
    try:
        record = read_checked_json(path)
    except DamagedFileError as e:
        raise RunRecordError(
            f"{e}. It is the run's record of its model (written at its start); delete it and "
            "rerun: the run writes it again from its config, and each checkpoint's own identity "
            "is still checked against the data; or restore it from a copy"
        ) from None
    folder = os.path.dirname(os.path.abspath(path))
    return _map_paths(record, lambda p: os.path.normpath(os.path.join(folder, p)))


def _is_url(path: str) -> bool:
    return "://" in path


def _absolute(path: str) -> str:
    return path if _is_url(path) else os.path.abspath(path)


def _relative(path: str, dump: str) -> str:
    """``path`` relative to the dump folder if it lies inside it or inside this process's
    working folder (the project), else as it is (absolute)."""
    if not path or _is_url(path):
        return path
    path = os.path.abspath(path)
    for root in (os.path.abspath(dump), os.getcwd()):
        if path == root or path.startswith(root.rstrip(os.sep) + os.sep):
            return os.path.relpath(path, os.path.abspath(dump))
    return path


def _map_paths(record: dict, fn) -> dict:
    """``record`` with ``fn`` applied to each relative-or-absolute path it holds (URLs and
    absolute paths are kept by the reader's ``fn``: ``os.path.join`` keeps an absolute one)."""
    out = dict(record)

    def one(p):
        return p if not isinstance(p, str) or not p or _is_url(p) else fn(p)

    if "hf_assets_path" in out:
        out["hf_assets_path"] = one(out["hf_assets_path"])
    for key in ("codec", "tokenizer"):
        if isinstance(out.get(key), dict) and "path" in out[key]:
            out[key] = {**out[key], "path": one(out[key]["path"])}
    if isinstance(out.get("datasets"), dict):
        out["datasets"] = {k: one(v) for k, v in out["datasets"].items()}
    return out


def check_same_model(
    record: dict, model_args: dict, where: str, start_from: str | None = None
) -> None:
    """Raise naming the first identity key that differs (vocabulary, pattern, streams...).
    ``start_from``: a checkpoint of the recorded run a new run could start from (named in the
    message of a LoRA change, the usual reason: fine-tuning a finished run)."""
    old = model_args_of(record) if "model_args" in record else record
    for key in IDENTITY_KEYS:
        if comparable(key, old.get(key)) != comparable(key, model_args.get(key)):
            raise RunRecordError(
                f"{where} was made with another model: {key} differs ({_short(old.get(key))} vs "
                f"{_short(model_args.get(key))}); use a new dump_folder (or the original "
                "backbone, datasets and [speechlm] settings)"
            )
    # LoRA's settings (empty: none) define the adapters and what they compute (alpha / rank):
    # an export rebuilds them from the record, so a resumed run may not change them
    if (old.get("lora") or {}) != (model_args.get("lora") or {}):
        start = (
            f"--speechlm.init_from {start_from}"
            if start_from
            else "speechlm.init_from = one of its checkpoints (DUMP/checkpoint/step-N)"
        )
        raise RunRecordError(
            f"{where} was made with {describe_lora(old.get('lora'))}; this run asks for "
            f"{describe_lora(model_args.get('lora'))}. To continue that run, keep its "
            "model.converters and [lora] values; to train from its weights with these, start a "
            f"new run in another job.dump_folder with {start}"
        )


def describe_lora(settings: dict | None) -> str:
    """``no LoRA`` or ``LoRA rank=16, alpha=32.0, ...``: every setting, in words."""
    if not settings:
        return "no LoRA"
    return "LoRA " + ", ".join(f"{k}={v!r}" for k, v in settings.items())


def _short(value) -> str:
    """A value's JSON, cut (at an item boundary, never inside a word) to about 120 characters."""
    text = json.dumps(value, sort_keys=True)
    if len(text) < 120:
        return text
    cut = text.rfind(", ", 0, 110)
    return text[: cut if cut > 0 else 110] + ", ..."


def record_for_checkpoint(step_dir: str) -> dict:
    """The run record of a ``{dump}/{folder}/step-N`` checkpoint."""
    dump = os.path.dirname(os.path.dirname(os.path.abspath(step_dir)))
    return read_run_record(os.path.join(dump, RUN_RECORD))


def recorded_codec(record: dict) -> CodecIdentity:
    """The codec a run record (or an export's config.json, which carries the record's entries)
    names: its ``codec`` entry. A version 1 file kept the codec's hash in
    ``model_args.codec_hash`` too, and a record of a Python data object had it only there."""
    codec = CodecIdentity.from_dict(record.get("codec"))
    version = record.get("version", record.get("format_version", 1))
    legacy = (record.get("model_args") or {}).get("codec_hash")
    if not codec.config_hash and legacy and version < 2:
        codec = replace(codec, config_hash=str(legacy))
    return codec


def model_args_of(record: dict) -> dict:
    """A record's (or export's) model args without the keys version 1 files kept there that
    the model args no longer have (``LEGACY_MODEL_KEYS``)."""
    return {k: v for k, v in (record.get("model_args") or {}).items() if k not in LEGACY_MODEL_KEYS}


def _datasets(datasets: dict | None) -> str:
    return ", ".join(f"{k}={v}" for k, v in (datasets or {}).items()) or "?"


def check_same_data(
    record: dict,
    codec: CodecIdentity,
    tokenizer: dict | None,
    datasets: dict | None,
    where: str,
    start_from: str | None = None,
    warn=None,
) -> None:
    """The data a (re)started run reads was made with the codec and text tokenizer of the
    recorded run (the resume identity, beside IDENTITY_KEYS): a checkpoint's audio rows mean the
    codes of its codec and its text rows the ids of its tokenizer, and export / generate decode
    with the recorded codec. Raise naming both codecs (or tokenizers), the datasets and the fix.

    A record without a codec hash or tokenizer hash (older runs, or a Python data object with
    none) cannot be checked: ``warn`` says so and the run goes on."""
    old_codec, old_tok = recorded_codec(record), record.get("tokenizer") or {}
    old_data, new_data = _datasets(record.get("datasets")), _datasets(datasets)
    new_run = "start a new run in another job.dump_folder, from the backbone"
    if old_codec.same_codes(codec) is False:
        raise RunRecordError(
            f"{where} was trained on data made with codec "
            f"{old_codec.describe(record.get('datasets'))}, but speechlm_data.datasets "
            f"was made with codec {codec.describe(datasets)}: the checkpoints' audio rows mean "
            "the other codec's codes, and export and generate would decode with the recorded "
            "one. To continue that run, point speechlm_data.datasets at data prepared with "
            f"its codec (`torchtitan prepare ... --codec {old_codec.path or 'CODEC_DIR'} "
            f"--out-dir DIR`); to train on this data, {new_run} (speechlm.init_from refuses "
            f"weights trained on another codec's codes{_refused(start_from)})"
        )
    if not old_codec.config_hash and codec.config_hash and warn is not None:
        warn(
            f"{where} does not record the codec its checkpoints were trained with (an older "
            "run record): cannot check that speechlm_data.datasets was made with the same "
            f"one (it was made with codec {codec.describe(datasets)}); resuming anyway"
        )
    old_tok_hash, new_tok_hash = old_tok.get("hash"), (tokenizer or {}).get("hash")
    if old_tok_hash and new_tok_hash and old_tok_hash != new_tok_hash:
        raise RunRecordError(
            f"{where} was trained on data made with the text tokenizer {old_tok.get('path')} "
            f"(hash {old_tok_hash}, {old_tok.get('vocab_size')} tokens; datasets {old_data}), "
            f"but speechlm_data.datasets was made with {(tokenizer or {}).get('path')} (hash "
            f"{new_tok_hash}, {(tokenizer or {}).get('vocab_size')} tokens; datasets "
            f"{new_data}): the checkpoints' text rows mean the other tokenizer's ids. To "
            "continue that run, point speechlm_data.datasets at data prepared with its "
            f"tokenizer (`torchtitan prepare ... --tokenizer {old_tok.get('path') or 'DIR'} "
            f"--out-dir DIR`); to train on this data, {new_run}"
        )
    if not old_tok_hash and new_tok_hash and warn is not None:
        warn(
            f"{where} does not record the text tokenizer its checkpoints were trained with "
            "(an older run record): cannot check that speechlm_data.datasets "
            f"({new_data}) was made with the same one; resuming anyway"
        )


def _refused(start_from: str | None) -> str:
    return f", such as {start_from}" if start_from else ""
