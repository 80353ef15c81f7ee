"""The stream's own settings, checked once where a stream is built.

The data layer owns the ranges of the values it consumes: a stream refuses a setting it cannot
honour with a message that names the TOML key and the fix, whichever caller (the trainer, the
Python API, a test) built it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import get_args

from torchtitan_speechlm.config import Batching, ConfigError, OrderName

ORDERS = get_args(OrderName)  # typed once: config/job_config.py (``speechlm_data.order``)
NEW_RUN_ORDER = "keyed"  # what "auto" means for a stream not resumed (stream version 2)


@dataclass(frozen=True)
class StreamSettings:
    """What a piece is and how windows are drawn; ``max_tokens`` is the raw setting (0: unset).

    ``seq_len_key`` names the key ``seq_len`` came from (``training.seq_len`` or
    ``validation.seq_len``), for the messages."""

    seq_len: int
    local_batch_size: int
    mode: str
    window: int
    seed: int
    shuffle: bool
    infinite: bool
    max_tokens: int = 0
    cfg_dropout: float = 0.0
    max_too_long_fraction: float = 1.0
    seq_len_key: str = "training.seq_len"
    order: str = ORDERS[0]  # speechlm_data.order (data/mixing.py, keyed_order.py)

    @classmethod
    def from_config(cls, data, training) -> StreamSettings:
        """The training stream's: ``[speechlm_data]``'s batching keys and ``training.seq_len``
        and ``local_batch_size``, each read here by name (the run plan calls it once)."""
        return cls(
            seq_len=training.seq_len,
            local_batch_size=training.local_batch_size,
            mode=data.batching,
            window=data.window,
            seed=data.seed,
            shuffle=data.shuffle,
            infinite=True,
            max_tokens=data.max_tokens,
            cfg_dropout=data.cfg_dropout,
            max_too_long_fraction=data.max_too_long_fraction,
            seq_len_key="training.seq_len",
            order=data.order,
        )

    def for_validation(self, validation) -> StreamSettings:
        """A validation set's: finite, ordered and clean (no CFG dropout, no too-long limit),
        in ``validation.local_batch_size`` rows of ``validation.seq_len`` (0: training's)."""
        own = validation.seq_len > 0
        return replace(
            self.finite(),
            seq_len=validation.seq_len if own else self.seq_len,
            local_batch_size=validation.local_batch_size,
            seq_len_key="validation.seq_len" if own else self.seq_len_key,
        )

    def finite(self) -> StreamSettings:
        """One ordered, clean pass in training's rows and ``seq_len`` (a pipeline's stages
        exchange those shapes only: DPO's reference pass)."""
        return replace(
            self, shuffle=False, infinite=False, cfg_dropout=0.0, max_too_long_fraction=1.0
        )

    def __post_init__(self) -> None:
        problem = next(self._problems(), None)
        if problem is not None:
            raise ConfigError(problem)

    def _problems(self) -> Iterator[str]:
        """What is out of range, each with its key and the fix, in the TOML check's order."""
        if self.mode not in get_args(Batching):
            yield f"speechlm_data.batching must be one of {get_args(Batching)}, got {self.mode!r}"
        if self.seq_len < 8:
            yield f"{self.seq_len_key} (frames per row) must be >= 8"
        if self.max_tokens and self.mode == "pack":
            yield (
                f'speechlm_data.max_tokens = {self.max_tokens} applies to batching = "bucket" '
                'only; with "pack" a micro-batch is training.local_batch_size rows of '
                "training.seq_len frames: set training.local_batch_size instead and remove "
                "max_tokens"
            )
        if not 0.0 <= self.max_too_long_fraction <= 1.0:
            yield "speechlm_data.max_too_long_fraction must be in [0, 1]"
        if self.max_tokens and self.max_tokens < self.seq_len:
            yield (
                f"speechlm_data.max_tokens = {self.max_tokens} is below {self.seq_len_key} = "
                f"{self.seq_len}: one full row must fit; raise max_tokens or lower seq_len"
            )
        if not 0.0 <= self.cfg_dropout < 1.0:
            yield "speechlm_data.cfg_dropout must be in [0, 1)"
        if self.window < 1:
            yield "speechlm_data.window must be >= 1"
        if self.order not in ORDERS:
            yield f"speechlm_data.order must be one of {ORDERS}, got {self.order!r}"

    @property
    def start_order(self) -> str:
        """The epoch order of a stream not resumed (``auto``: ``NEW_RUN_ORDER``)."""
        return NEW_RUN_ORDER if self.order == "auto" else self.order

    @property
    def token_budget(self) -> int:
        """Frames of a bucket micro-batch: ``max_tokens``, or local batch x seq_len unset."""
        return self.max_tokens or self.local_batch_size * self.seq_len

    @property
    def train_cfg_dropout(self) -> float:
        """CFG dropout is a training augmentation: a finite (validation) pass never applies it."""
        return self.cfg_dropout if self.infinite else 0.0
