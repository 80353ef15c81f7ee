"""Exact count-normalised statistics over data-parallel ranks, micro-batches and log intervals.

The model returns raw *sums* (``ce_loss`` = sum of weighted CE, ``acc_stream0`` = number of
correct stream-0 predictions, ``count`` = loss frames, ...). This accumulator adds them up over
every micro-batch since the last log, all-reduces the sums once over the loss mesh, and divides
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
    """Sums statistic tensors locally; ``reduce`` turns them into logged means."""

    def __init__(self, data_stats_keys: tuple[str, ...] = ()):
        self.data_stats_keys = data_stats_keys
        self.reset()

    def reset(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}
        self._micro_batches = 0

    def add(self, stats: dict[str, torch.Tensor], count_micro_batch: bool = True) -> None:
        for key, value in stats.items():
            value = value.detach().float()
            if key == "data_stats":
                for name, v in zip(self.data_stats_keys, value.unbind(-1), strict=True):
                    self._add(f"data/{name}", v)
            else:
                self._add(key, value)
        self._micro_batches += int(count_micro_batch)

    def _add(self, key: str, value: torch.Tensor) -> None:
        if key in self._sums:
            self._sums[key] += value
        else:
            self._sums[key] = value.clone()

    def reduce(self, group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """All-reduce the interval's sums (one collective) and normalise; resets the state."""
        if not self._sums:
            return {}
        keys = sorted(self._sums)
        device = self._sums[keys[0]].device
        parts = [self._sums[k].reshape(-1) for k in keys]
        flat = torch.cat(parts + [torch.tensor([float(self._micro_batches)], device=device)])
        if group is not None and dist.is_initialized():
            dist.all_reduce(flat, group=group)
        sums, at = {}, 0
        for k, p in zip(keys, parts, strict=True):
            value = flat[at : at + p.numel()]
            sums[k] = (
                value.item() if self._sums[k].dim() == 0 else value.view_as(self._sums[k]).cpu()
            )
            at += p.numel()
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
            out["data/loss_frame_ratio"] = sums.get("count", 0.0) / total
    for key in ("data/skipped_too_long", "data/skipped_bad", "data/cfg_dropped"):
        if key in sums:
            out[key] = sums[key]  # counts over the interval, not means
    if "data/audio_frames" in sums:
        out["data/audio_frames_total"] = sums["data/audio_frames"]
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
