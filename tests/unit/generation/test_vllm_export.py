"""A flatten SpeechLM written by generation/vllm_export.py is a plain causal LM: transformers
loads it, its logits are ours, and its greedy continuation under the masks the layout note
states (``audio_allowed``; text: text ids and the end ids) is our decoder's, token for token.
What vLLM is fed is this folder (docs/vllm.md); this check needs no vLLM."""

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from tests.helpers import build_speechlm, save_tiny_backbone
from torchtitan_speechlm.data.tasks import LossWeights, TemplateBuilder
from torchtitan_speechlm.data.template_pieces import Segment
from torchtitan_speechlm.generation.decode import DecodeConfig, Decoder
from torchtitan_speechlm.generation.vllm_export import (
    NOTE_FILE,
    audio_allowed,
    check_servable,
    export_flatten_lm,
)

N, C = 3, 16


class NoteMask(LogitsProcessor):
    """The note's masks in transformers: ``audio`` (per output step) or a fixed id list."""

    def __init__(self, note: dict, prompt_len: int, min_frames: int, ids=None):
        self.note, self.start, self.min_frames, self.ids = note, prompt_len, min_frames, ids

    def __call__(self, input_ids, scores):
        keep = torch.zeros_like(scores, dtype=torch.bool)
        if self.ids is not None:
            keep[:, self.ids] = True
        else:
            for a, b in audio_allowed(self.note, input_ids.shape[1] - self.start, self.min_frames):
                keep[:, a:b] = True
        return scores.masked_fill(~keep, float("-inf"))


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def exported(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_export")
    save_tiny_backbone(root / "bb", vocab_size=60, hidden_size=48, intermediate_size=96)
    model = build_speechlm(
        root / "bb", num_streams=N, codebook_size=C, pattern="flatten", tie=request.param
    ).eval()
    with torch.no_grad():  # a trained-looking head: make the codebook rows matter
        model.tok_embeddings.weight.normal_(0, 1.0)
        if model.head.output is not None:
            model.head.output.weight.normal_(0, 1.0)
    export_flatten_lm(model, str(root / "lm"))
    hf = AutoModelForCausalLM.from_pretrained(str(root / "lm"), dtype=torch.float32).eval()
    note = json.loads((root / "lm" / NOTE_FILE).read_text())
    return model, hf, note


def prompts(model, task: str) -> list[np.ndarray]:
    lay = model.args.layout
    builder = TemplateBuilder(lay, "flatten", LossWeights(1.0, 1.0, (1 / N,) * N))
    rng = np.random.default_rng(1)
    if task == "tts":
        segs = [Segment("user", "text", rng.integers(0, 60, n)) for n in (5, 11)]
        return [builder.prefix([s], "assistant", "audio") for s in segs]
    segs = [Segment("user", "audio", rng.integers(0, C, (f, N))) for f in (4, 7)]
    return [builder.prefix([s], "assistant", "text") for s in segs]


def generate(hf, prompt: np.ndarray, mask: NoteMask, max_new: int) -> list[int]:
    ids = torch.as_tensor(prompt[:, 0])[None]
    out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new,
        do_sample=False,
        logits_processor=LogitsProcessorList([mask]),
    )
    return out[0, ids.shape[1] :].tolist()


def test_logits_equal_ours(exported):
    model, hf, note = exported
    prompt = prompts(model, "tts")[1]
    with torch.no_grad():
        ours = model.logits(torch.as_tensor(prompt)[None])[0]
        theirs = hf(torch.as_tensor(prompt[:, 0])[None]).logits
    assert note["vocab_size"] == theirs.shape[-1] == ours.shape[-1]
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)


def test_greedy_tts_equals_our_decoder(exported):
    model, hf, note = exported
    lay, frames, min_frames = model.args.layout, 6, 2
    rows = prompts(model, "tts")
    # measured: the untied model runs to max_frames, the tied one ends at min_frames
    codes = Decoder(model, DecodeConfig(max_frames=frames, min_frames=min_frames)).audio(rows)
    for prompt, c in zip(rows, codes, strict=True):
        got = generate(hf, prompt, NoteMask(note, len(prompt), min_frames), frames * N)
        ours = [lay.code(k, int(c[f, k])) for f in range(len(c)) for k in range(N)]
        assert got[: len(ours)] == ours
        assert len(got) == len(ours) + (len(c) < frames)  # the end id, when the model chose it
        if len(c) < frames:
            assert got[-1] in note["end_ids"]


def test_greedy_asr_equals_our_decoder(exported):
    model, hf, note = exported
    lay = model.args.layout
    rows = prompts(model, "asr")
    text = Decoder(model, DecodeConfig(max_text_tokens=8)).text(rows)
    allowed = list(range(*note["text_ids"])) + note["end_ids"]
    for prompt, ids in zip(rows, text, strict=True):
        got = generate(hf, prompt, NoteMask(note, len(prompt), 0, allowed), 8)
        assert got[: len(ids)] == [lay.text_offset + i for i in ids]


def test_other_patterns_are_refused(tmp_path):
    save_tiny_backbone(tmp_path / "bb", vocab_size=60)
    for pattern in ("delay", "parallel"):
        model = build_speechlm(tmp_path / "bb", num_streams=N, codebook_size=C, pattern=pattern)
        with pytest.raises(ValueError, match="one token per stream per step"):
            check_servable(model.args)
