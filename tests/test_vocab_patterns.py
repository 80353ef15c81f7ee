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
