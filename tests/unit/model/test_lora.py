"""LoRA's layers on the SpeechLM (model/lora.py, PEFT's LoRA layers): a LoRA step of the
decoder equals PEFT's own LoRA (``get_peft_model``) on the transformers model (loss and adapter
gradients); the optimizer holds state for the trainable tensors only and the text rows stay as
loaded; the count of what trains. Training runs with the converter, exports and bad settings:
tests/integration/test_lora_training.py; 2-process FSDP2, resume and TP=2: tests/integration/test_lora_parallel.py.
"""

import pytest
import torch
import torch.nn.functional as F
from torchtitan.config.job_config import Optimizer

from tests.helpers import (
    save_tiny_backbone,
    text_only_inputs,
)
from tests.lora_fixtures import TARGETS, lora_model, peft_name, random_batch
from torchtitan_speechlm.components.nonfinite import StepGuard
from torchtitan_speechlm.components.optim import build_speechlm_optimizers
from torchtitan_speechlm.model.lora import is_lora_param

peft = pytest.importorskip("peft")


def test_a_lora_step_equals_peft_lora_on_the_transformers_model(tmp_path):
    from transformers import AutoModelForCausalLM

    save_tiny_backbone(tmp_path / "bb")
    ours = lora_model(tmp_path / "bb")
    theirs = peft.get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(tmp_path / "bb"), dtype=torch.float32),
        peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS),
    )
    mine = {n: p for n, p in ours.named_parameters() if p.requires_grad}
    peft_params = dict(theirs.named_parameters())
    assert {peft_name(n) for n in mine} == {n for n, p in peft_params.items() if p.requires_grad}
    assert all(is_lora_param(n) for n in mine) and len(mine) == 2 * 3 * 2  # 3 targets x 2 layers
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B nonzero (PEFT starts it at 0) so that A gets gradients too
        for name, p in mine.items():
            if ".lora_B." in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            peft_params[peft_name(name)].copy_(p)
    layout = ours.args.layout
    text = slice(layout.text_offset, layout.text_offset + layout.text_size)
    ids = torch.randint(0, layout.text_size, (2, 12), generator=gen)

    def our_loss():
        h = ours.hidden_states(text_only_inputs(layout, ids))
        logits = F.linear(h, ours.head.output.weight[text])
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    def peft_loss():
        return theirs(input_ids=ids, labels=ids).loss

    opts = [
        torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
        for m in (ours, theirs)
    ]
    for step in range(2):
        a, b = our_loss(), peft_loss()
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=f"loss at step {step}")
        a.backward()
        b.backward()
        for name, p in mine.items():
            g = peft_params[peft_name(name)].grad
            assert g.abs().max() > 0, name
            torch.testing.assert_close(p.grad, g, atol=1e-5, rtol=0, msg=name)
        for opt in opts:
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("tie", [False, True])
def test_optimizer_holds_state_for_trainable_tensors_only(tmp_path, tie):
    save_tiny_backbone(tmp_path / "bb", tie=tie)
    model = lora_model(tmp_path / "bb", train_audio_rows=True)
    head = "tok_embeddings.weight" if tie else "head.output.weight"
    layout = model.args.layout
    text = slice(layout.text_offset, layout.text_offset + layout.text_size)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    container = build_speechlm_optimizers(
        [model],
        Optimizer(lr=1e-2, weight_decay=0.1, implementation="for-loop"),
        None,
        guard=StepGuard(),
    )
    inputs, targets, weights = random_batch(layout, 2, 10, torch.Generator().manual_seed(0))
    for _ in range(2):
        model(inputs, targets, weights).loss_sum.backward()
        container.step()
        container.zero_grad()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    names = {id(p): n for n, p in model.named_parameters()}
    with_state = {names[id(p)] for opt in container for p in opt.state}
    assert with_state == trainable
    assert trainable == {n for n in before if is_lora_param(n)} | {
        "tok_embeddings.weight",
        head,
        "head.stream_emb.weight",
    }
    for name, p in model.named_parameters():
        now = p.detach()
        if name in ("tok_embeddings.weight", head):
            # weight decay 0.1 would move the text rows: they must stay exactly as loaded
            assert torch.equal(now[text], before[name][text]), name
            assert not torch.equal(now[text.stop :], before[name][text.stop :]), name
        elif name in trainable and ".lora_A." not in name:  # A: no gradient while B = 0
            assert not torch.equal(now, before[name]), name
        elif name not in trainable:
            assert torch.equal(now, before[name]), name


def test_train_head_trains_its_text_rows_too(tmp_path):
    save_tiny_backbone(tmp_path / "bb")
    model = lora_model(tmp_path / "bb", train_head=True)
    assert model.head.frozen_rows is None and model.head.output.weight.requires_grad
    assert not model.tok_embeddings.weight.requires_grad
    inputs, targets, weights = random_batch(model.args.layout, 2, 8, torch.Generator())
    model(inputs, targets, weights).loss_sum.backward()
    text = model.args.layout.text_offset
    assert model.head.output.weight.grad[text : text + 8].abs().sum() > 0


@pytest.mark.parametrize("tie", [False, True])
def test_the_count_of_what_trains_leaves_the_held_text_rows_out(tmp_path, tie):
    """What the LoRA log reports as training: the adapters (r x (in + out) of each wrapped
    layer), the rows the SpeechLM added to the vocabulary in the embedding and the head (one
    tensor when tied), the stream offsets; not the text rows the gradient mask holds, nor the
    frozen base (computed here from the backbone's sizes)."""
    from torchtitan_speechlm.model.lora import trained_parameters

    save_tiny_backbone(tmp_path / "bb", tie=tie)  # hidden 32, 4 heads (2 kv), mlp 64, 2 layers
    model = lora_model(tmp_path / "bb", train_audio_rows=True)
    layout, d, r = model.args.layout, 32, 4
    head = model.args.backbone_config["head_dim"]  # Qwen3's own (128), not hidden / heads
    shapes = {"q_proj": (d, 4 * head), "v_proj": (d, 2 * head), "mlp.down_proj": (64, d)}
    adapters = 2 * sum(r * (i + o) for i, o in shapes.values())
    added = (layout.size - layout.text_size) * d
    assert (
        trained_parameters(model) == adapters + added * (1 if tie else 2) + layout.num_streams * d
    )
    everything = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert everything - trained_parameters(model) == layout.text_size * d * (1 if tie else 2)
