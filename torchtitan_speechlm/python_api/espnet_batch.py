"""The pieces of an ESPnet batch's conversion (``EspnetData.convert``, espnet_data.py) that do not
depend on its vocabulary: the batch's shape checked, its ``conti_feats`` split by io (discrete
audio becomes the step codec's waveform segments, a continuous io our audio encoder's input),
the ``data_stats`` our metrics expect, and the all-padding stand-in row of validation."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch

from torchtitan_speechlm.components.step_codec import token_counts
from torchtitan_speechlm.data.collation import data_stats_keys
from torchtitan_speechlm.data.tasks import TASKS
from torchtitan_speechlm.model.vocab import VocabLayout
from torchtitan_speechlm.utils.upstream import IGNORE_INDEX


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

# ESPnet's task names -> ours, for the per-task counters (``train/data/task_*``)
ESPNET_TASKS = {"text_to_audio": "tts", "audio_to_text": "asr", "text_only": "text"}


def batch_arrays(batch: Mapping, n: int, audio: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``seqs`` (int64) and ``loss_masks`` (float) of a batch, both [B, T, n] with T >= 2; a
    batch with a ``speaker`` entry is refused (``SPEAKER_REFUSAL``)."""
    if not isinstance(batch, Mapping) or "seqs" not in batch or "loss_masks" not in batch:
        got = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise EspnetBatchError(
            f"an ESPnet batch is a dict with `seqs` [B,T,N] and `loss_masks` [B,T,N] "
            f"(optional: conti_feats, position_ids, key, data_stats, cu_seq_lens); got {got}"
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


def io_features(batch: Mapping) -> dict[str, tuple[list, torch.Tensor, torch.Tensor]]:
    """Each io's segments ``[(row, first frame, frames), ...]``, padded features and lengths,
    from ``conti_feats`` ({io: [segments, (features, lengths)]}, what ESPnet's collate_fn
    returns) or from ``{io}_indices`` / ``{io}_feats`` / ``{io}_lengths`` keys (the same,
    flattened, as some ESPnet versions hand their model)."""
    out = {}
    for io, (segments, padded) in (batch.get("conti_feats") or {}).items():
        feats, lengths = padded
        out[io] = (list(segments), feats, lengths)
    for key in list(batch):
        if key.endswith("_feats") and key != "conti_feats" and batch[key] is not None:
            io = key[: -len("_feats")]
            if f"{io}_indices" not in batch or f"{io}_lengths" not in batch:
                raise EspnetBatchError(
                    f"the batch has `{key}` without `{io}_indices` and `{io}_lengths`: an "
                    "io's raw input needs its segments (row, first frame, frames) and lengths"
                )
            out[io] = (list(batch[f"{io}_indices"]), batch[key], batch[f"{io}_lengths"])
    return {
        io: (
            [tuple(int(x) for x in s) for s in segments],
            torch.as_tensor(np.asarray(feats), dtype=torch.float32),
            torch.as_tensor(np.asarray(lengths)).long(),
        )
        for io, (segments, feats, lengths) in out.items()
        if len(segments)
    }


def looks_like_features(wave: torch.Tensor) -> bool:
    """A padded [n, L, D] with D > 2 holds feature vectors (ESPnet's ContinuousAudioIO: mel
    [frames, 128]); a waveform is [n, samples] or [n, samples, channels <= 2]."""
    return wave.ndim == 3 and wave.shape[-1] > 2


def step_audio(io: str, segments: list, wave: torch.Tensor, lengths: torch.Tensor) -> dict:
    """A discrete io's segments as the step codec's inputs (components/step_codec.py)."""
    if looks_like_features(wave):
        raise EspnetBatchError(
            f"conti_feats[{io!r}] holds features of width {wave.shape[-1]}, not waveforms; a "
            "discrete audio io hands its raw audio [samples, channels] to be tokenised"
        )
    return {
        "step_audio": wave,
        "step_audio_lengths": lengths,
        "step_audio_segments": torch.tensor(segments, dtype=torch.long).reshape(-1, 3),
    }


def continuous_inputs(
    io: str, segments: list, wave: torch.Tensor, lengths: torch.Tensor, b: int, t: int,
    continuous_frames: Callable | None, encoder: str = "",
) -> dict[str, torch.Tensor]:  # fmt: skip
    """A continuous io's waveforms -> our audio encoder's inputs for ``b`` rows of ``t`` input
    frames (espnet_data.py's docstring); ``continuous_frames``: LM frames of n samples (the
    run's audio encoder ``encoder``), None without one."""
    if looks_like_features(wave):
        raise EspnetBatchError(
            f"conti_feats[{io!r}] holds {wave.shape[-1]}-dim feature frames (ESPnet's "
            f"ContinuousAudioIO mel features), not waveforms; the run's [audio_encoder] "
            f"{encoder + ' ' if encoder else ''}reads waveforms [samples] at its sample rate: "
            "set ESPnet's preprocessor `audio_input: discrete_audio` (the audio tokenised in "
            "the step) or give the io raw waveforms"
        )
    if continuous_frames is None:
        raise EspnetBatchError(
            f"conti_feats[{io!r}] is continuous audio (no vocabulary interval) but the run has "
            "no audio encoder: set [audio_encoder] path (docs/audio-encoder.md), or set ESPnet's "
            "preprocessor `audio_input: discrete_audio` to tokenise it in the step"
        )
    wave = wave.squeeze(-1) if wave.ndim == 3 and wave.shape[-1] == 1 else wave
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
    pos: torch.Tensor,
    loss_frames: torch.Tensor,
    layout: VocabLayout,
    batch: Mapping,
) -> torch.Tensor:
    """The ``data_stats`` vector our statistics expect (data/stream.py), of the converted
    inputs (``loss_frames``: the targets with loss). The token counts are recounted by the step
    codec once it has placed the codes (components/step_codec.py)."""
    keys = data_stats_keys(layout.num_streams)
    stats = dict.fromkeys(keys, 0.0)
    stats.update({k: float(v) for k, v in token_counts(inp, layout).items()})
    stats["rows"] = float(inp.shape[0])
    stats["loss_frames"] = float(loss_frames.sum())
    real = ~(inp == torch.tensor(layout.pad_frame(), device=inp.device)).all(-1)
    if batch.get("position_ids") is not None:
        stats["examples"] = float(((pos == 0) & real).sum())
    else:
        stats["examples"] = float(real.any(-1).sum())
    names = set(TASKS.names())
    for key in batch.get("key") or []:
        task = key[0] if isinstance(key, (tuple, list)) else None
        task = ESPNET_TASKS.get(task, task)
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
