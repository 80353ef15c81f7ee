"""Which checkpoint a (re)started run continues from, decided before torchtitan loads one.

torchtitan's CheckpointManager loads the newest ``step-N`` folder that has a DCP ``.metadata``
and always asks it for the full training state. A last save made with
``checkpoint.last_save_model_only = true`` holds the weights only, so extending such a run
(rerun with a larger ``training.steps``) died in DCP with "Missing key in checkpoint state_dict:
dataloader.speechlm_stream". Our [checkpoint] default is a full last save; for folders that
have a weights-only newest checkpoint anyway, ``resolve_resume`` points torchtitan's own
``checkpoint.load_step`` at the newest *full* checkpoint, with a warning, or stops with an
error saying what to do; never a DCP traceback.

**Identity.** Every checkpoint step records what its rows mean (``run_identity``: the codec,
the text tokenizer, the vocabulary layout, the data order; utils/checkpoint_manifest.py writes
it into the step and its manifest), and ``check_checkpoint_identity`` compares the step a run
would load with the run's own, whatever else the dump folder holds: a checkpoint folder copied
into a new dump folder (no ``speechlm_run.json`` beside it) was trained on another codec's data
without a word (loss 3.80 -> 6.03) before.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

from torchtitan_speechlm.data.catalog import DataCatalog
from torchtitan_speechlm.model.codec_identity import CodecIdentity
from torchtitan_speechlm.model.pretrained import PretrainedError, read_export_config
from torchtitan_speechlm.model.run_record import (
    RUN_RECORD,
    RunRecordError,
    check_same_data,
    read_run_record,
    record_for_checkpoint,
)
from torchtitan_speechlm.model.starting_point import SAME, check_same
from torchtitan_speechlm.utils.checkpoint_folders import checkpoint_folder, complete_checkpoints
from torchtitan_speechlm.utils.checkpoint_manifest import read_identity
from torchtitan_speechlm.utils.upstream import logger


class ResumeError(ValueError):
    """The checkpoint folder cannot be continued; the message says what to do."""


def read_checkpoint_metadata(path: str):
    """DCP's ``Metadata`` of the checkpoint folder ``path`` (its ``.metadata``, a pickle), or a
    ResumeError naming the file, where its bytes stop making sense and the fix. A byte flipped
    on disk made DCP end in a bare ``'utf-8' codec can't decode byte 0x9d in position 19``."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(path).read_metadata()
    except Exception as e:  # pickle: UnicodeDecodeError, UnpicklingError, EOFError, ...
        error = e
    meta = os.path.join(path, ".metadata")
    where = ""
    try:  # how far the unpickler got: the byte offset of the damage
        import pickle

        with open(meta, "rb") as f:
            try:
                pickle.load(f)
            except Exception:
                where = f" near byte {f.tell()} of {os.path.getsize(meta)}"
    except OSError:
        pass
    folder, name = os.path.split(os.path.abspath(path))
    step = int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else None
    before = [s for s in complete_checkpoints(folder) if step is not None and s < step]
    instead = (
        f"Delete {path} to resume from step-{before[-1]}"
        if before
        else f"Delete {path} (no complete checkpoint before it: the run starts over)"
    )
    raise ResumeError(
        f"{meta} is corrupt{where} ({type(error).__name__}: {error}): the checkpoint cannot "
        f"be read. {instead}, or use another job.dump_folder"
    )


@lru_cache(maxsize=256)
def _keys(path: str, mtime_ns: int) -> frozenset[str]:
    return frozenset(read_checkpoint_metadata(path).state_dict_metadata)


def is_full(path: str) -> bool:
    """True if the DCP checkpoint at ``path`` holds the training state, not only weights."""
    meta = os.path.join(path, ".metadata")
    keys = _keys(path, os.stat(meta).st_mtime_ns)
    return any(k == "train_state" or k.startswith("train_state.") for k in keys)


def newest_full_step(job_config) -> int | None:
    folder = checkpoint_folder(job_config)
    full = [s for s in complete_checkpoints(folder) if is_full(os.path.join(folder, f"step-{s}"))]
    return full[-1] if full else None


def resolve_resume(job_config, model_args, data: DataIdentity) -> None:
    """Set ``checkpoint.load_step`` so that torchtitan resumes from a full checkpoint
    (``model_args`` and ``data``: the run's, to refuse an ``initial_load_path`` or
    ``speechlm.init_from`` made for another model or codec)."""
    ckpt = job_config.checkpoint
    check_resume_data(job_config, data)
    if not ckpt.enable:
        check_init_from(model_args, data.codec)
        return
    folder = checkpoint_folder(job_config)
    steps = complete_checkpoints(folder, warn=True)
    if not steps and ckpt.initial_load_path:
        check_initial_load(job_config, model_args, data.codec)
    if not steps:
        check_init_from(model_args, data.codec)
    if ckpt.load_step >= 0:
        path = os.path.join(folder, f"step-{ckpt.load_step}")
        if ckpt.load_step in steps and ckpt.load_step > 0 and not is_full(path):
            raise ResumeError(
                f"checkpoint.load_step = {ckpt.load_step}: {path} holds model weights only "
                "(written with checkpoint.last_save_model_only = true), not the optimizer and "
                f"data position a resume needs; choose one of the full checkpoints "
                f"{[s for s in steps if is_full(os.path.join(folder, f'step-{s}'))]}"
            )
        return
    if not steps or is_full(os.path.join(folder, f"step-{steps[-1]}")):
        return
    newest = steps[-1]
    full = newest_full_step(job_config)
    if full is None:
        raise ResumeError(
            f"{folder} holds only weights-only checkpoints (step-{newest} was written with "
            "checkpoint.last_save_model_only = true): there is no optimizer state or data "
            "position to resume from. To train further from these weights as a new run, use "
            f"another job.dump_folder with --checkpoint.initial_load_path {folder}/step-{newest} "
            "--checkpoint.initial_load_model_only true; to start over, delete "
            f"{job_config.job.dump_folder}"
        )
    logger.warning(
        f"{folder}/step-{newest} holds model weights only (checkpoint.last_save_model_only = "
        f"true); resuming from step-{full}, the newest full checkpoint, so steps "
        f"{full + 1}-{newest} are trained again (identically). Keep last_save_model_only = "
        "false to extend runs from their last step."
    )
    ckpt.load_step = full


@dataclass(frozen=True)
class DataIdentity:
    """What the data a run reads means: its codec, its text tokenizer (None: a Python data
    object's, not compared) and its datasets (name -> absolute path; none for a data object),
    as the run's catalog read them once (data/catalog.py)."""

    codec: CodecIdentity
    tokenizer: dict | None
    datasets: dict[str, str]

    @classmethod
    def of(cls, catalog: DataCatalog) -> DataIdentity:
        if not catalog.refs:  # a Python data object: its codec only
            return cls(catalog.codec, None, {})
        return cls(catalog.codec, catalog.tokenizer, {n: r.local for n, r in catalog.refs.items()})


@dataclass(frozen=True)
class DataOrder:
    """What orders a run's training data (its saved data position belongs to it): the mixture
    as ``TASK:NAME`` entries and the keys of ``[speechlm_data]`` that order it."""

    train: tuple[str, ...]
    seed: int
    shuffle: bool
    batching: str


# 2: the codec whole (model/codec_identity.py) and this version; 1 (no "version"): the codec's
# name and hash only. Both are read (``identity_difference`` compares the hashes).
IDENTITY_VERSION = 2


def run_identity(data: DataIdentity, order: DataOrder, vocab_fingerprint: str) -> dict:
    """What this run's checkpoints mean: its data's codec and text tokenizer, its vocabulary
    layout (``vocab_fingerprint``) and its data order."""
    identity = {
        "version": IDENTITY_VERSION,
        "codec": data.codec.to_dict(),
        "vocab": vocab_fingerprint,
        "data_order": {"train": list(order.train), "seed": order.seed, "shuffle": order.shuffle,
                       "batching": order.batching},
    }  # fmt: skip
    tokenizer = data.tokenizer
    if tokenizer and tokenizer.get("hash"):
        identity["tokenizer"] = {"hash": tokenizer["hash"], "path": tokenizer.get("path"),
                                 "vocab_size": tokenizer.get("vocab_size")}  # fmt: skip
    return identity


def identity_difference(saved: dict, ours: dict, data_order: bool = True) -> str | None:
    """The first way a checkpoint's identity differs from this run's, in words (None: the
    same, or nothing recorded to compare)."""
    old_codec = CodecIdentity.from_dict(saved.get("codec"))
    new_codec = CodecIdentity.from_dict(ours.get("codec"))
    if old_codec.same_codes(new_codec) is False:
        return (f"was trained on data made with codec {old_codec.describe()}, but this "
                f"run's data was made with codec {new_codec.describe()}: its audio rows "
                "mean the other codec's codes")  # fmt: skip
    old_tok, new_tok = saved.get("tokenizer") or {}, ours.get("tokenizer") or {}
    if old_tok.get("hash") and new_tok.get("hash") and old_tok["hash"] != new_tok["hash"]:
        return (f"was trained on data made with the text tokenizer {old_tok.get('path')} (hash "
                f"{old_tok['hash']}), but this run's data was made with {new_tok.get('path')} "
                f"(hash {new_tok['hash']}): its text rows mean the other tokenizer's ids")  # fmt: skip
    if saved.get("vocab") and ours.get("vocab") and saved["vocab"] != ours["vocab"]:
        return (f"was trained with vocabulary layout {saved['vocab']}, this run builds "
                f"{ours['vocab']} (another backbone, tokenizer or codec)")  # fmt: skip
    old_order, new_order = saved.get("data_order") or {}, ours.get("data_order") or {}
    for key in ("train", "seed", "shuffle", "batching") if data_order else ():
        if key in old_order and key in new_order and old_order[key] != new_order[key]:
            name = "speechlm_data.train" if key == "train" else f"speechlm_data.{key}"
            return (f"was trained in another data order: {name} was {old_order[key]!r}, this "
                    f"run has {new_order[key]!r} (its saved data position belongs to that "
                    "order)")  # fmt: skip
    return None


def check_checkpoint_identity(job_config, identity: dict, warn=None) -> None:
    """The step a resume loads (``checkpoint.load_step`` as chosen, else the newest) was
    trained on data of this run's identity; ResumeError naming the step, what differs and the
    fix. A step without one (written before checkpoints carried it) is loaded with a warning
    when no run record vouches for it either. ``dataloader`` in
    ``checkpoint.exclude_from_loading`` (the data stream restarted) skips the data order."""
    ckpt = job_config.checkpoint
    if not ckpt.enable:
        return
    folder = checkpoint_folder(job_config)
    steps = complete_checkpoints(folder)
    step = ckpt.load_step if ckpt.load_step > 0 else (steps[-1] if steps else None)
    if step is None or step not in steps:
        return
    path = os.path.join(folder, f"step-{step}")
    saved = read_identity(path)
    if saved is None:
        if not os.path.isfile(os.path.join(job_config.job.dump_folder, RUN_RECORD)):
            (warn or logger.warning)(
                f"{path} carries no identity (written before checkpoints recorded their codec, "
                "tokenizer and data order) and no run record is beside it: cannot check that "
                "this run's data means what it was trained on; loading it anyway"
            )
        return
    restarted = "dataloader" in (ckpt.exclude_from_loading or [])
    why = identity_difference(saved, identity, data_order=not restarted)
    if why:
        raise ResumeError(
            f"{path} {why}. To continue that run, use the data, tokenizer, codec and "
            "speechlm_data settings it was trained with; to train on this data, start a new run "
            f"in another job.dump_folder (speechlm.init_from {path} starts it from these weights "
            "if the codec and vocabulary are the same)"
        )


def check_resume_data(job_config, data: DataIdentity) -> None:
    """The dump folder's run record names the codec and tokenizer its checkpoints were trained
    on; data made with another one is refused (model/run_record.py: ``check_same_data``),
    before torchtitan loads a checkpoint and before any rank starts."""
    path = os.path.join(job_config.job.dump_folder, RUN_RECORD)
    if not os.path.isfile(path):
        return
    start_from = None
    if job_config.checkpoint.enable:
        folder = checkpoint_folder(job_config)
        done = complete_checkpoints(folder)
        start_from = os.path.join(folder, f"step-{done[-1]}") if done else None
    check_same_data(
        read_run_record(path), data.codec, data.tokenizer, data.datasets, path, start_from,
        logger.warning,
    )  # fmt: skip


def check_init_from(model_args, codec: CodecIdentity) -> None:
    """``speechlm.init_from`` of an export or a training checkpoint made for another
    vocabulary, pattern, backbone or codec (``codec``: the data's): refused here, before any
    rank starts (a rank loading the weights checks the model's keys again, not the codec:
    model/starting_point.py)."""
    if not model_args.init_from:
        return
    path = os.path.abspath(model_args.init_from)
    if not os.path.isdir(path):
        return  # a .pt state dict (no record), or missing: the rank's load says what is wrong
    try:
        if os.path.isfile(os.path.join(path, "config.json")):
            source = read_export_config(path)
        else:
            source = record_for_checkpoint(path)
    except (PretrainedError, RunRecordError):
        return  # the rank's load names what is wrong with the folder
    ours = {k: getattr(model_args, k) for k in SAME}
    try:
        check_same(source, ours, codec, f"speechlm.init_from = {path}")
    except PretrainedError as e:
        raise ResumeError(str(e)) from None


def check_initial_load(job_config, model_args, codec: CodecIdentity) -> None:
    """``checkpoint.initial_load_path`` of another run's DCP checkpoint: refuse one made for
    another vocabulary, pattern, backbone or codec before torchtitan loads it."""
    path = job_config.checkpoint.initial_load_path
    if job_config.checkpoint.initial_load_in_hf or not os.path.isdir(path):
        return
    try:
        record = record_for_checkpoint(path)
    except RunRecordError:
        return  # not one of our runs: torchtitan's own load reports what does not fit
    ours = {
        "vocab": model_args.vocab,
        "pattern": model_args.pattern,
        "backbone_config": model_args.backbone_config,
    }
    check_same(record, ours, codec, path)


def completed_run_step(job_config) -> int | None:
    """The step of a full checkpoint at or past ``training.steps``: the run has nothing left to
    do (torchtitan would load it and train nothing). None otherwise."""
    if not job_config.checkpoint.enable:
        return None
    folder = checkpoint_folder(job_config)
    done = [s for s in complete_checkpoints(folder) if s >= job_config.training.steps]
    return done[-1] if done else None
