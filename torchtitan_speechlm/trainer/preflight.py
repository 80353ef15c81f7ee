"""Start-up checks in the launching process, before any rank starts: what the job meets on
disk. The dump folder (writable? room for a checkpoint?), the checkpoints and run record already
in it (made for this model?), LoRA leaving something to train, and the text tokenizer's round
trip on the stored data (data/tokenizer_check.py). Each error names the key or path and the
fix; the free space check only warns (a checkpoint size is an estimate). The checks every
process runs are in checks.py.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import sys
from collections.abc import Callable

import torch
from torch.distributed.checkpoint import FileSystemReader

from torchtitan_speechlm.config import ConfigError
from torchtitan_speechlm.data.tokenizer_check import (
    TRAIN_ACCEPT,
    LossyTokenizerError,
    dataset_samples,
    enforce,
    find_tokenizer,
    roundtrip_report,
)
from torchtitan_speechlm.distributed.parallelize import apply_freeze
from torchtitan_speechlm.model.lora import LoraError, apply_lora
from torchtitan_speechlm.model.model import canonical_name
from torchtitan_speechlm.model.run_record import (
    RUN_RECORD,
    RunRecordError,
    check_same_model,
    model_record,
    read_run_record,
)
from torchtitan_speechlm.model.vocab import VocabLayout, VocabMismatchError
from torchtitan_speechlm.trainer.checks import check_conflicts, check_parallel_layout
from torchtitan_speechlm.trainer.plan import RunPlan
from torchtitan_speechlm.utils.checkpoint_folders import checkpoint_folder, complete_checkpoints
from torchtitan_speechlm.utils.upstream import get_train_spec

ADAMW_BYTES_PER_PARAM = 4 + 8  # fp32 weights + AdamW's two fp32 moments


def check_trainable(job_config, model) -> None:
    """With LoRA, something must still train after speechlm.freeze (the model args')."""
    if not model.args.lora:
        return
    try:
        apply_freeze(model, model.args.freeze)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(
            f"speechlm.freeze = {model.args.freeze} freezes every LoRA adapter and "
            "lora.train_audio_rows / train_head are false: nothing would train. Remove the "
            "prefixes that cover the adapters (backbone..., the wrapped layers), or narrow "
            "lora.target_modules instead"
        )


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def check_dump_folder(job_config) -> None:
    """The dump folder (and its checkpoint folder) can be created and written: probe it by
    creating what is missing and a file in it.

    The launching process removes what its probe made (a config error found later leaves
    nothing behind). A rank of a multi-rank job (``WORLD_SIZE`` > 1: torchrun or srun starting
    ``torchtitan train`` on every rank) keeps the folders: its peers probe the same folders at
    the same time, and one rank's clean-up removed the folder under another's probe (a fresh run
    folder on shared storage, the normal case on a cluster, failed "not writable"). srun
    without torchrun probes before its variables become ``WORLD_SIZE``, so ``SLURM_NTASKS``
    counts too (a rank's probe once found the checkpoint folder removed by its peer's)."""
    keep = any(int(os.environ.get(k, "1")) > 1 for k in ("WORLD_SIZE", "SLURM_NTASKS"))
    folders = [job_config.job.dump_folder]
    if job_config.checkpoint.enable:
        folders.append(checkpoint_folder(job_config))
    for folder in folders:
        existing = _nearest_existing(folder)
        if not os.path.isdir(existing):
            raise ConfigError(
                f"job.dump_folder: {folder} cannot be created because {existing} is a file; "
                "choose another folder (--job.dump_folder PATH)"
            )
        made, probe = [], None
        try:
            missing = []
            path = os.path.abspath(folder)
            while not os.path.exists(path):
                missing.append(path)
                path = os.path.dirname(path)
            for path in reversed(missing):
                try:
                    os.mkdir(path)
                    made.append(path)
                except FileExistsError:  # a peer rank made it first
                    pass
            probe = os.path.join(
                folder, f".speechlm-write-probe-{socket.gethostname()}-{os.getpid()}"
            )
            with open(probe, "w") as f:
                f.write("ok")
        except OSError as e:
            raise ConfigError(_unwritable(folder, e)) from None
        finally:
            if probe is not None and os.path.lexists(probe):
                os.remove(probe)  # also when the write failed: nothing is left behind
            for path in reversed(made if not keep else []):
                try:
                    os.rmdir(path)
                except OSError:
                    pass


def _unwritable(folder: str, e: OSError) -> str:
    """Why the probe could not write ``folder``, and the fix: a full disk is not a permission."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = f", {human_bytes(shutil.disk_usage(_nearest_existing(folder)).free)} free"
        except OSError:
            free = ""
        return (
            f"job.dump_folder: the disk of {folder} is full (ENOSPC{free}): not even a small "
            "file can be written there; free space on it or choose another folder "
            "(--job.dump_folder PATH)"
        )
    return (
        f"job.dump_folder: {folder} is not writable ({e.strerror or e}); checkpoints, "
        "logs and metrics go there: fix its permissions or choose another folder "
        "(--job.dump_folder PATH)"
    )


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _folder_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files
    )


def _meta_model(job_config, plan: RunPlan):
    """The job's model on the meta device (no memory, no weights read)."""
    spec = get_train_spec(job_config.model.name)
    args = plan.model_args
    with torch.device("meta"):
        model = spec.model_cls(args)
    if args.lora:  # what the lora converter does in the ranks
        try:
            apply_lora(model, args.lora)
        except LoraError as e:
            raise ConfigError(str(e)) from None
    return model, args


# DCP stores each tensor of each rank (a weight shard, its two moments, its step) as a record
# of its own (~1.7 KiB of headers and index each, measured on the tiny run); with the
# dataloader, scheduler and train state. An estimate that stays above the real size: the first
# save's estimate was 2.92 MiB for a 3.6 MiB checkpoint (issue 39, finding 6).
RECORD_BYTES_PER_TENSOR_PER_RANK = 16 << 10
FIXED_CHECKPOINT_BYTES = 4 << 20


def expected_checkpoint_bytes(job_config, model=None, world_size: int = 1) -> int:
    """Size of one checkpoint: the newest complete one if there is one, else an estimate from
    ``model`` that is never below the real size: parameters x (fp32 weight + AdamW's two
    moments), the persistent buffers, DCP's per-record overhead per tensor and rank, and a
    fixed part for the non-tensor state (0 without a model)."""
    folder = checkpoint_folder(job_config)
    done = complete_checkpoints(folder)
    if done:
        return _folder_bytes(os.path.join(folder, f"step-{done[-1]}"))
    if model is None:
        return 0
    params = dict(model.named_parameters())
    buffers = [t for k, t in model.state_dict().items() if k not in params]
    tensors = len(params) + len(buffers)
    return (
        sum(p.numel() for p in params.values()) * ADAMW_BYTES_PER_PARAM
        + sum(b.numel() * b.element_size() for b in buffers)
        + tensors * max(1, world_size) * RECORD_BYTES_PER_TENSOR_PER_RANK
        + FIXED_CHECKPOINT_BYTES
    )


def checkpoints_to_come(job_config) -> int:
    """How many more checkpoints the run will hold on disk at once, beyond those there: its
    saves still to come (every ``checkpoint.interval`` steps and the last step), of which
    ``keep_latest_k`` (0: all) plus the one being written are kept at a time."""
    ckpt = job_config.checkpoint
    done = complete_checkpoints(checkpoint_folder(job_config))
    start, end = (done[-1] if done else 0), job_config.training.steps
    interval = max(1, int(getattr(ckpt, "interval", 1) or 1))
    saves = len(range(start - start % interval + interval, end + 1, interval))
    saves += int(end > start and end % interval != 0)  # the last step is saved too
    k = ckpt.keep_latest_k
    if k <= 0:
        return max(1, saves)
    return max(1, min(k + 1, len(done) + saves) - len(done))


def check_free_space(job_config, model=None, warn=None, world_size: int = 1) -> str | None:
    """A warning (returned and passed to ``warn``) if the checkpoint folder's disk has less
    free space than the checkpoints this run keeps at once need (``checkpoints_to_come``);
    None when there is room or checkpoints are off."""
    if not job_config.checkpoint.enable:
        return None
    folder = checkpoint_folder(job_config)
    one = expected_checkpoint_bytes(job_config, model, world_size)
    count = checkpoints_to_come(job_config)
    need = one * count
    free = shutil.disk_usage(_nearest_existing(folder)).free
    if free >= need:
        return None
    k = job_config.checkpoint.keep_latest_k
    keep = f"keep_latest_k = {k} keeps up to {k + 1} at a time" if k else "all are kept"
    many = f"{count} more checkpoints need" if count > 1 else "one checkpoint needs"
    message = (
        f"only {human_bytes(free)} free on the disk of {folder}, but {many} about "
        f"{human_bytes(need)} ({human_bytes(one)} each; {keep}): a save will fail. Free space, "
        "point job.dump_folder elsewhere, or lower checkpoint.keep_latest_k"
    )
    (warn or (lambda m: print(f"torchtitan train: warning: {m}", file=sys.stderr)))(message)
    return message


def check_checkpoints_fit(job_config, model) -> None:
    """The newest complete checkpoint holds this model's parameters with these shapes (one
    from another run's vocabulary, pattern or backbone would fail deep inside DCP)."""
    if not job_config.checkpoint.enable:
        return
    folder = checkpoint_folder(job_config)
    done = complete_checkpoints(folder)
    step = job_config.checkpoint.load_step
    if step >= 0 and step not in done and step != 0:
        raise ConfigError(
            f"checkpoint.load_step = {step}: {folder} has no complete step-{step} (complete: "
            f"{done or 'none'}); choose one of those, or -1 for the newest"
        )
    if not done:
        return
    step = step if step > 0 else done[-1]
    path = os.path.join(folder, f"step-{step}")
    try:
        saved = FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as e:
        raise ConfigError(
            f"{path} is not a readable checkpoint ({e}); delete it to resume from the one "
            "before, or use another job.dump_folder"
        ) from None
    for name, param in model.named_parameters():
        key = canonical_name(name)
        meta = saved.get(key)
        if meta is None:
            raise ConfigError(
                f"{path} was written by another model: it has no parameter {key!r} (made with "
                "another backbone, vocabulary, pattern or tie setting). Use a new "
                "job.dump_folder, or the original model settings to resume it"
            )
        size = tuple(getattr(meta, "size", ()))
        if size and size != tuple(param.shape):
            raise ConfigError(
                f"{path} was written by another model: {key} has shape {list(size)} there but "
                f"{list(param.shape)} here (another vocabulary, codec or backbone size). Use a "
                "new job.dump_folder, or the original model settings to resume it"
            )


def check_run_record(job_config, args) -> None:
    """The dump folder's speechlm_run.json describes this model (else the rank would refuse
    it, after start-up)."""
    path = os.path.join(job_config.job.dump_folder, RUN_RECORD)
    if os.path.isfile(path):
        done = complete_checkpoints(checkpoint_folder(job_config))
        start_from = (
            os.path.join(checkpoint_folder(job_config), f"step-{done[-1]}") if done else None
        )
        try:
            check_same_model(read_run_record(path), model_record(args), path, start_from)
        except RunRecordError as e:
            raise ConfigError(str(e)) from None


def check_vocab_file(job_config, plan: RunPlan) -> None:
    """The dump folder's vocab.json is intact and this run's layout (else every rank would
    refuse it after start-up, each with its own line)."""
    path = os.path.join(job_config.job.dump_folder, "vocab.json")
    if os.path.isfile(path):
        try:
            plan.layout.check_same(VocabLayout.load(path), f"the run in {path}")
        except VocabMismatchError as e:
            raise ConfigError(str(e)) from None


def preflight(job_config, plan: RunPlan, world_size: int) -> None:
    """Every start-up check, in the launching process (raises ConfigError; warns on stderr)."""
    check_parallel_layout(job_config, world_size)
    check_conflicts(job_config)
    check_dump_folder(job_config)
    check_vocab_file(job_config, plan)
    model, args = _meta_model(job_config, plan)
    check_run_record(job_config, args)
    check_checkpoints_fit(job_config, model)
    check_free_space(job_config, model, world_size=world_size)
    check_trainable(job_config, model)


def check_training_data(
    job_config, plan: RunPlan, warn: Callable[[str], None] | None = None
) -> None:
    """train's check of every dataset the run reads (before any rank starts): decode stored ids
    of a sample of items and compare them with the stored texts; raises ``ConfigError``."""
    if plan.external is not None:  # a Python data object: no prepared texts
        return
    warn = warn or (lambda m: print(f"torchtitan train: warning: {m}", file=sys.stderr))
    catalog, allow_lossy = plan.data, job_config.speechlm_data.allow_lossy_tokenizer
    used = {e.dataset for e in catalog.entries()}
    tokenizers: dict[str, tuple] = {}
    for name, ref in catalog.refs.items():
        if name not in used:
            continue
        meta = ref.metadata
        key = str(ref.tokenizer.get("hash"))
        if key not in tokenizers:
            tokenizers[key] = find_tokenizer(meta, plan.backbone_path)
        tok, tok_path = tokenizers[key]
        label = tok_path
        if tok is not None:
            ds = catalog.open(name)
            report = roundtrip_report(tok, dataset_samples(ds, f"dataset {name!r}"))
        else:
            report = meta.get("tokenizer_roundtrip")
            if report is None:
                warn(
                    f"cannot check that the text tokenizer reproduces dataset {name!r}'s "
                    f"texts: its tokenizer {tok_path} is not found (nor in model.hf_assets_path) "
                    "and the dataset was prepared before prepare recorded that check"
                )
                continue
            label = f"{tok_path} (as torchtitan prepare recorded; that folder is not found)"
        try:
            enforce(report, label, allow_lossy, TRAIN_ACCEPT, warn)
        except LossyTokenizerError as e:
            raise ConfigError(f"dataset {name!r}: {e}") from None
