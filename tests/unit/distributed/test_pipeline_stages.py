"""The pipeline's cut (distributed/pipeline.py), without processes: stages chained by hand give
the whole model's loss, statistics and gradients on a packed batch; each stage keeps the whole
model's parameter names; the schedule's loss has the value of the sum and the gradient of the
mean (compat fix 10); torchtitan's stage rules, with the key named when a layout is refused."""

import pytest
import torch
from torchtitan.config.job_config import Parallelism

from tests.helpers import build_speechlm, random_batch, save_tiny_backbone
from torchtitan_speechlm.components.loss import SpeechLMLoss
from torchtitan_speechlm.components.stats import StatsAccumulator
from torchtitan_speechlm.distributed.pipeline import (
    StageLoss,
    check_stage_names,
    stage_indices,
    stage_layout,
    stage_module,
)


@pytest.fixture
def whole(tmp_path):
    save_tiny_backbone(tmp_path / "llama", family="llama", num_hidden_layers=4)
    return build_speechlm(tmp_path / "llama", backbone="native", tie=False)


def packed_batch(layout):
    """Two rows of several documents each (positions restart), some frames without loss."""
    inputs, targets, weights = random_batch(layout, b=2, t=30, seed=3)
    pos = torch.stack(
        [torch.cat([torch.arange(n) for n in lengths]) for lengths in ([7, 13, 10], [25, 5])]
    )
    return inputs, targets, weights, pos


def test_stages_chained_give_the_whole_models_loss_statistics_and_gradients(whole):
    names, _ = stage_layout(
        Parallelism(pipeline_parallel_degree=2, pipeline_parallel_schedule="Interleaved1F1B"), 4
    )
    assert (
        len(names) == 4 and names[0][0] == "tok_embeddings" and names[-1][-2:] == ["norm", "output"]
    )
    parts = [stage_module(whole, n) for n in names]
    for part in parts:  # the copies share nothing with the whole model
        part.load_state_dict(whole.state_dict(), strict=False)
    inputs, targets, weights, pos = packed_batch(whole.args.layout)

    ref = whole(inputs, targets=targets, loss_weights=weights, position_ids=pos)
    ref.loss_sum.backward()

    h = inputs
    for part in parts:
        h = part(h, targets=targets, loss_weights=weights, position_ids=pos)
    got = parts[-1].take_stage_output(h)
    got.loss_sum.backward()

    torch.testing.assert_close(got.loss_sum, ref.loss_sum, rtol=1e-6, atol=1e-6)
    assert set(got.stats) == set(ref.stats)
    for key, value in ref.stats.items():
        torch.testing.assert_close(got.stats[key], value, rtol=1e-6, atol=1e-6, msg=key)
    grads = {n: p.grad for part in parts for n, p in part.named_parameters()}
    assert set(grads) == {n for n, _ in whole.named_parameters()}  # each parameter in one stage
    for name, p in whole.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_the_schedules_loss_has_the_sums_value_and_the_means_gradient(whole):
    names, _ = stage_layout(Parallelism(pipeline_parallel_degree=2), 4)
    last = stage_module(whole, names[-1])
    last.load_state_dict(whole.state_dict(), strict=False)
    inputs, targets, weights, pos = packed_batch(whole.args.layout)
    h = torch.randn(2, 30, whole.args.hidden_size, requires_grad=True)
    accumulator = StatsAccumulator()
    loss = SpeechLMLoss(accumulator)
    loss.global_valid_tokens = torch.tensor(40.0)
    out = StageLoss(loss, last)(
        last(h, targets=targets, loss_weights=weights, position_ids=pos), None
    )
    out.backward()
    grad = h.grad.clone()
    h.grad = None
    ref = last(h, targets=targets, loss_weights=weights, position_ids=pos)
    assert out.item() == pytest.approx(ref.item(), rel=1e-6)  # the sum
    (last.take_stage_output(ref).loss_sum / 40.0).backward()
    torch.testing.assert_close(grad, h.grad)  # the mean's gradient
    stats = accumulator.reduce()
    assert stats["loss_frames"] > 0 and "ce_stream2" in stats


def test_a_stage_keeps_only_its_parts_under_the_whole_models_names(whole):
    part = stage_module(whole, ["layers.2", "layers.3", "norm", "output"])
    assert part.tok_embeddings is None and part.is_pipeline_stage
    assert sorted(part.backbone.layers) == ["2", "3"]
    names = {n for n, _ in part.named_parameters()}
    assert "backbone.layers.2.attention.wq.weight" in names and "head.output.weight" in names
    assert not any(n.startswith(("backbone.layers.0", "tok_embeddings")) for n in names)
    assert not whole.is_pipeline_stage and len(whole.backbone.layers) == 4


def test_ranks_run_looped_stages():
    assert stage_indices(4, 2, 0) == (0, 2)
    assert stage_indices(4, 2, 1) == (1, 3)
    assert stage_indices(2, 2, 1) == (1,)


@pytest.mark.parametrize(
    "settings, words",
    [
        (dict(pipeline_parallel_degree=4, pipeline_parallel_schedule="Interleaved1F1B"), "cuts the model's 4 layers into 8 stages"),
        (dict(pipeline_parallel_degree=2, pipeline_parallel_schedule="Interleaved1F1B", pipeline_parallel_layers_per_stage=3), "needs at least 2 stages per rank"),
        (dict(pipeline_parallel_degree=2, pipeline_parallel_layers_per_stage=2), "does not divide the 3 stages"),
        (dict(pipeline_parallel_degree=2, pipeline_parallel_layers_per_stage=1), "runs one stage per rank, but the layout has 3"),
        (dict(pipeline_parallel_degree=2, pipeline_parallel_schedule="Bogus"), "pipeline_parallel_schedule = 'Bogus'"),
        (dict(pipeline_parallel_degree=2, pipeline_parallel_schedule="ZBVZeroBubble"), "use 1F1B, Interleaved1F1B or GPipe"),
    ],
)  # fmt: skip
def test_a_layout_torchtitans_rules_refuse_names_the_key(settings, words):
    with pytest.raises(ValueError, match="parallelism.pipeline_parallel") as e:
        stage_layout(Parallelism(**settings), 4)
    assert words in str(e.value)


@pytest.mark.parametrize(
    "names, words",
    [
        ([["tok_embeddings", "layers.0", "layers.1"], ["layers.3", "layers.2", "norm", "output"]], "once each, in order"),
        ([["tok_embeddings", "layers.0"], ["layers.1", "layers.2", "layers.3", "head"]], "unknown names ['head']"),
        ([["layers.0", "layers.1"], ["tok_embeddings", "layers.2", "layers.3", "norm", "output"]], "tok_embeddings must be in the first stage"),
    ],
)  # fmt: skip
def test_given_stage_names_are_checked(names, words):
    with pytest.raises(ValueError, match="module_fqns_per_model_part") as e:
        check_stage_names(names, 4)
    assert words in str(e.value)
    check_stage_names(
        [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "output"]], 4
    )
