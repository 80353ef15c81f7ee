"""MFU's numerator: the FLOPs per frame we report equal what the model really runs."""

from torch.utils.flop_counter import FlopCounterMode

from tests.helpers import build_speechlm, save_tiny_backbone
from tests.test_loss import random_batch


def test_reported_flops_match_counted_matmul_flops(tmp_path):
    save_tiny_backbone(tmp_path / "bb", vocab_size=500, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=3)
    model = build_speechlm(tmp_path / "bb", num_streams=4, codebook_size=128)
    t = 256
    inputs, targets, weights = random_batch(model.args.layout, b=1, t=t)
    weights[:] = 0.25  # every position carries loss, as in a packed training row
    with FlopCounterMode(display=False) as counter:
        model(inputs, targets=targets, loss_weights=weights).loss_sum.backward()
    counted = counter.get_flop_counts()["Global"]
    matmul = sum(v for op, v in counted.items() if "mm" in str(op)) / t
    attention = sum(v for op, v in counted.items() if "attention" in str(op)) / t
    _, reported = model.args.get_nparams_and_flops(model, t)
    hf = model.args.hf_config
    attention_formula = 12 * hf["num_hidden_layers"] * hf["hidden_size"] * t
    # linear layers and the per-stream heads (the attention kernel is not counted on CPU)
    assert abs((reported - attention_formula) - matmul) / matmul < 0.01
    if attention:  # where the counter sees the attention kernel, it must agree too
        assert abs(attention - attention_formula) / attention_formula < 0.01
