"""Vocabulary layout and interleave patterns."""

import numpy as np
import pytest

from torchtitan_speechlm.model.patterns import deinterleave, interleave
from torchtitan_speechlm.model.vocab import NUM_SPECIAL, VocabLayout, VocabMismatchError


def test_layout_blocks_are_contiguous_and_disjoint():
    lay = VocabLayout(text_size=100, num_streams=3, codebook_size=10)
    assert lay.text_offset == NUM_SPECIAL
    assert lay.stream_pad(0) == NUM_SPECIAL + 100
    assert lay.code(0, 0) == lay.stream_pad(0) + 1
    assert lay.stream_pad(1) == lay.code(0, 9) + 1
    assert lay.size == NUM_SPECIAL + 100 + 3 * 11
    # stream 0 predicts specials + text + its codebook; others only their own block
    assert lay.stream_range(0) == (0, lay.code(0, 9) + 1)
    assert lay.stream_range(2) == (lay.stream_pad(2), lay.size)
    ids = [i for k in range(1, 3) for i in range(*lay.stream_range(k))]
    assert len(ids) == len(set(ids)) and set(ids).isdisjoint(range(*lay.stream_range(0)))


def test_layout_roundtrip_and_mismatch(tmp_path):
    lay = VocabLayout(text_size=100, num_streams=3, codebook_size=10)
    lay.save(tmp_path / "vocab.json")
    assert VocabLayout.load(tmp_path / "vocab.json") == lay
    other = VocabLayout(text_size=100, num_streams=4, codebook_size=10)
    assert other.fingerprint() != lay.fingerprint()
    with pytest.raises(VocabMismatchError, match="num_streams"):
        lay.check_same(other, "checkpoint X")
    reordered = VocabLayout(100, 3, 10, specials=tuple(reversed(lay.specials)))
    with pytest.raises(VocabMismatchError, match="specials"):
        lay.check_same(reordered, "checkpoint X")


def test_delay_pattern_shifts_stream_k_by_k():
    codes = np.arange(12).reshape(4, 3) + 100
    pads = np.array([-1, -2, -3])
    out = interleave(codes, pads, "delay")
    assert out.shape == (6, 3)
    for k in range(3):
        assert (out[k : k + 4, k] == codes[:, k]).all()
        assert (out[:k, k] == pads[k]).all() and (out[k + 4 :, k] == pads[k]).all()
    assert (deinterleave(out, "delay") == codes).all()
    assert (interleave(codes, pads, "parallel") == codes).all()
    with pytest.raises(ValueError, match="unknown interleave pattern 'zigzag'"):
        interleave(codes, pads, "zigzag")


def test_flatten_serialises_every_codebook_into_stream_zero():
    from torchtitan_speechlm.model.patterns import get_pattern

    codes = np.arange(12).reshape(4, 3) + 100
    pads = np.array([-1, -2, -3])
    out = interleave(codes, pads, "flatten")
    assert out.shape == (12, 3)
    assert out[:, 0].tolist() == codes.reshape(-1).tolist()  # f0c0 f0c1 f0c2 f1c0 ...
    assert (out[:, 1] == -2).all() and (out[:, 2] == -3).all()
    assert (deinterleave(out, "flatten") == codes).all()
    flat = get_pattern("flatten")
    assert flat.num_frames(np.array([4, 5]), np.array([1, 2]), 3).tolist() == [12, 15]
    lay = VocabLayout(text_size=100, num_streams=3, codebook_size=10)
    assert flat.prediction_range(lay, 0) == (0, lay.size)  # stream 0 predicts all codebooks
    assert flat.prediction_range(lay, 2) == lay.stream_range(2)


def test_flatten_template_puts_each_codebooks_weight_with_its_code():
    from torchtitan_speechlm.data.tasks import LossWeights, TemplateBuilder

    lay = VocabLayout(text_size=50, num_streams=3, codebook_size=16)
    rng = np.random.default_rng(0)

    class Item:
        id, text_tokens = "x", np.array([5, 6, 7])
        audio_codes = rng.integers(0, 16, (4, 3))

    b = TemplateBuilder(lay, "flatten", LossWeights(1.0, 2.0, (0.5, 0.3, 0.2)))
    ex = b.build("tts", Item)
    audio = ex.frames[:, 0] >= lay.stream_offset(0)
    codes = ex.frames[audio, 0]
    want = [lay.code(k, int(Item.audio_codes[f, k])) for f in range(4) for k in range(3)]
    assert codes.tolist() == want
    assert ex.weights[audio, 0].tolist() == pytest.approx([2.0 * w for w in (0.5, 0.3, 0.2)] * 4)
    assert (ex.weights[:, 1:] == 0).all()
    assert len(ex.frames) == b.length("tts", 3, 4)
