"""Our preference losses (model/preference.py) against TRL's own code on the text stream.

The same hidden states, output matrix and targets go through both: ours through the chunked
head (``preference_loss_sum``, ``sequence_logps``, ``pair_terms``), TRL's through the code its
trainers run, pinned to TRL 1.16.0 (the dev extra):

* DPO: ``DPOTrainer._compute_loss`` (log-probs by TRL's fused LM head ``add_fused_lm_head``,
  summed over the completion tokens; reference log-probs precomputed, as ours are, by
  ``DPOTrainer.compute_ref_log_probs``);
* SimPO: ``CPOTrainer.get_batch_loss_metrics`` with ``loss_type="simpo"`` (TRL's SimPO; full
  logits, ``selective_log_softmax``, averaged over the completion tokens).

Both trainers' ``__init__`` want a Hugging Face model, a tokenizer and a dataset, so the
trainers are made without it (``Trainer.__new__``) and carry the attributes those methods
read, set as ``__init__`` sets them from a config; the model is a stand-in whose backbone
returns our hidden states laid out as TRL's causal rows (row ``i``'s state at position ``t``
predicts token ``t + 1``) and whose output layer is the text slice of our output matrix.

TRL 1.16's DPO ``"sigmoid"`` loss has no label smoothing (``label_smoothing`` is read only by
``"robust"``, ``"exo_pair"`` and the ``"aot"`` losses), and its RPO term is the ``"sft"`` loss,
the chosen answers' NLL averaged over all chosen tokens of the batch. So label-smoothed and
NLL-weighted DPO is compared one pair per TRL call: for a single pair ``"aot"`` (its sorts
over the batch are then the identity) is the conservative-DPO loss
``-(1 - ls) log sigmoid(z) - ls log sigmoid(-z)``, and ``"sft"`` is that pair's NLL per token,
as ours is. CPO's SimPO has label smoothing, and its ``cpo_alpha`` NLL term is likewise a
token mean over the batch (per pair with one pair a call).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections import defaultdict

import pytest
import torch
from torch import nn

# TRL (about 1 s to import) is imported where a trainer or its fused head is made, not when
# the module is collected: every test worker collects this file, one runs it
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("trl") is None, reason="trl is not installed (the dev extra)"
)
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # trl.experimental's import warning

from transformers import PretrainedConfig  # noqa: E402

from tests.unit.model.test_preference_loss import DIM, random_targets, tiny_head  # noqa: E402
from torchtitan_speechlm.model.preference import (  # noqa: E402
    PreferenceLoss,
    pair_terms,
    preference_loss_sum,
    sequence_logps,
)

# 2 x 28 rows: documents 0..6 of 7, 9, 6, 5, 11, 4 and 8 rows, rows of no document (-1);
# documents 1, 2 and 5 are in two pairs, and each pair's answers differ in length
DOCS = [
    [-1, -1] + [0] * 7 + [1] * 9 + [4] * 6 + [-1] * 4,
    [2] * 5 + [3] * 11 + [5] * 4 + [6] * 8,
]
PAIRS = [[0, 1], [3, 2], [4, 1], [6, 5], [5, 2]]
PROMPT = 2  # TRL rows start with a prompt (no loss)
STATS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)


def text_batch(head, seed: int = 0):
    """Our micro-batch with loss on the text stream only: text weights 1 in the documents
    (two holes of weight 0), 1 outside them (ignored), the audio streams' weights 0."""
    g = torch.Generator().manual_seed(seed)
    doc = torch.tensor(DOCS)
    b, t, n = *doc.shape, head.num_streams
    targets = random_targets(head, doc, g)
    weights = torch.zeros(b, t, n)
    weights[..., 0] = 1.0
    weights[0, 4, 0] = weights[1, 9, 0] = 0.0  # a token of documents 0 and 3 without loss
    h = torch.randn(b, t, DIM, generator=g).requires_grad_()
    return h, targets, weights, doc, torch.tensor(PAIRS)


class _Backbone(nn.Module):
    def forward(self, input_ids, **kwargs):
        assert self.states.shape[:2] == input_ids.shape
        return type("Out", (), {"last_hidden_state": self.states})()


class CausalLM(nn.Module):
    """The stand-in for a Hugging Face causal LM: ``base_model`` returns the hidden states set
    in ``backbone.states``, ``lm_head`` is our text slice; its plain forward gives full logits
    (CPO), ``add_fused_lm_head`` (TRL's) adds the fused path DPO calls."""

    def __init__(self, w_text: torch.Tensor, fused_outputs: tuple[str, ...]):
        super().__init__()
        self.config = PretrainedConfig()
        self.backbone = _Backbone()
        self.lm_head = nn.Linear(w_text.shape[1], w_text.shape[0], bias=False)
        self.lm_head.weight = nn.Parameter(w_text.detach().clone())
        self.is_gradient_checkpointing = False
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(self, outputs=fused_outputs)

    @property
    def base_model(self):
        return self.backbone

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, attention_mask=None, **kwargs):
        return type("Out", (), {"logits": self.lm_head(self.backbone.states)})()


class _Accelerator:
    """One process: gathers are the identity."""

    device = torch.device("cpu")

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def autocast(self):
        return contextlib.nullcontext()


def trl_rows(head, h, targets, weights, doc, pair_ids):
    """TRL's padded rows of the pairs ``pair_ids`` (their chosen answers, then their rejected),
    and the hidden states in TRL's layout (our rows' states, differentiably; random fixed
    states where no loss is)."""
    a = head.ranges[0][0]
    docs = [PAIRS[p][0] for p in pair_ids] + [PAIRS[p][1] for p in pair_ids]
    flat_doc, flat_t, flat_w = doc.reshape(-1), targets[..., 0].reshape(-1), weights[..., 0]
    flat_w = flat_w.reshape(-1)
    rows = [(flat_doc == d).nonzero().squeeze(-1) for d in docs]
    width = PROMPT + max(len(r) for r in rows)
    g = torch.Generator().manual_seed(len(pair_ids))
    ids = torch.randint(0, head.ranges[0][1] - a, (len(docs), width), generator=g)
    completion = torch.zeros(len(docs), width, dtype=torch.long)
    attention = torch.zeros(len(docs), width, dtype=torch.long)
    ii, tt, src = [], [], []
    for i, r in enumerate(rows):
        span = slice(PROMPT, PROMPT + len(r))
        ids[i, span] = flat_t[r] - a
        completion[i, span] = (flat_w[r] > 0).long()
        attention[i, : PROMPT + len(r)] = 1
        ii += [i] * len(r)
        tt += range(PROMPT - 1, PROMPT - 1 + len(r))  # the state before each token predicts it
        src.append(r)
    filler = torch.randn(len(docs), width, h.shape[-1], generator=g)
    states = filler.index_put(
        (torch.tensor(ii), torch.tensor(tt)), h.reshape(-1, h.shape[-1])[torch.cat(src)]
    )
    inputs = {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}
    return inputs, states


def dpo_trainer(policy, s: PreferenceLoss, loss_type: list[str], loss_weights: list[float]):
    """A DPOTrainer without its ``__init__``, with the attributes ``_compute_loss`` and
    ``compute_ref_log_probs`` read, set as ``DPOTrainer.__init__`` sets them from a
    ``DPOConfig`` (its defaults: reverse-KL divergence, no length desensitisation, no WPO
    weighting), reference log-probs precomputed."""
    from trl.trainer.dpo_trainer import DPOTrainer

    t = DPOTrainer.__new__(DPOTrainer)
    t.model, t.ref_model, t.accelerator = policy, None, _Accelerator()
    t.args = type("Args", (), {"gradient_checkpointing_kwargs": None})()
    t.beta, t.label_smoothing = s.beta, s.label_smoothing
    t.loss_types, t.loss_weights = loss_type, loss_weights
    t.precompute_ref_logps, t.ld_alpha, t.use_weighting = True, None, False
    t.f_divergence_type, t.f_alpha_divergence_coef = "reverse_kl", 1.0
    t.aux_loss_enabled, t._tp_size, t._total_train_tokens = False, 1, 0
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    return t


def dpo_trl_types(s: PreferenceLoss) -> tuple[list[str], list[float]]:
    """TRL 1.16's loss types for our settings (one pair a call unless plain sigmoid)."""
    types, weights = ["aot" if s.label_smoothing else "sigmoid"], [1.0]
    if s.nll_weight:
        types, weights = [*types, "sft"], [1.0, s.nll_weight]
    return types, weights


def cpo_trainer(s: PreferenceLoss):
    """A CPOTrainer without its ``__init__``: TRL's SimPO (``loss_type="simpo"``,
    ``cpo_alpha`` our NLL weight, no AlphaPO reward shaping) on a decoder-only model."""
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    t = CPOTrainer.__new__(CPOTrainer)
    t.accelerator, t.is_encoder_decoder, t.pad_token_id, t.aux_loss_enabled = (
        _Accelerator(),
        False,
        0,
        False,
    )
    t.loss_type, t.beta, t.simpo_gamma = "simpo", s.beta, s.gamma
    t.label_smoothing, t.cpo_alpha, t.alpha = s.label_smoothing, s.nll_weight, 0.0
    return t


def cpo_batch(inputs):
    """CPO's batch: chosen and rejected halves, the prompt and padding labelled -100."""
    n = inputs["input_ids"].shape[0] // 2
    labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
    batch = {}
    for name, half in (("chosen", slice(0, n)), ("rejected", slice(n, None))):
        batch[f"{name}_input_ids"] = inputs["input_ids"][half]
        batch[f"{name}_attention_mask"] = inputs["attention_mask"][half]
        batch[f"{name}_labels"] = labels[half]
    return batch


def grads(*params) -> list[torch.Tensor]:
    out = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return out


def max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def ours(head, h, targets, weights, doc, pairs, ref, s):
    """Our summed loss (backpropagated into ``h`` and the head), statistics and per-pair
    losses (``pair_terms`` on ``sequence_logps``; lengths = loss tokens of each answer)."""
    loss, stats = preference_loss_sum(head, h, targets, weights, doc, pairs, ref, s)
    loss.backward()
    lp = sequence_logps(head, h, targets, weights, doc, pairs)
    counts = torch.zeros(int(doc.max()) + 1).index_add_(
        0, doc.clamp(min=0).reshape(-1), ((doc >= 0) * weights[..., 0]).reshape(-1)
    )
    index = torch.arange(2 * len(pairs)).view(-1, 2)
    losses = pair_terms(s, lp.reshape(-1), counts[pairs].reshape(-1), index, ref)[0]
    return loss.detach(), stats, losses


DPO = [
    PreferenceLoss("dpo", beta=beta, label_smoothing=ls) for beta in (0.1, 0.5) for ls in (0, 0.1)
] + [PreferenceLoss("dpo", beta=0.5, label_smoothing=0.1, nll_weight=0.7)]


@pytest.mark.parametrize(
    "s", DPO, ids=lambda s: f"beta{s.beta}_ls{s.label_smoothing}_nll{s.nll_weight}"
)
def test_dpo_equals_trl(s):
    head, _ = tiny_head(chunk=5)
    h, targets, weights, doc, pairs = text_batch(head)
    a, b = head.ranges[0]
    outputs = ("log_probs", "entropy", "mean_logits", "is_top1")  # DPOTrainer.__init__'s
    policy = CausalLM(head.output.weight[a:b], outputs)
    # the reference: another output matrix and other hidden states, log-probs by each side
    ref_head, _ = tiny_head(chunk=5)
    with torch.no_grad():
        ref_head.output.weight.add_(0.2 * torch.randn_like(ref_head.output.weight))
    h_ref = torch.randn_like(h)
    ref = sequence_logps(ref_head, h_ref, targets, weights, doc, pairs)
    everything = list(range(len(PAIRS)))
    inputs, states = trl_rows(head, h_ref, targets, weights, doc, everything)
    reference = CausalLM(ref_head.output.weight[a:b], ("log_probs",))
    reference.backbone.states = states
    trainer = dpo_trainer(policy, s, ["sigmoid"], [1.0])
    trl_ref = torch.stack(trainer.compute_ref_log_probs(reference, inputs), -1)
    assert max_rel(ref, trl_ref) < 1e-6

    def trl_loss(pair_ids, loss_type, loss_weights):
        inputs, states = trl_rows(head, h, targets, weights, doc, pair_ids)
        inputs["ref_chosen_logps"], inputs["ref_rejected_logps"] = trl_ref[pair_ids].unbind(-1)
        policy.backbone.states = states
        trainer = dpo_trainer(policy, s, loss_type, loss_weights)
        loss = trainer._compute_loss(policy, inputs, return_outputs=False)
        return loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}

    # TRL: one pair a call (the per-pair losses, their sum's gradient), and the whole batch
    # with the sigmoid loss (its statistics; its loss and gradient where that is ours)
    per_pair = [trl_loss([p], *dpo_trl_types(s))[0] for p in everything]
    torch.stack(per_pair).sum().backward()
    trl_grads = grads(h, policy.lm_head.weight)
    batch_loss, metrics = trl_loss(everything, ["sigmoid"], [1.0])
    batch_grads = None  # TRL's whole-batch loss is ours only without these
    if not (s.label_smoothing or s.nll_weight):
        (len(PAIRS) * batch_loss).backward()
        batch_grads = grads(h, policy.lm_head.weight)

    got = ours(head, h, targets, weights, doc, pairs, ref, s)
    check_against_trl(head, h, got, per_pair, trl_grads, metrics, batch_loss, batch_grads)


SIMPO = [
    PreferenceLoss("simpo", beta=beta, gamma=gamma, label_smoothing=ls)
    for beta, gamma in ((0.5, 0.1), (2.0, 0.5))
    for ls in (0, 0.1)
] + [PreferenceLoss("simpo", beta=2.5, gamma=1.0, label_smoothing=0.1, nll_weight=1.5)]


@pytest.mark.parametrize(
    "s",
    SIMPO,
    ids=lambda s: f"beta{s.beta}_gamma{s.gamma}_ls{s.label_smoothing}_nll{s.nll_weight}",
)
def test_simpo_equals_trl(s):
    head, _ = tiny_head(chunk=5)
    h, targets, weights, doc, pairs = text_batch(head, seed=1)
    a, b = head.ranges[0]
    model = CausalLM(head.output.weight[a:b], ("log_probs",))
    trainer = cpo_trainer(s)
    everything = list(range(len(PAIRS)))

    def trl_loss(pair_ids):
        inputs, states = trl_rows(head, h, targets, weights, doc, pair_ids)
        model.backbone.states = states
        return trainer.get_batch_loss_metrics(model, cpo_batch(inputs))

    per_pair = [trl_loss([p])[0] for p in everything]
    torch.stack(per_pair).sum().backward()
    trl_grads = grads(h, model.lm_head.weight)
    batch_loss, metrics = trl_loss(everything)
    batch_grads = None  # CPO's NLL term is a token mean over the batch: not ours
    if not s.nll_weight:
        (len(PAIRS) * batch_loss).backward()
        batch_grads = grads(h, model.lm_head.weight)

    got = ours(head, h, targets, weights, doc, pairs, None, s)
    check_against_trl(head, h, got, per_pair, trl_grads, metrics, batch_loss, batch_grads)


def check_against_trl(head, h, got, per_pair, trl_grads, metrics, batch_loss, batch_grads):
    """Our (loss, stats, per-pair losses) and gradients against TRL's: the per-pair losses and
    their sum's gradient (one pair a TRL call), the whole batch's loss and gradient where
    ``batch_grads`` is given, and the statistics as means over the pairs."""
    loss, stats, losses = got
    a, b = head.ranges[0]
    got_grads = [h.grad, head.output.weight.grad[a:b]]
    assert not head.output.weight.grad[b:].any()  # the audio streams carry no loss
    per_pair = torch.stack(per_pair).detach()
    assert max_rel(losses, per_pair) < 1e-5
    assert max_rel(loss, per_pair.sum()) < 1e-5
    assert max_rel(stats["preference_loss"], per_pair.sum()) < 1e-5
    for mine, want in zip(got_grads, trl_grads, strict=True):
        assert max_rel(mine, want) < 1e-5
    if batch_grads is not None:
        assert max_rel(loss, len(PAIRS) * batch_loss.detach()) < 1e-5
        for mine, want in zip(got_grads, batch_grads, strict=True):
            assert max_rel(mine, want) < 1e-5
    n = float(stats["count_pairs"])
    assert n == len(PAIRS)
    for key in STATS:
        assert abs(float(stats[key]) / n - metrics[key]) <= 1e-5 * max(1.0, abs(metrics[key])), key
    assert 0 < metrics["rewards/accuracies"] < 1  # both outcomes occur
