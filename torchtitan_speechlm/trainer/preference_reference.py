"""DPO's frozen reference: the run's starting weights score every pair once, before step 1.

DPO compares the policy's log-probs of a pair with a frozen reference model's. The reference
here is the model the run starts from (its backbone, ``init_from`` or
``checkpoint.initial_load_path``): before step 1 its log-probs of every pair of the training
mixture are computed in one finite, ordered pass over the data, each data-parallel rank
scoring its share with the model as it is sharded for training (no second model in memory,
nothing recomputed per step), gathered, and written to
``{dump_folder}/preference_reference/logps.npz`` with a record of what they depend on. The
training stream then hands each pair's two numbers to the loss with its tokens
(data/collation.py). A resumed run reads the file its first start wrote: its weights are no
longer the reference, so a missing or mismatched file is an error, not a recomputation.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist

from torchtitan_speechlm.data.planner import Unit
from torchtitan_speechlm.distributed.pipeline import STAGE_KWARGS
from torchtitan_speechlm.trainer.builders import stream
from torchtitan_speechlm.utils.fileio import write_json_atomic
from torchtitan_speechlm.utils.upstream import logger

REF_DIR = "preference_reference"
LOGPS = "logps.npz"
RECORD = "record.json"


class ReferenceError(RuntimeError):
    """The reference log-probs cannot be used (missing on a resume, made for another run)."""


def reference_record(job_config, plan) -> dict:
    """What the reference log-probs depend on: the starting weights, the loss weights (a
    sequence's log-prob sums them), the pattern and the training data."""
    s, ckpt = job_config.speechlm, job_config.checkpoint
    data = {name: _metadata_sha(path) for name, path in sorted(plan.data.datasets.items())}
    return {
        "weights": {
            "hf_assets_path": job_config.model.hf_assets_path,
            "init": s.init,
            "init_from": s.init_from,
            "initial_load_path": ckpt.initial_load_path,
        },  # fmt: skip
        "loss_weights": {
            "text_weight": s.text_weight,
            "audio_weight": s.audio_weight,
            "stream_weights": list(s.stream_weights),
        },  # fmt: skip
        "pattern": s.pattern,
        "train": list(job_config.speechlm_data.train),
        "datasets": data,
    }


def _metadata_sha(path: str) -> str:
    meta = os.path.join(path, "metadata.json")
    if not os.path.isfile(meta):  # an object-store URL: its path names it
        return path
    with open(meta, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def use_reference_logps(trainer) -> None:
    """Give the training stream (and the validation sets) their pairs' reference log-probs
    (DPO runs; others: nothing): read from the dump folder, or computed now on a run's first
    start (step 0)."""
    settings = trainer.run.model_args.preference_loss
    if settings is None or settings.kind != "dpo":
        return
    jc = trainer.job_config
    train = getattr(trainer.dataloader, "stream", None)
    if not hasattr(train, "set_reference_logps"):
        raise ReferenceError(
            'speechlm.preference_loss = "dpo" trains on the preference pairs of '
            "[speechlm_data] (*_pref tasks); this run's data has none"
        )
    folder = os.path.join(jc.job.dump_folder, REF_DIR)
    record = reference_record(jc, trainer.run.plan)
    have = _read_record(folder)
    if have is not None and have != record:
        changed = sorted(k for k in record if have.get(k) != record[k])
        raise ReferenceError(
            f"{folder} holds reference log-probs made for another run (differs in {changed}); "
            "a DPO run keeps its reference: restore the settings, or start a new dump_folder"
        )
    if have is None:
        if trainer.step > 0:
            raise ReferenceError(
                f"this DPO run resumes at step {trainer.step} but {folder}/{LOGPS}, its "
                "reference log-probs from its first start, is missing: the weights now are "
                "not the reference. Restore the file, or start a new dump_folder"
            )
        _save(folder, compute_reference_logps(trainer), record)
    table = _load(folder)
    attach(train, table)
    validator = getattr(trainer, "validator", None)
    if validator is not None and getattr(validator, "sets", None):
        validator.sets = {name: _attached(make, table) for name, make in validator.sets.items()}


def attach(stream, table: dict[str, np.ndarray]) -> None:
    """Hand a preference stream its sources' rows of the reference table (keyed by dataset)."""
    if getattr(stream, "preference", False):
        stream.set_reference_logps(
            {i: table[s.name] for i, s in enumerate(stream.sources) if s.name in table}
        )


def _attached(make, table: dict[str, np.ndarray]):
    def fresh():
        stream = make()
        attach(stream, table)
        return stream

    return fresh


def _passes(trainer, rank: int, world: int) -> list:
    """The finite passes the reference scores: the training mixture's items, and every
    validation set (which holds the held-out items the training pass does not)."""
    jc, plan = trainer.job_config, trainer.run.plan
    # a finite pass, in validation's rows and seq_len, or in training's under a pipeline (its
    # stages exchange those shapes only)
    shape = (plan.train_stream.finite() if trainer.parallel_dims.pp_enabled
             else plan.train_stream.for_validation(jc.validation))  # fmt: skip
    out = [stream(plan, plan.data.train, "train", shape, dp_rank=rank, dp_world_size=world)]
    validator = getattr(trainer, "validator", None)
    if jc.validation.enable and validator is not None:
        out += [make() for make in getattr(validator, "sets", {}).values()]
    return [s for s in out if getattr(s, "preference", False)]


PROGRESS_S = 5.0  # the longest the reference pass is silent (a large set takes minutes)


def compute_reference_logps(trainer) -> dict[str, np.ndarray]:
    """Every pair's (chosen, rejected) log-probs under the current weights, per dataset: this
    rank's share of finite passes over the training mixture and the validation sets, gathered
    from every rank."""
    pd = trainer.parallel_dims
    rank, world = (0, 1)
    if pd.dp_enabled:
        mesh = pd.get_mesh("batch")
        rank, world = mesh.get_local_rank(), mesh.size()
    pp, jc = pd.pp_enabled, trainer.job_config
    was_training = [m.training for m in trainer.model_parts]
    for m in trainer.model_parts:
        m.eval()
    rows, t0 = [], time.perf_counter()  # (dataset, item, chosen, rejected)
    said = t0
    try:
        with torch.no_grad():
            for pass_ in _passes(trainer, rank, world):
                names = [s.name for s in pass_.sources]
                # a rank whose share is done runs a stand-in batch of no pairs while another
                # still scores (the model's collectives need every rank), as validation does;
                # a pipeline's batches are all training's shape (its stages exchange no other)
                shape = (jc.training.local_batch_size, jc.training.seq_len) if pp else (1, 8)
                empty = pass_.collate(Unit(rows=[[]] * shape[0], t=shape[1]))
                it = iter(pass_)
                while True:
                    got = next(it, None)
                    if not _any_rank_has(got is not None, trainer.device):
                        break
                    batch, labels = got if got is not None else empty
                    if pp:
                        batch, labels = padded(batch, labels, *empty)
                    batch = dict(batch)
                    key = batch.pop("pref_key").numpy()
                    inputs = {k: v.to(trainer.device) for k, v in batch.items()}
                    if pp:
                        got_pairs, out = pipeline_logps(trainer, inputs, labels)
                        key = key[got_pairs]
                    else:
                        with trainer.maybe_enable_amp:
                            out = trainer.model_parts[0](
                                inputs.pop("input"), **inputs, pref_logps_only=True
                            )
                        out = out.float().cpu().numpy()
                    rows += [(names[int(s)], int(i), float(c), float(r))
                             for (s, i), (c, r) in zip(key, out, strict=True)]  # fmt: skip
                    if time.perf_counter() - said > PROGRESS_S and rank == 0:  # not silent
                        said = time.perf_counter()
                        logger.info(f"DPO reference: {len(rows)} pairs of this rank scored "
                                    f"({said - t0:.0f} s)")  # fmt: skip
    finally:
        for m, was in zip(trainer.model_parts, was_training, strict=True):
            m.train(was)
    parts = [rows]
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, rows)
    table = _table([r for part in parts for r in part])
    pairs = sum(int(np.isfinite(v[:, 0]).sum()) for v in table.values())
    logger.info(f"DPO reference: log-probs of {pairs} pairs under the starting weights "
                f"({time.perf_counter() - t0:.1f} s)")  # fmt: skip
    return table


def padded(batch: dict, labels: torch.Tensor, empty: dict, empty_labels: torch.Tensor):
    """``batch`` (and its ``labels``) written into the rows and frames of ``empty``, a batch of
    no pairs in the pipeline's shape (the extra frames carry no loss; causal attention keeps
    them from the real frames before them)."""
    out = {}
    for key, full in empty.items():
        got = batch[key]
        if key in ("pref_key", "pref_pairs", "pref_ref") or got.dim() < 2:
            out[key] = got  # per pair, not per row
            continue
        full = full.clone()
        full[: got.shape[0], : got.shape[1]] = got
        out[key] = full
    lab = empty_labels.clone()
    lab[: labels.shape[0], : labels.shape[1]] = labels
    return out, lab


def pipeline_logps(trainer, inputs: dict, labels: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """One micro-batch's pair log-probs through the pipeline schedule (forward only): (the
    micro-batch pair numbers the last stage scored, their [Q, 2] log-probs); empty on the
    ranks without the last stage, whose numbers the gather brings from those that have it."""
    last = [m for m in trainer.model_parts if m.head is not None]
    for m in last:
        m.reference_logps = []
    doc = inputs.pop("pref_doc")
    kwargs = {k: inputs[k] for k in STAGE_KWARGS if k in inputs}
    kwargs["pref_doc"] = doc
    target = labels.to(trainer.device) if trainer.pp_has_last_stage else None
    losses = [] if trainer.pp_has_last_stage else None
    try:
        with trainer.maybe_enable_amp:
            if trainer.pp_has_first_stage:
                trainer.pp_schedule.eval(inputs["input"], **kwargs, target=target, losses=losses)
            else:
                trainer.pp_schedule.eval(**kwargs, target=target, losses=losses)
        got = [r for m in last for r in m.reference_logps]
    finally:
        for m in last:
            m.reference_logps = None
    if not got:
        return np.zeros(0, dtype=np.int64), np.zeros((0, 2), dtype=np.float32)
    ids = torch.cat([i for i, _ in got]).cpu().numpy()
    logps = torch.cat([lp for _, lp in got]).cpu().numpy()
    return ids, logps


def _any_rank_has(has: bool, device) -> bool:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return has
    flag = torch.tensor([1.0 if has else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


def _table(rows: list[tuple[str, int, float, float]]) -> dict[str, np.ndarray]:
    """{dataset: [items, 2] log-probs, NaN where an item is no scored pair} (ranks of another
    parallel dimension repeat their share: the same numbers)."""
    out: dict[str, np.ndarray] = {}
    for name in sorted({r[0] for r in rows}):
        mine = [r for r in rows if r[0] == name]
        arr = np.full((max(r[1] for r in mine) + 1, 2), np.nan, dtype=np.float32)
        for _, item, c, r in mine:
            arr[item] = (c, r)
        out[name] = arr
    return out


def _read_record(folder: str) -> dict | None:
    path = os.path.join(folder, RECORD)
    if not os.path.isfile(path) or not os.path.isfile(os.path.join(folder, LOGPS)):
        return None
    with open(path) as f:
        return json.load(f)


def _save(folder: str, table: dict[str, np.ndarray], record: dict) -> None:
    """Rank 0 writes the log-probs, then their record (its presence means complete)."""
    if int(os.environ.get("RANK", "0")) == 0:
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".{LOGPS}.tmp")
        with open(tmp, "wb") as f:
            np.savez(f, **table)
        os.replace(tmp, os.path.join(folder, LOGPS))
        write_json_atomic(os.path.join(folder, RECORD), record)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _load(folder: str) -> dict[str, np.ndarray]:
    with np.load(os.path.join(folder, LOGPS)) as z:
        return {k: z[k] for k in z.files}
