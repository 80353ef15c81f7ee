"""An in-memory stand-in for a prepared dataset and a stream over it: the data stream's tests
(tests/unit/data/) build streams of known lengths without preparing audio."""

from dataclasses import dataclass

import numpy as np

from torchtitan_speechlm.data.mixing import Source
from torchtitan_speechlm.data.stream import SpeechLMDataset
from torchtitan_speechlm.data.tasks import LossWeights, TemplateBuilder
from torchtitan_speechlm.model.vocab import VocabLayout

N_STREAMS, CODEBOOK, TEXT = 3, 16, 50
LAYOUT = VocabLayout(text_size=TEXT, num_streams=N_STREAMS, codebook_size=CODEBOOK)


@dataclass
class Item:
    id: str
    text: str
    text_tokens: np.ndarray
    audio_codes: np.ndarray
    seconds: float
    turns: list | None = None


class FakePrepared:
    """In-memory stand-in for PreparedDataset (same reader API the stream uses)."""

    def __init__(self, n=60, seed=0, bad=(), speakers=0):
        """``speakers``: item i is spoken by speaker i % speakers (0: no speaker labels)."""
        rng = np.random.default_rng(seed)
        self.text_lengths = rng.integers(3, 30, n)
        self.audio_lengths = rng.integers(10, 120, n)
        self.ids = [f"utt{i}" for i in range(n)]
        self.kinds = ["speech"] * n
        self.bad = set(bad)
        self.has_speakers = speakers > 0
        self.item_speakers = np.arange(n) % max(1, speakers) if speakers else np.arange(n)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        if i in self.bad:
            raise OSError(f"shard-0/audio_codes.npy truncated at item {i}")
        rng = np.random.default_rng(1000 + i)
        return Item(
            self.ids[i],
            "",
            rng.integers(0, TEXT, self.text_lengths[i]),
            rng.integers(0, CODEBOOK, (self.audio_lengths[i], N_STREAMS)),
            1.0,
        )


def make(
    world=1,
    rank=0,
    rows=4,
    seq_len=256,
    mode="pack",
    infinite=True,
    data=None,
    cfg=0.0,
    window=32,
    loss_region="assistant",
    tasks=("tts", "asr"),
    accum=1,
    max_tokens=0,
    prompt_frames=0,
    seed=3,
    order="permutation",
):
    data = data or FakePrepared()
    sources = [Source(t, "fake", 1.0, data, np.arange(len(data))) for t in tasks]
    builder = TemplateBuilder(
        LAYOUT,
        "delay",
        LossWeights(1.0, 1.0, (0.5, 0.25, 0.25)),
        loss_region=loss_region,
        max_prompt_frames=prompt_frames,
    )
    return SpeechLMDataset(
        sources,
        builder,
        seq_len=seq_len,
        local_batch_size=rows,
        max_tokens=max_tokens,
        mode=mode,
        window=window,
        dp_rank=rank,
        dp_world_size=world,
        accumulation=accum,
        seed=seed,
        shuffle=infinite,
        infinite=infinite,
        cfg_dropout=cfg,
        order=order,
    )
