"""Exact count-normalised statistics over data-parallel ranks, micro-batches and log intervals.

The model returns raw *sums* (``ce_loss`` = sum of weighted CE, ``acc_stream`` = correct
predictions per stream as an [N] vector, logged as ``acc_stream0``, ``acc_stream1``, ...,
``count`` = loss frames, ...). This accumulator adds them up over every micro-batch since the
last log, all-reduces the sums once over the loss mesh, and divides
each normalised key by the summed value of *its* count key. That is the exact token-weighted mean
over ranks, micro-batches and steps (not a mean of per-rank or per-step means).

Registering a new normalised key is one line in ``NORMALISED_KEYS`` (``{k}`` expands per stream).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

NORMALISED_KEYS: dict[str, str] = {
    "loss": "count",
    "ce_loss": "count",
    "z_loss": "count",
    "z_loss_s0": "count",
    "z_loss_mm": "count",
    "load_balance_loss": "count",
    "acc_layer0": "count_stream0",
    "ce_stream{k}": "count_stream{k}",
    "acc_stream{k}": "count_stream{k}",
    "router_aux_loss": "count",
    # preference training (model/preference.py): sums over pairs, means per pair
    "preference_loss": "count_pairs",
    "rewards/chosen": "count_pairs",
    "rewards/rejected": "count_pairs",
    "rewards/margins": "count_pairs",
    "rewards/accuracies": "count_pairs",
    "logps/chosen": "count_pairs",
    "logps/rejected": "count_pairs",
    "nll_loss": "count_pairs",
}


def loss_group(parallel_dims) -> dist.ProcessGroup | None:
    """The group statistics are summed over: torchtitan's "loss" mesh (every data-parallel and
    context-parallel rank), or None when there is nothing to reduce."""
    mesh = parallel_dims.get_optional_mesh("loss") if parallel_dims is not None else None
    return mesh.get_group() if mesh is not None else None


def normaliser_of(key: str) -> str | None:
    """The count key that ``key`` is divided by, or None for averaged (data) statistics."""
    if key in NORMALISED_KEYS:
        return NORMALISED_KEYS[key]
    for pattern, count in NORMALISED_KEYS.items():
        if "{k}" in pattern:
            prefix = pattern.split("{k}")[0]
            rest = key[len(prefix) :]
            if key.startswith(prefix) and rest.isdigit():
                return count.replace("{k}", rest)
    return None


class StatsAccumulator:
    """Sums statistic tensors locally; ``reduce`` turns them into logged means.

    A micro-batch's statistics (a few dozen small tensors) are concatenated into one vector and
    added to the running sum with one op, not one op per key: on a GPU each op is a kernel launch
    and they add up every micro-batch. The vector is named again only when it is reduced.
    """

    def __init__(self, data_stats_keys: tuple[str, ...] = ()):
        self.data_stats_keys = data_stats_keys
        self.reset()

    def reset(self) -> None:
        self._layout: tuple[tuple[str, torch.Size], ...] | None = None
        self._flat: torch.Tensor | None = None
        self._named: dict[str, torch.Tensor] = {}  # sums under layouts seen earlier
        self._micro_batches = 0

    def add(self, stats: dict[str, torch.Tensor], count_micro_batch: bool = True) -> None:
        layout = tuple((key, value.shape) for key, value in stats.items())
        flat = torch.cat([v.detach().reshape(-1).float() for v in stats.values()])
        if layout == self._layout:
            self._flat += flat
        else:  # first micro-batch, or other keys (e.g. a validation set's): name the old sums
            self._fold()
            self._layout, self._flat = layout, flat
        self._micro_batches += int(count_micro_batch)

    def _fold(self) -> None:
        """Move the running vector into named sums (``data_stats`` split into data/<name>)."""
        if self._flat is None:
            return
        at = 0
        for key, shape in self._layout:
            size = shape.numel()
            value = self._flat[at : at + size].view(shape)
            at += size
            if key == "data_stats":
                for name, v in zip(self.data_stats_keys, value.unbind(-1), strict=True):
                    self._add(f"data/{name}", v)
            else:
                self._add(key, value)
        self._layout = self._flat = None

    def _add(self, key: str, value: torch.Tensor) -> None:
        if key in self._named:
            self._named[key] = self._named[key] + value
        else:
            self._named[key] = value.clone()

    def reduce(self, group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """All-reduce the interval's sums (one collective) and normalise; resets the state."""
        self._fold()
        if not self._named:
            self.reset()
            return {}
        keys = sorted(self._named)
        device = self._named[keys[0]].device
        parts = [self._named[k].reshape(-1) for k in keys]
        flat = torch.cat(parts + [torch.tensor([float(self._micro_batches)], device=device)])
        if group is not None and dist.is_initialized():
            dist.all_reduce(flat, group=group)
        flat = flat.cpu()  # one device-to-host copy for every value
        sums, at = {}, 0
        for k, p in zip(keys, parts, strict=True):
            value = flat[at : at + p.numel()]
            at += p.numel()
            shape = self._named[k].shape
            if len(shape) == 0:
                sums[k] = value.item()
            elif k.endswith("_stream"):  # [N] per-stream sums -> ce_stream0, ce_stream1, ...
                sums.update({f"{k}{i}": v for i, v in enumerate(value.tolist())})
            else:
                sums[k] = value.view(shape)
        micro_batches = flat[-1].item()
        self.reset()
        return finalise(sums, micro_batches)


def finalise(sums: dict[str, float], micro_batches: float) -> dict[str, float]:
    """Normalise summed statistics: count-normalised keys, averaged data stats, derived ratios."""
    out: dict[str, float] = {}
    for key, value in sums.items():
        if key.startswith("codes_"):
            out.update(code_usage(key, value))
            continue
        if key == "expert_tokens":
            out.update(expert_shares(value))
            continue
        if key.startswith("count"):
            continue
        count_key = normaliser_of(key)
        if count_key is not None:
            denom = sums.get(count_key, 0.0)
            if denom > 0:  # a mean over nothing is not 0: the key is left out (metrics.md)
                out[key] = value / denom
        elif key.startswith("data/"):
            out[key] = value / max(micro_batches, 1.0)
    if "data/pad_frames" in sums and "data/frames" in sums:
        total = sums["data/pad_frames"] + sums["data/frames"]
        if total:
            out["data/padding_ratio"] = sums["data/pad_frames"] / total
            # a preference run's count is its pairs; its loss frames are the data's
            frames = (
                sums.get("data/loss_frames", 0.0)
                if "count_pairs" in sums
                else sums.get("count", 0.0)
            )
            out["data/loss_frame_ratio"] = frames / total
            if "data/audio_clips" in sums:  # runs with an audio encoder: MFU's tower share
                out["data/audio_clips_per_frame"] = sums["data/audio_clips"] / total
    for key in ("data/skipped_too_long", "data/skipped_bad", "data/cfg_dropped",
                "data/pref_identical"):  # fmt: skip
        if key in sums:
            out[key] = sums[key]  # counts over the interval, not means
    if "data/audio_frames" in sums:
        out["data/audio_frames_total"] = sums["data/audio_frames"]
    if "count_pairs" in sums:  # a preference run: its loss is normalised by pairs
        out["preference_pairs"] = sums["count_pairs"]
    else:
        out["loss_frames"] = sums.get("count", 0.0)
    return out


def code_usage(key: str, hist: torch.Tensor) -> dict[str, float]:
    """Per-stream codebook usage from a [N, C] histogram: fraction of entries used, perplexity."""
    kind = "pred" if "pred" in key else "target"
    out = {}
    for k, h in enumerate(hist):
        total = h.sum()
        if total <= 0:
            continue
        p = h[h > 0] / total
        out[f"codes/stream{k}/{kind}_usage"] = float((h > 0).float().mean())
        out[f"codes/stream{k}/{kind}_perplexity"] = float(torch.exp(-(p * p.log()).sum()))
    return out


def expert_shares(tokens: torch.Tensor) -> dict[str, float]:
    """An MoE's routing over the interval, from the tokens each expert received (all MoE layers,
    all ranks): each expert's share (1 / experts when balanced) and the busiest expert's load
    over the mean (1.0 when balanced; what expert-parallel ranks wait on)."""
    total = float(tokens.sum())
    if total <= 0:
        return {}
    out = {f"moe/expert{e}_share": float(t) / total for e, t in enumerate(tokens)}
    out["moe/expert_load_max_over_mean"] = float(tokens.max()) * len(tokens) / total
    return out
