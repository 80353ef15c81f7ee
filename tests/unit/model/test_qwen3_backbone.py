"""The qwen3 backbone (torchtitan's qwen3 blocks, dense and MoE) against transformers as the
independent computation: the same text logits as Qwen3 / Qwen3-MoE from the same checkpoint,
transformers' load-balance loss over the real frames, a packed row equal to each sample alone,
the same loss as the hf backbone, a text LM export that transformers loads with the same
logits, and per-expert token counts; configs it cannot reproduce are refused by key."""

import json

import pytest
import torch

from tests.helpers import (
    QWEN3_DENSE,
    QWEN3_MOE,
    assert_packed_row_equals_each_sample,
    build_speechlm,
    make_tiny_run_assets,
    packed_row,
    random_batch,
    read_metrics,
    run_train,
    save_tiny_backbone,
    text_only_inputs,
    write_tiny_config,
)

DENSE = QWEN3_DENSE
MOE = QWEN3_MOE
VARIANTS = {
    "dense": ("qwen3", DENSE),
    "dense_tied": ("qwen3", dict(DENSE, tie=True)),
    "moe": ("qwen3_moe", MOE),
    # 4 layers: layer 1 dense by mlp_only_layers, layer 2 dense by decoder_sparse_step 2
    "moe_mixed": (
        "qwen3_moe",
        dict(
            MOE,
            num_hidden_layers=4,
            mlp_only_layers=[1],
            decoder_sparse_step=2,
            norm_topk_prob=False,
        ),
    ),
}


def save(tmp_path, variant):
    family, kw = VARIANTS[variant]
    return save_tiny_backbone(tmp_path / variant, family=family, **kw).eval()


def ids_batch(seed=0, b=2, t=19):
    return torch.randint(0, 96, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_text_logits_equal_transformers(tmp_path, variant):
    hf = save(tmp_path, variant)
    model = build_speechlm(tmp_path / variant, backbone="qwen3").eval()
    lay = model.args.layout
    ids = ids_batch()
    with torch.no_grad():
        ours = model.logits(text_only_inputs(lay, ids))[0]
        text = ours[..., lay.text_offset : lay.text_offset + lay.text_size]
        torch.testing.assert_close(text, hf(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


def test_moe_layers_follow_transformers_and_are_torchtitans_modules(tmp_path):
    """What torchtitan's apply_moe_ep_tp / apply_fsdp(ep_degree) read: ``moe_enabled``,
    ``moe.experts`` (GroupedExperts), ``moe.router.gate``."""
    from torchtitan.models.moe.moe import GroupedExperts, MoE

    hf = save(tmp_path, "moe_mixed")
    model = build_speechlm(tmp_path / "moe_mixed", backbone="qwen3")
    layers = model.backbone.layers
    assert [layers[str(i)].moe_enabled for i in range(4)] == [False, False, False, True]
    assert [type(layer.mlp).__name__ for layer in hf.model.layers] == [
        "Qwen3MoeMLP",
        "Qwen3MoeMLP",
        "Qwen3MoeMLP",
        "Qwen3MoeSparseMoeBlock",
    ]
    assert isinstance(layers["3"].moe, MoE) and isinstance(layers["3"].moe.experts, GroupedExperts)
    assert layers["3"].moe.expert_bias is None and layers["3"].moe.shared_experts is None
    assert model.family.moe(model.args.backbone_config) == (8, 2)
    assert model.family.expert_parallel and not model.family.tensor_parallel


def padded_text(lay, ids, lengths):
    """Text frames with each row's frames from ``lengths[b]`` on set to padding."""
    frames = text_only_inputs(lay, ids)
    real = torch.arange(ids.shape[1])[None] < torch.tensor(lengths)[:, None]
    frames[..., 0] = torch.where(real, frames[..., 0], lay.pad)
    return frames, real


@pytest.mark.parametrize("variant", ["moe", "moe_mixed"])
def test_aux_loss_is_transformers_load_balancing_loss_over_real_frames(tmp_path, variant):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    hf = save(tmp_path, variant)
    model = build_speechlm(tmp_path / variant, backbone="qwen3").eval()
    lay = model.args.layout
    ids = ids_batch(seed=3, t=23)
    frames, real = padded_text(lay, ids, [23, 14])
    with torch.no_grad():
        _, aux = model._backbone(frames, None)
        out = hf(input_ids=ids, attention_mask=real.long(), output_router_logits=True)
        want = load_balancing_loss_func(out.router_logits, 8, 2, real.long())
        unmasked = load_balancing_loss_func(out.router_logits, 8, 2, None)
    assert len(out.router_logits) == len(model.backbone.moe_layers)
    torch.testing.assert_close(aux, want, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(aux, unmasked)  # the padding is left out


def test_aux_loss_trains_the_router(tmp_path):
    save(tmp_path, "moe")
    model = build_speechlm(tmp_path / "moe", backbone="qwen3")
    inputs = text_only_inputs(model.args.layout, ids_batch())
    _, aux = model._backbone(inputs, None)
    aux.backward()
    gate = model.backbone.layers["0"].moe.router.gate.weight
    assert gate.grad is not None and gate.grad.abs().sum() > 0


def test_tokens_per_expert_count_every_frame_top_k_times(tmp_path):
    save(tmp_path, "moe_mixed")
    model = build_speechlm(tmp_path / "moe_mixed", backbone="qwen3").eval()
    assert torch.equal(model.family.expert_load(model.backbone), torch.zeros(1, 8))
    inputs, pos = packed_row(model.args.layout, [5, 11, 3], seed=4)
    with torch.no_grad():
        model.logits(inputs, position_ids=pos)
    load = model.family.expert_load(model.backbone)
    assert load.shape == (1, 8)  # one MoE layer (layer 3), 8 experts
    assert load.sum().item() == 19 * 2
    with torch.no_grad():  # the last forward's, not a running total
        model.logits(inputs[:, :5])
    assert model.family.expert_load(model.backbone).sum().item() == 5 * 2


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_a_packed_row_equals_each_sample_alone(tmp_path, variant):
    save(tmp_path, variant)
    model = build_speechlm(tmp_path / variant, backbone="qwen3").eval()
    assert_packed_row_equals_each_sample(model, [5, 11, 3, 9], seed=1)


@pytest.mark.parametrize("variant", ["dense", "moe_mixed"])
def test_qwen3_and_hf_backbones_give_the_same_loss(tmp_path, variant):
    save(tmp_path, variant)
    ours = build_speechlm(tmp_path / variant, backbone="qwen3", load_balance_weight=0.01)
    hf = build_speechlm(tmp_path / variant, load_balance_weight=0.01)
    inputs, targets, weights = random_batch(ours.args.layout)
    inputs[1, 20:, 0] = ours.args.layout.pad  # padding frames: out of the aux loss
    a = ours(inputs, targets=targets, loss_weights=weights)
    b = hf(inputs, targets=targets, loss_weights=weights)
    torch.testing.assert_close(a.loss_sum, b.loss_sum, atol=1e-4, rtol=1e-5)
    if variant != "dense":
        torch.testing.assert_close(
            a.stats["router_aux_loss"], b.stats["router_aux_loss"], atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize("variant", ["dense_tied", "moe_mixed"])
def test_text_lm_export_loads_in_transformers_with_the_same_logits(tmp_path, variant):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from torchtitan_speechlm.commands.export import save_text_lm

    src = save(tmp_path, variant)
    model = build_speechlm(tmp_path / variant, backbone="qwen3").eval()
    state = {n: p.detach() for n, p in model.named_parameters()}
    out = tmp_path / "text"
    save_text_lm(model, state, str(out), torch.float32, 1 << 30)
    hf = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = ids_batch(seed=5)
    with torch.no_grad():
        assert torch.equal(hf(input_ids=ids).logits, src(input_ids=ids).logits)
    for (n, p), (_, q) in zip(hf.named_parameters(), src.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    if variant == "moe_mixed":  # the Hub's per-expert names, as transformers saves them
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
        assert {f"model.layers.3.mlp.experts.{e}.up_proj.weight" for e in range(8)} <= keys
        assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_moe"


@pytest.mark.parametrize(
    "override, key",
    [
        (dict(use_sliding_window=True, sliding_window=8), "use_sliding_window"),
        (dict(rope_parameters={"rope_type": "linear", "factor": 2.0}), "rope_type"),
        (dict(attention_bias=True), "attention_bias"),
    ],
)
def test_configs_it_cannot_reproduce_are_refused_by_key(tmp_path, override, key):
    from torchtitan_speechlm.model.backbones import get_backbone

    save_tiny_backbone(tmp_path / "q", family="qwen3", **DENSE)
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    cfg.update(override)
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=key):
        get_backbone("qwen3").read_config(str(tmp_path / "q"))
    save_tiny_backbone(tmp_path / "llama", family="llama")
    with pytest.raises(ValueError, match="model_type"):
        get_backbone("qwen3").read_config(str(tmp_path / "llama"))


@pytest.mark.slow
def test_moe_trains_through_the_cli_with_the_load_balance_loss(tmp_path):
    assets = make_tiny_run_assets(tmp_path / "assets", n_items=24, family="qwen3_moe")
    dump = tmp_path / "run"
    cfg = write_tiny_config(tmp_path / "c.toml", assets, dump)
    r = run_train(
        cfg,
        "--model.flavor",
        "qwen3",
        "--training.steps",
        "6",
        "--speechlm.load_balance_weight",
        "0.01",
        "--checkpoint.enable",
        "false",
        "--validation.enable",
        "false",
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    rows = [m for m in read_metrics(dump) if "train/loss" in m]
    assert [m["step"] for m in rows] == list(range(1, 7))
    for m in rows:
        assert 1.5 < m["train/router_aux_loss"] < 3.0  # ~top_k for a near-uniform router
        assert m["train/load_balance_loss"] > 0.005
    last = [m["train/loss"] for m in rows[-3:]]
    assert sum(last) / 3 < 0.9 * rows[0]["train/loss"]
    record = json.loads((dump / "speechlm_run.json").read_text())
    assert record["model_args"]["backbone"] == "qwen3"
