"""Logged statistics: exact count-normalised means over micro-batches, against plain PyTorch."""

import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import build_speechlm, random_batch, save_tiny_backbone
from torchtitan_speechlm.components.stats import StatsAccumulator, normaliser_of


def test_every_declared_key_has_its_count():
    assert normaliser_of("ce_loss") == "count"
    assert normaliser_of("acc_stream3") == "count_stream3"
    assert normaliser_of("ce_stream12") == "count_stream12"
    assert normaliser_of("acc_layer0") == "count_stream0"
    assert normaliser_of("data/examples") is None


def test_logged_stats_equal_an_independent_computation_over_micro_batches(tmp_path):
    save_tiny_backbone(tmp_path / "bb")
    z_w = 1e-3
    model = build_speechlm(tmp_path / "bb", z_loss_weight=z_w)
    with torch.no_grad():
        model.head.stream_emb.weight.normal_(0, 0.1)
    acc = StatsAccumulator(("examples",))
    batches = [random_batch(model.args.layout, b=2, t=20, seed=s) for s in (1, 2, 3)]
    for inputs, targets, weights in batches:
        out = model(
            inputs,
            targets=targets,
            loss_weights=weights,
            data_stats=torch.tensor([[float(inputs.shape[0])]]),
        )
        acc.add(out.stats)
    logged = acc.reduce()

    # independent: concatenate every position of every micro-batch, then one weighted mean
    ce_sum = z_sum = z0 = 0.0
    count = 0
    per = {k: [0.0, 0.0, 0.0] for k in range(3)}  # ce sum, correct, count
    with torch.no_grad():
        for inputs, targets, weights in batches:
            h = model.hidden_states(inputs)
            count += int((weights > 0).any(-1).sum())
            for k in range(3):
                a, b = model.args.layout.stream_range(k)
                offset = model.head.stream_emb.weight[k] if k else 0.0  # no offset on stream 0
                logits = (h + offset) @ model.head.output.weight[a:b].T
                tgt = targets[..., k] - a
                ce = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), reduction="none")
                w = weights[..., k].flatten()
                z = z_w * torch.logsumexp(logits, -1).flatten() ** 2
                ce_sum += float((w * ce).sum())
                z_sum += float((w * z).sum())
                z0 += float((w * z).sum()) if k == 0 else 0.0
                m = w > 0
                per[k][0] += float(ce[m].sum())
                per[k][1] += float((logits.argmax(-1).flatten() == tgt.flatten())[m].sum())
                per[k][2] += float(m.sum())
    assert logged["ce_loss"] == pytest.approx(ce_sum / count, abs=1e-5)
    assert logged["z_loss"] == pytest.approx(z_sum / count, abs=1e-5)
    assert logged["z_loss_s0"] == pytest.approx(z0 / count, abs=1e-5)
    assert logged["z_loss_mm"] == pytest.approx((z_sum - z0) / count, abs=1e-5)
    assert logged["loss"] == pytest.approx((ce_sum + z_sum) / count, abs=1e-5)
    for k in range(3):
        assert logged[f"ce_stream{k}"] == pytest.approx(per[k][0] / per[k][2], abs=1e-5)
        assert logged[f"acc_stream{k}"] == pytest.approx(per[k][1] / per[k][2], abs=1e-6)
    assert logged["acc_layer0"] == pytest.approx(per[0][1] / per[0][2], abs=1e-6)  # ESPnet's name
    assert logged["data/examples"] == pytest.approx(2.0)  # averaged per micro-batch
    assert logged["loss_frames"] == count


def test_zero_z_loss_weight_and_empty_counts_do_not_divide_by_zero(tmp_path):
    save_tiny_backbone(tmp_path / "bb")
    model = build_speechlm(tmp_path / "bb", z_loss_weight=0.0)
    inputs, targets, weights = random_batch(model.args.layout)
    weights[..., 1:] = 0.0  # streams 1.. carry no loss at all
    acc = StatsAccumulator()
    acc.add(model(inputs, targets=targets, loss_weights=weights).stats)
    logged = acc.reduce()
    assert logged["z_loss"] == 0.0  # a real zero: z-loss summed over loss frames
    # streams with nothing to count have no mean at all (not 0.0)
    for k in (1, 2):
        assert f"acc_stream{k}" not in logged and f"ce_stream{k}" not in logged
    assert "acc_stream0" in logged and "ce_stream0" in logged
    assert all(math.isfinite(v) for v in logged.values())


def test_code_usage_from_histograms():
    from torchtitan_speechlm.components.stats import code_usage

    hist = torch.tensor([[5.0, 5.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    out = code_usage("codes_pred_hist", hist)
    assert out["codes/stream0/pred_usage"] == 0.5
    assert out["codes/stream0/pred_perplexity"] == pytest.approx(2.0)
    assert out["codes/stream1/pred_perplexity"] == pytest.approx(4.0)


def switch_aux_loss(router_logits: list[torch.Tensor], top_k: int) -> float:
    """Switch-Transformer load balance, written out: E * sum_e f_e * P_e over all layers'
    tokens, f_e = share of (token, slot) assignments routed to e, P_e = mean router prob."""
    logits = torch.cat(router_logits).double()
    n_tokens, n_exp = logits.shape
    probs = logits.softmax(-1)
    chosen = probs.topk(top_k, -1).indices
    f = torch.zeros(n_exp, dtype=torch.float64)
    for e in range(n_exp):
        f[e] = (chosen == e).sum() / n_tokens
    return float(n_exp * (f * probs.mean(0)).sum())


def test_moe_load_balance_loss_equals_the_switch_formula(tmp_path):
    import transformers

    from tests.helpers import text_only_inputs

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        head_dim=8,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    hf = transformers.Qwen3MoeForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "moe")
    model = build_speechlm(tmp_path / "moe", load_balance_weight=0.5).eval()
    lay = model.args.layout
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    inputs = text_only_inputs(lay, ids)
    inputs[1, 6:, 0] = lay.pad  # padding frames: not routed tokens, left out of the loss
    targets = inputs.roll(-1, 1)
    weights = torch.zeros(*inputs.shape)
    weights[..., 0] = 1.0
    weights[1, 5:, 0] = 0.0
    real = (inputs[..., 0] != lay.pad).flatten()
    with torch.no_grad():
        ref = hf(input_ids=ids, output_router_logits=True)  # causal: pads change nothing before
        out = model(inputs, targets=targets, loss_weights=weights)
    # the router logits of the real frames, from transformers' own forward
    aux = switch_aux_loss([layer[real] for layer in ref.router_logits], top_k=2)
    assert 1.0 < aux < 3.0
    count = float(out.stats["count"])
    assert count == 2 * 9 - 4
    assert float(out.stats["router_aux_loss"]) / count == pytest.approx(aux, rel=1e-5)
    assert float(out.stats["load_balance_loss"]) == pytest.approx(0.5 * aux * count, rel=1e-5)
    lb_free = build_speechlm(tmp_path / "moe", load_balance_weight=0.0).eval()
    with torch.no_grad():
        base = lb_free(inputs, targets=targets, loss_weights=weights).loss_sum
    assert float(out.loss_sum - base) == pytest.approx(0.5 * aux * count, rel=1e-4)


def test_micro_batches_with_other_keys_are_summed_by_name():
    """The accumulator sums each micro-batch as one vector; a micro-batch with other keys
    (or shapes) is folded in by name, and per-stream [N] vectors are logged per stream."""
    acc = StatsAccumulator(("examples",))
    first = {
        "ce_loss": torch.tensor(2.0),
        "count": torch.tensor(4.0),
        "ce_stream": torch.tensor([1.0, 3.0]),
        "count_stream": torch.tensor([2.0, 2.0]),
    }
    acc.add(first)
    acc.add({k: v * 2 for k, v in first.items()})
    acc.add({"ce_loss": torch.tensor(6.0), "count": torch.tensor(2.0)}, count_micro_batch=False)
    acc.add({**first, "data_stats": torch.tensor([3.0])})
    logged = acc.reduce()
    assert logged["ce_loss"] == pytest.approx((2 + 4 + 6 + 2) / (4 + 8 + 2 + 4))
    assert logged["ce_stream0"] == pytest.approx((1 + 2 + 1) / (2 + 4 + 2))
    assert logged["ce_stream1"] == pytest.approx((3 + 6 + 3) / (2 + 4 + 2))
    assert logged["data/examples"] == pytest.approx(3.0 / 3)  # 3 counted micro-batches
    assert acc.reduce() == {}  # reset
