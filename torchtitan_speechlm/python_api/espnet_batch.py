"""The pieces of an ESPnet batch's conversion (``EspnetData.convert``, espnet_data.py) that do not
depend on its vocabulary: the batch's shape checked, its ``conti_feats`` as our continuous
inputs, the ``data_stats`` our metrics expect, and the all-padding stand-in row of validation."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch
from torchtitan.components.loss import IGNORE_INDEX

from torchtitan_speechlm.data.collation import data_stats_keys
from torchtitan_speechlm.data.tasks import TASKS
from torchtitan_speechlm.model.vocab import VocabLayout


class EspnetBatchError(ValueError):
    """An ESPnet batch that cannot be converted; the message says why and what to do."""


# ESPnet's data side accepts an entry named ``speaker`` (dataloader/task_conf.py) but none of its
# task templates puts it in ``seqs`` (docs/python-api.md, *Speaker prompts*): a batch that
# carried one beside the tokens would otherwise train as if it were not there.
SPEAKER_REFUSAL = (
    "the batch carries `speaker`, which ESPnet's task templates do not place in `seqs`; "
    "this trainer has no input for it: for speaker-prompted TTS prepare the corpus with its "
    "speakers (`torchtitan prepare`) and train `tts_prompt:NAME` through PreparedData "
    "(docs/python-api.md, Speaker prompts)"
)


def batch_arrays(batch: Mapping, n: int, audio: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``seqs`` (int64) and ``loss_masks`` (float) of a batch, both [B, T, n] with T >= 2; a
    batch with raw features (other than ``conti_feats``) is refused: ESPnet encodes those
    inside its model, and only tokens or one continuous io come through here; so is one with a
    ``speaker`` entry (``SPEAKER_REFUSAL``)."""
    if not isinstance(batch, Mapping) or "seqs" not in batch or "loss_masks" not in batch:
        got = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise EspnetBatchError(
            f"an ESPnet batch is a dict with `seqs` [B,T,N] and `loss_masks` [B,T,N] "
            f"(optional: position_ids, key, data_stats, cu_seq_lens); got {got}"
        )
    feats = [
        k
        for k, v in batch.items()
        if k != "conti_feats" and k.endswith("_feats") and v is not None and len(v) > 0
    ]
    if feats:
        raise EspnetBatchError(
            f"the batch carries raw features ({feats}) that ESPnet encodes inside its model; "
            "this trainer maps only `conti_feats` (one continuous io) onto [audio_encoder]: "
            "tokenise that audio offline (ESPnet's offline codec tokens, or `torchtitan "
            "prepare` and PreparedData)"
        )
    if batch.get("speaker") is not None:
        raise EspnetBatchError(SPEAKER_REFUSAL)
    seqs = torch.as_tensor(np.asarray(batch["seqs"])).long()
    masks = torch.as_tensor(np.asarray(batch["loss_masks"])).float()
    if seqs.ndim != 3 or seqs.shape[-1] != n or masks.shape != seqs.shape:
        raise EspnetBatchError(
            f"seqs {tuple(seqs.shape)} and loss_masks {tuple(masks.shape)} must both be "
            f"[B, T, {n}] ({n} = streams of the {audio!r} intervals)"
        )
    if seqs.shape[1] < 2:
        raise EspnetBatchError("seqs need at least 2 frames (input and target)")
    return seqs, masks


def continuous_inputs(
    conti: Mapping, b: int, t: int, continuous_frames: Callable | None
) -> dict[str, torch.Tensor]:
    """ESPnet's ``conti_feats`` -> our continuous inputs for ``b`` rows of ``t`` input frames
    (espnet_data.py's docstring); ``continuous_frames``: LM frames of n samples (the run's
    audio encoder), None without one."""
    if continuous_frames is None:
        raise EspnetBatchError(
            f"the batch carries conti_feats ({sorted(conti)}) but the run has no audio "
            "encoder: set [audio_encoder] path (docs/audio-encoder.md)"
        )
    if len(conti) != 1:
        raise EspnetBatchError(
            f"conti_feats has the continuous ios {sorted(conti)}; one maps onto "
            "[audio_encoder], tokenise the others offline"
        )
    ((io, (segments, padded)),) = conti.items()
    wave, lengths = padded
    wave = torch.as_tensor(np.asarray(wave), dtype=torch.float32)
    wave = wave.squeeze(-1) if wave.ndim == 3 and wave.shape[-1] == 1 else wave
    lengths = torch.as_tensor(np.asarray(lengths)).long()
    index, done = torch.full((b, t), -1, dtype=torch.long), 0
    for (row, start, length), n in zip(segments, lengths.tolist(), strict=True):
        ours = int(continuous_frames(n))
        if ours != int(length) or start + length > t:
            raise EspnetBatchError(
                f"conti_feats[{io!r}]: a segment of row {row} at frame {start} has {length} "
                f"frames in ESPnet's sequence, our audio encoder makes {ours} of its {n} "
                f"samples (sequence of {t + 1} frames); match [audio_encoder] stack to "
                "ESPnet's adaptor"
            )
        index[int(row), int(start) : int(start) + ours] = done + torch.arange(ours)
        done += ours
    return {"audio_wave": wave, "audio_lengths": lengths, "audio_index": index}


def batch_stats(
    inp: torch.Tensor,
    pad: torch.Tensor,
    pos: torch.Tensor,
    loss_frames: torch.Tensor,
    layout: VocabLayout,
    batch: Mapping,
) -> torch.Tensor:
    """The ``data_stats`` vector our statistics expect (data/stream.py), of the converted
    inputs: ``pad`` marks ESPnet's pads, ``loss_frames`` the targets with loss."""
    keys = data_stats_keys(layout.num_streams)
    real = ~pad.all(-1)
    stats = dict.fromkeys(keys, 0.0)
    stats["rows"] = float(inp.shape[0])
    stats["frames"] = float(real.sum())
    stats["pad_frames"] = float(real.numel() - real.sum())
    stats["loss_frames"] = float(loss_frames.sum())
    stats["examples"] = (
        float(((pos == 0) & real).sum())
        if batch.get("position_ids") is not None
        else float(real.any(-1).sum())
    )
    rel = inp - layout.stream_offset(0)
    codes = (rel >= 0) & (inp < layout.size) & (rel % (layout.codebook_size + 1) != 0)
    stats["audio_frames"] = float(codes.sum()) / layout.num_streams
    for k in range(layout.num_streams):
        stats[f"tokens_stream{k}"] = float((~pad[..., k]).sum())
    names = set(TASKS.names())
    for key in batch.get("key") or []:
        task = key[0] if isinstance(key, (tuple, list)) else None
        if task in names:
            stats[f"task_{task}"] += 1
    return torch.tensor([[stats[k] for k in keys]], dtype=torch.float32)


def pad_batch(layout: VocabLayout, t: int) -> tuple[dict, torch.Tensor]:
    """One all-padding row of ``t`` frames with no loss (a validation stand-in)."""
    n = layout.num_streams
    frame = torch.tensor(layout.pad_frame())
    ids = frame.expand(1, t, n).contiguous()
    input_dict = {
        "input": ids,
        "targets": ids.clone(),
        "loss_weights": torch.zeros(1, t, n),
        "position_ids": torch.arange(t).expand(1, t).contiguous(),
        "data_stats": torch.zeros(1, len(data_stats_keys(n))),
    }
    return input_dict, torch.full((1, t), IGNORE_INDEX)
