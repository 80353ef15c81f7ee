"""Fine-tuning controls: weight decay groups, the warmup -> cosine -> constant floor schedule,
the normal re-init and starting points (`speechlm.init_from`)."""

import math

import pytest
import torch
from torchtitan.config.job_config import LRScheduler, Optimizer

from tests.helpers import build_speechlm, save_tiny_backbone
from torchtitan_speechlm.components.nonfinite import StepGuard
from torchtitan_speechlm.components.optim import (
    build_speechlm_lr_schedulers,
    build_speechlm_optimizers,
)
from torchtitan_speechlm.model.pretrained import PretrainedError, write_safetensors


def test_no_weight_decay_on_embeddings_norms_and_biases(tmp_path):
    save_tiny_backbone(tmp_path / "bb", family="qwen2")  # qwen2 has q/k/v biases
    model = build_speechlm(tmp_path / "bb", weight_decay_exclude=["embeddings", "norms", "biases"])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_speechlm_optimizers(
        [model],
        Optimizer(lr=0.1, weight_decay=0.5, implementation="for-loop"),
        None,
        guard=StepGuard(),
    )
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # Adam's update is 0: only decoupled decay can move it
    opt.step()
    free = {"tok_embeddings.weight", "head.stream_emb.weight"}
    for name, p in model.named_parameters():
        exempt = name in free or name.endswith(".bias") or (p.ndim == 1 and "norm" in name)
        want = before[name] if exempt else before[name] * (1 - 0.1 * 0.5)
        torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=0, msg=name)
    assert any(n.endswith(".bias") for n in before) and "head.output.weight" in before


def espnet_lr(step: int, peak: float, warmup: int, decay_end: int, floor: float) -> float:
    """ESPnet's warmup -> cosine -> constant floor, written out (torchtitan's step index: the
    LR used by optimizer step s + 1 after s scheduler steps)."""
    s = step + 1
    if s <= warmup:
        return peak * s / warmup
    if s > decay_end:
        return peak * floor
    progress = (s - warmup - 1) / (decay_end - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def test_lr_warmup_cosine_then_constant_floor(tmp_path):
    save_tiny_backbone(tmp_path / "bb")
    model = build_speechlm(tmp_path / "bb")
    opt = build_speechlm_optimizers(
        [model], Optimizer(lr=1.0, implementation="for-loop"), None, guard=StepGuard()
    )
    warmup, decay_end, floor = 4, 20, 0.1  # docs/checkpoints.md's mapping:
    cfg = LRScheduler(
        warmup_steps=warmup,
        total_steps=decay_end,
        decay_type="cosine",
        decay_ratio=(decay_end - warmup) / decay_end,
        min_lr_factor=floor,
    )
    sched = build_speechlm_lr_schedulers(opt, cfg, training_steps=40, guard=StepGuard())
    got = []
    for _ in range(40):
        got.append(sched.schedulers[0].get_last_lr()[0])
        opt.step()
        sched.step()
    want = [espnet_lr(s, 1.0, warmup, decay_end, floor) for s in range(40)]
    assert got == pytest.approx(want, abs=0.02)  # the step-grid conventions differ by <= 1 step
    assert got[decay_end:] == [pytest.approx(floor)] * (40 - decay_end)  # held at the floor
    assert max(got) == pytest.approx(1.0)


def test_normal_init_ignores_the_pretrained_weights(tmp_path):
    pretrained = save_tiny_backbone(tmp_path / "bb", hidden_size=64, intermediate_size=256)
    a = build_speechlm(tmp_path / "bb", load_weights=False, init_std=0.05)
    b = build_speechlm(tmp_path / "bb", load_weights=False, init_std=0.05)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), n  # a pure function of (seed, name): the same on every rank
    w = dict(a.named_parameters())
    mlp = w["backbone.layers.0.mlp.up_proj.weight"]
    assert mlp.std().item() == pytest.approx(0.05, rel=0.05)
    assert not torch.allclose(mlp, pretrained.model.layers[0].mlp.up_proj.weight)
    assert (w["backbone.norm.weight"] == 1).all()


def test_init_from_a_state_dict_with_a_name_map(tmp_path):
    save_tiny_backbone(tmp_path / "bb")
    src = build_speechlm(tmp_path / "bb", init_seed=7)  # other random speech rows
    espnet = {
        "module": {
            k.replace("backbone.", "lm.decoder."): v.clone() for k, v in src.state_dict().items()
        }
    }
    torch.save(espnet, tmp_path / "espnet.pt")
    got = build_speechlm(
        tmp_path / "bb",
        init_from=str(tmp_path / "espnet.pt"),
        init_from_map=["lm.decoder.=backbone."],
    )
    for (n, p), (_, q) in zip(src.named_parameters(), got.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    del espnet["module"]["head.stream_emb.weight"]
    torch.save(espnet, tmp_path / "partial.pt")
    with pytest.raises(PretrainedError, match=r"missing \['head.stream_emb.weight'\]"):
        build_speechlm(
            tmp_path / "bb",
            init_from=str(tmp_path / "partial.pt"),
            init_from_map=["lm.decoder.=backbone."],
        )
    kept = build_speechlm(
        tmp_path / "bb",
        init_from=str(tmp_path / "partial.pt"),
        init_from_map=["lm.decoder.=backbone."],
        init_from_allow_missing=["head.stream_emb"],
    )
    assert torch.equal(kept.head.stream_emb.weight, torch.zeros_like(src.head.stream_emb.weight))
    with pytest.raises(PretrainedError, match="unexpected"):
        build_speechlm(tmp_path / "bb", init_from=str(tmp_path / "espnet.pt"))


def test_init_from_an_export_of_another_vocabulary_is_refused(tmp_path):
    import json

    save_tiny_backbone(tmp_path / "bb")
    src = build_speechlm(tmp_path / "bb", num_streams=3)
    out = tmp_path / "export"
    out.mkdir()
    write_safetensors(src.state_dict(), str(out), 1 << 30)
    record = {
        "model_type": "speechlm",
        "model_args": json.loads(
            json.dumps(
                {
                    k: getattr(src.args, k)
                    for k in ("vocab", "pattern", "backbone", "backbone_config", "tie_embeddings")
                }
            )
        ),
    }
    (out / "config.json").write_text(json.dumps(record))
    same = build_speechlm(tmp_path / "bb", num_streams=3, init_from=str(out))
    assert torch.equal(same.tok_embeddings.weight, src.tok_embeddings.weight)
    with pytest.raises(PretrainedError, match="another vocab"):
        build_speechlm(tmp_path / "bb", num_streams=4, init_from=str(out))
    with pytest.raises(PretrainedError, match="another pattern"):
        build_speechlm(tmp_path / "bb", num_streams=3, pattern="parallel", init_from=str(out))
