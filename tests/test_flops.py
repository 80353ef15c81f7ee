"""MFU's numerator: the FLOPs per frame we report equal what the model really runs."""

import pytest
from torch.utils.flop_counter import FlopCounterMode

from tests.helpers import build_speechlm, save_tiny_backbone
from tests.test_loss import random_batch
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
