"""KV-cache decoding of every backbone (native and qwen3, dense and MoE: model/backbones/
kv_cache.py; hf: transformers' DynamicCache) against a full recompute of each row alone
(``model.logits`` on its whole sequence): a batch of left-padded rows of different lengths,
several greedy steps, logits to 1e-5 and the same tokens; the static cache doubling past its
capacity; ``select_cache_rows`` then continuing == those rows alone; tensor parallelism refused
by name; ``DecodeConfig.compile`` off / auto / on."""

import pytest
import torch

from tests.helpers import QWEN3_MOE, build_speechlm, random_batch, save_tiny_backbone
from torchtitan_speechlm.model.backbones import kv_cache

MOE = QWEN3_MOE
VARIANTS = {  # name: (HF family, backbone, config overrides)
    "native": ("llama", "native", {}),
    "qwen3": ("qwen3", "qwen3", dict(hidden_size=64, head_dim=16, intermediate_size=96)),
    "qwen3_moe": ("qwen3_moe", "qwen3", MOE),
    "hf": ("llama", "hf", {}),
}
LENGTHS = [9, 4, 6]  # the prompts of one batch (left-padded to 9)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    built = {}
    for name, (family, backbone, kw) in VARIANTS.items():
        path = tmp_path_factory.mktemp(name) / name
        save_tiny_backbone(path, family=family, **kw)
        built[name] = build_speechlm(path, backbone=backbone).eval()
    return built


class Rows:
    """Rows decoded together through the cache, left-padded, as generation feeds them."""

    def __init__(self, model, rows: list[torch.Tensor]):
        self.model, self.rows = model, rows
        lay = model.args.layout
        self.pad = torch.tensor([lay.stream_pad(k) for k in range(lay.num_streams)])
        width = max(len(r) for r in rows)
        inputs = self.pad.repeat(len(rows), width, 1)
        self.mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            inputs[i, width - len(r) :] = r
            self.mask[i, width - len(r) :] = 1
        self.logits, self.cache = model.decode_step(inputs, self.positions(width), self.mask, None)

    def positions(self, new: int) -> torch.Tensor:
        return (self.mask.cumsum(-1) - 1).clamp(min=0)[:, -new:]

    def last(self) -> list[torch.Tensor]:
        return [x[:, -1] for x in self.logits]

    def advance(self, frames: torch.Tensor) -> None:
        self.rows = [torch.cat([r, f[None]]) for r, f in zip(self.rows, frames, strict=True)]
        self.mask = torch.cat([self.mask, torch.ones(len(frames), 1, dtype=torch.long)], 1)
        self.logits, self.cache = self.model.decode_step(
            frames[:, None], self.positions(1), self.mask, self.cache
        )

    def select(self, index: list[int]) -> None:
        self.cache = self.model.select_cache_rows(self.cache, torch.tensor(index))
        self.rows = [self.rows[i] for i in index]
        self.mask = self.mask[index]
        self.logits = [x[index] for x in self.logits]


def greedy(model, logits: list[torch.Tensor]) -> torch.Tensor:
    """[rows, N] frames: each stream's most likely token (its vocabulary slice's offset on)."""
    starts = [a for a, _ in model.head.ranges]
    return torch.stack([x.argmax(-1) + a for x, a in zip(logits, starts, strict=True)], -1)


def full_recompute(model, rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each row's last-position logits per stream, every row alone over its whole sequence."""
    outs = [model.logits(r[None]) for r in rows]
    return [torch.cat([o[s][:, -1] for o in outs]) for s in range(len(outs[0]))]


def assert_same_as_full_recompute(dec: Rows) -> torch.Tensor:
    """The cached step's logits == each row recomputed alone (1e-5), and the same greedy
    frames; returns them."""
    cached, full = dec.last(), full_recompute(dec.model, dec.rows)
    for a, b in zip(cached, full, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    frames = greedy(dec.model, cached)
    assert torch.equal(frames, greedy(dec.model, full))
    return frames


def prompts(model, seed=1) -> list[torch.Tensor]:
    inputs, _, _ = random_batch(model.args.layout, b=len(LENGTHS), t=max(LENGTHS), seed=seed)
    return [inputs[i, :n] for i, n in enumerate(LENGTHS)]


@pytest.mark.parametrize("name", sorted(VARIANTS))
@torch.no_grad()
def test_cached_decoding_equals_full_recompute(models, name):
    model = models[name]
    dec = Rows(model, prompts(model))
    for _ in range(6):
        dec.advance(assert_same_as_full_recompute(dec))
    assert_same_as_full_recompute(dec)
    if name != "hf":
        assert isinstance(dec.cache, kv_cache.StaticKVCache) and dec.cache.length == 9 + 6


@pytest.mark.parametrize("name", ["native", "qwen3_moe"])
@torch.no_grad()
def test_the_static_cache_doubles_past_its_capacity(models, name, monkeypatch):
    monkeypatch.setattr(kv_cache, "MIN_CAPACITY", 1)  # the first call: 16 slots for 9 frames
    model = models[name]
    dec = Rows(model, prompts(model, seed=2))
    assert dec.cache.capacity == 16
    for _ in range(10):  # 9 + 10 = 19 slots: one doubling
        dec.advance(assert_same_as_full_recompute(dec))
    assert dec.cache.capacity == 32 and dec.cache.length == 19
    assert all(k.shape[2] == 32 for k in dec.cache.keys + dec.cache.values)
    assert_same_as_full_recompute(dec)


@pytest.mark.parametrize("name", sorted(VARIANTS))
@torch.no_grad()
def test_selected_rows_continue_like_those_rows_alone(models, name):
    model = models[name]
    dec = Rows(model, prompts(model, seed=3))
    for _ in range(2):
        dec.advance(greedy(model, dec.last()))
    dec.select([2, 0])  # row 1 finished; the others swap places
    alone = Rows(model, dec.rows)  # the same two rows decoded from the start by themselves
    for _ in range(3):
        frames = assert_same_as_full_recompute(dec)
        for a, b in zip(dec.last(), alone.last(), strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        dec.advance(frames)
        alone.advance(frames)
    assert_same_as_full_recompute(dec)


@torch.no_grad()
def test_tensor_parallel_decoding_is_refused_by_name(models):
    """Under torchtitan's (sequence-parallel) TP plan the decoder splits rows along the
    sequence; generation catches NotImplementedError and recomputes in full."""
    model = models["native"]
    model.backbone.tp_mesh = object()
    try:
        with pytest.raises(NotImplementedError, match="sequence-parallel"):
            Rows(model, prompts(model))
    finally:
        model.backbone.tp_mesh = None


def test_only_the_static_cache_backbones_compile_their_step(models):
    for name, expected in (("native", True), ("qwen3", True), ("hf", False)):
        assert models[name].compile_decode(True) is expected
        assert models[name].compile_decode(False) is False


def test_compile_setting_is_checked_and_auto_is_cuda_only():
    from torchtitan_speechlm.generation.incremental import compile_wanted

    assert not compile_wanted("auto", torch.device("cpu"))
    assert compile_wanted("auto", torch.device("cuda"))
    assert compile_wanted("on", torch.device("cpu")) and not compile_wanted("off", "cuda")
    with pytest.raises(ValueError, match="auto"):
        compile_wanted("yes", torch.device("cpu"))


def tts_prompts(model):
    import numpy as np

    from torchtitan_speechlm.data.tasks import LossWeights, TemplateBuilder
    from torchtitan_speechlm.data.template_pieces import Segment

    lay = model.args.layout
    builder = TemplateBuilder(lay, model.args.pattern, LossWeights(1.0, 1.0, (1 / 3,) * 3))
    return [
        builder.prefix([Segment("user", "text", np.arange(3, 3 + n))], "assistant", "audio")
        for n in (4, 9)
    ]


def test_compile_off_and_auto_decode_the_same_tokens_on_cpu(models):
    from torchtitan_speechlm.generation.decode import DecodeConfig, Decoder

    model = models["native"]
    cfg = dict(max_frames=6, min_frames=6)
    off = Decoder(model, DecodeConfig(compile="off", **cfg))
    auto = Decoder(model, DecodeConfig(compile="auto", **cfg))
    assert not off.forward.compiled and not auto.forward.compiled  # CPU: auto is off
    a, b = off.audio(tts_prompts(model)), auto.audio(tts_prompts(model))
    assert [x.tolist() for x in a] == [x.tolist() for x in b]


@pytest.mark.long  # inductor on CPU: 18 s with a cold cache, kept out of make test
def test_compiled_step_decodes_the_same_tokens(models):
    """``compile = "on"`` on CPU (inductor, g++): the compiled one-frame step (static shapes)
    gives the eager step's tokens; a few seconds of compiling."""
    from torchtitan_speechlm.generation.decode import DecodeConfig, Decoder

    model = models["native"]
    cfg = dict(max_frames=6, min_frames=6)
    eager = Decoder(model, DecodeConfig(compile="off", **cfg)).audio(tts_prompts(model))
    on = Decoder(model, DecodeConfig(compile="on", **cfg))
    assert on.forward.compiled
    compiled = on.audio(tts_prompts(model))
    assert model.backbone in kv_cache._COMPILED  # still compiled: no fallback to eager
    model.compile_decode(False)
    assert [x.tolist() for x in compiled] == [x.tolist() for x in eager]


@torch.no_grad()
def test_a_step_that_fails_to_compile_runs_eagerly_after_one_warning(models, caplog):
    model = models["native"]

    def broken(*args):
        raise RuntimeError("InductorError: no compiler\nmore lines")

    dec = Rows(model, prompts(model, seed=4))
    kv_cache._COMPILED[model.backbone] = broken
    with caplog.at_level("WARNING"):
        for _ in range(3):
            dec.advance(assert_same_as_full_recompute(dec))
    assert model.backbone not in kv_cache._COMPILED  # eager from then on
    warned = [r.getMessage() for r in caplog.records if "torch.compile" in r.getMessage()]
    assert len(warned) == 1 and "no compiler" in warned[0] and "\n" not in warned[0]
    assert_same_as_full_recompute(dec)
