"""The preference loss's settings (DPO, SimPO), apart from the loss (model/preference.py): the
model args hold them, and the loss needs the head, which needs the model args."""

from __future__ import annotations

import math
from dataclasses import dataclass

KINDS = ("dpo", "simpo")
DEFAULT_BETA = {"dpo": 0.1, "simpo": 2.0}


@dataclass
class PreferenceLoss:
    """The preference loss's settings; config keys ``speechlm.preference_loss`` (kind),
    ``speechlm.preference_beta``, ``speechlm.simpo_gamma``,
    ``speechlm.preference_label_smoothing`` and ``speechlm.preference_nll_weight``.

    Defaults: DPO's beta 0.1 is TRL's ``DPOConfig`` and ESPnet's speechlm DPO recipe
    (``train_multiscale_1b_dpo.yaml``); SimPO's beta 2.0 and gamma 0.5 are the SimPO
    authors' ``SimPOConfig`` (beta 2.0, gamma_beta_ratio 0.25) and TRL's ``simpo_gamma``
    (ESPnet's SimPO recipe leaves its model's beta 0.1 / margin 0 defaults). ``beta=None``
    takes the kind's default. Label smoothing (cDPO) applies to both.
    ``nll_weight`` adds ``nll_weight * (-logp_chosen / len_chosen)`` per pair (RPO, Pang et al.
    2024; TRL 1.16's ``loss_type=["sigmoid", "sft"]`` with ``loss_weights=[1, w]``, which
    averages over the batch's chosen tokens instead of per pair): the chosen answer's own
    likelihood rises too, not only its margin over the rejected.
    """

    kind: str = "dpo"
    beta: float | None = None
    gamma: float = 0.5
    label_smoothing: float = 0.0
    nll_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"speechlm.preference_loss must be one of {KINDS}, not {self.kind!r}")
        if self.beta is None:
            self.beta = DEFAULT_BETA[self.kind]
        if not (self.beta > 0 and math.isfinite(self.beta)):
            raise ValueError(
                f"speechlm.preference_beta must be > 0 (got {self.beta}): it scales the "
                "implicit reward; 0 has no gradient and < 0 prefers the rejected"
            )
        if not (self.gamma >= 0 and math.isfinite(self.gamma)):
            raise ValueError(f"speechlm.simpo_gamma must be >= 0 (got {self.gamma})")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(
                "speechlm.preference_label_smoothing must be in [0, 0.5) "
                f"(got {self.label_smoothing}): 0.5 makes chosen and rejected alike"
            )
        if not (self.nll_weight >= 0 and math.isfinite(self.nll_weight)):
            raise ValueError(
                f"speechlm.preference_nll_weight must be >= 0 (got {self.nll_weight}): it "
                "weighs the chosen answer's negative log-likelihood"
            )
