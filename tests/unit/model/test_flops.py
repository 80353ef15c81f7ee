"""MFU's numerator: the FLOPs per frame we report equal what the model really runs."""

import pytest
from torch.utils.flop_counter import FlopCounterMode

from tests.helpers import build_speechlm, random_batch, save_tiny_backbone
from torchtitan_speechlm.components.metrics import SpeechLMMetricsProcessor


@pytest.mark.parametrize("loss_share", [1.0, 0.375])
def test_reported_flops_match_counted_matmul_flops(tmp_path, loss_share):
    save_tiny_backbone(
        tmp_path / "bb", vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=3
    )
    model = build_speechlm(tmp_path / "bb", num_streams=4, codebook_size=128)
    t = 256
    inputs, targets, weights = random_batch(model.args.layout, b=1, t=t)
    weights[:] = 0.25
    weights[0, int(loss_share * t) :] = 0.0  # the rest carry no loss: the head skips them
    with FlopCounterMode(display=False) as counter:
        model(inputs, targets=targets, loss_weights=weights).loss_sum.backward()
    counted = counter.get_flop_counts()["Global"]
    matmul = sum(v for op, v in counted.items() if "mm" in str(op)) / t
    attention = sum(v for op, v in counted.items() if "attention" in str(op)) / t
    _, every_frame = model.args.get_nparams_and_flops(model, t)
    # what the metrics processor reports for an interval with this share of loss frames
    mp = object.__new__(SpeechLMMetricsProcessor)
    mp._head_flops = model.args.head_flops_per_loss_frame()
    mp.num_flops_per_token, mp._loss_frame_ratio = every_frame, loss_share
    reported = mp.num_flops_per_token
    hf = model.args.backbone_config
    attention_formula = 12 * hf["num_hidden_layers"] * hf["hidden_size"] * t
    # linear layers and the per-stream heads (the attention kernel is not counted on CPU)
    assert abs((reported - attention_formula) - matmul) / matmul < 0.01
    if attention:  # where the counter sees the attention kernel, it must agree too
        assert abs(attention - attention_formula) / attention_formula < 0.01


@pytest.mark.parametrize("freeze_encoder", [True, False])
def test_audio_tower_flops_are_counted_per_clip(tmp_path, freeze_encoder):
    """A model with a (tiny, Whisper-shaped) audio encoder, trained or frozen: the reported
    FLOPs per frame x frames equal the counted FLOPs of a real forward + backward, the tower's
    included (per clip: it always runs on the full window, whatever the clip's length)."""
    import torch

    from tests.tiny_whisper import save_tiny_whisper, whisper_config
    from torchtitan_speechlm.components.stats import StatsAccumulator
    from torchtitan_speechlm.data.collation import data_stats_keys
    from torchtitan_speechlm.model.audio.tower import AudioEncoderArgs

    save_tiny_backbone(
        tmp_path / "bb", vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=3
    )
    audio = AudioEncoderArgs.from_folder(
        save_tiny_whisper(tmp_path / "whisper"), stack=2, freeze_encoder=freeze_encoder
    )
    model = build_speechlm(
        tmp_path / "bb", num_streams=4, codebook_size=128, audio_encoder=audio.to_dict()
    ).train()
    b, t, lengths = 2, 64, [32000, 20000]  # a full 2 s window and a shorter clip
    inputs, targets, weights = random_batch(model.args.layout, b=b, t=t)
    index = torch.full((b, t), -1)
    at = 0
    for row, (first, n) in enumerate(zip((10, 20), lengths, strict=True)):
        frames = int(audio.output_frames(n))
        index[row, first : first + frames] = torch.arange(at, at + frames)
        weights[row, first : first + frames] = 0.0  # continuous frames carry no loss
        at += frames
    wave = torch.zeros(b, max(lengths))
    for row, n in enumerate(lengths):
        wave[row, :n] = 0.3 * torch.randn(n, generator=torch.Generator().manual_seed(row))
    keys = data_stats_keys(4)
    data_stats = torch.zeros(1, len(keys))
    data_stats[0, keys.index("frames")] = b * t
    with FlopCounterMode(display=False) as counter:
        out = model(
            inputs, targets=targets, loss_weights=weights, data_stats=data_stats,
            audio_wave=wave, audio_lengths=torch.tensor(lengths), audio_index=index,
        )  # fmt: skip
        out.loss_sum.backward()
    counted = counter.get_flop_counts()["Global"]
    matmul = sum(v for op, v in counted.items() if "mm" in str(op) or "conv" in str(op))
    attention = sum(v for op, v in counted.items() if "attention" in str(op))
    # the interval's statistics, as the metrics processor reads them
    acc = StatsAccumulator(keys)
    acc.add(out.stats)
    stats = acc.reduce()
    assert stats["data/audio_clips"] == b and stats["data/audio_clips_per_frame"] == b / (b * t)
    mp = object.__new__(SpeechLMMetricsProcessor)
    mp._head_flops = model.args.head_flops_per_loss_frame()
    mp._audio_flops = model.args.audio_flops_per_clip()
    mp.num_flops_per_token = model.args.get_nparams_and_flops(model, t)[1]
    mp.read_interval(stats)
    reported = mp.num_flops_per_token * b * t
    # attention by formula (the CPU attention kernel is not counted): the decoder's, and the
    # encoder's 4 x F^2 x d forward per layer and clip, 3x that where the encoder trains
    hf, enc = model.args.backbone_config, whisper_config()
    decoder_attention = 12 * hf["num_hidden_layers"] * hf["hidden_size"] * t * b * t
    f = enc.max_source_positions
    encoder_attention = (
        b * (1 if freeze_encoder else 3) * enc.encoder_layers * 4 * f * f * enc.d_model
    )
    attention_formula = decoder_attention + encoder_attention
    assert abs((reported - attention_formula) - matmul) / matmul < 0.01
    if attention:  # where the counter sees the attention kernels, they must agree too
        assert abs(attention - attention_formula) / attention_formula < 0.01
    # the tower is a real share here: leaving it out would miss by far more than the tolerance
    tower = mp._audio_flops * b
    assert tower / matmul > 0.05
    assert abs((reported - tower - attention_formula) - matmul) / matmul > 0.05


def test_no_audio_encoder_no_tower_stat(tmp_path):
    """Runs without an audio encoder log no new key and count nothing for a tower."""
    save_tiny_backbone(tmp_path / "bb")
    model = build_speechlm(tmp_path / "bb")
    inputs, targets, weights = random_batch(model.args.layout)
    out = model(inputs, targets=targets, loss_weights=weights)
    assert not any("audio_clips" in k for k in out.stats)
    assert model.args.audio_flops_per_clip() == 0
