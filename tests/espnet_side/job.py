"""ESPnet SpeechLM's job template and preprocessor (the batches ESPnet's iterator hands a trainer).

Written from espnet/espnet ``espnet2/speechlm/model/speechlm/speechlm_job.py`` and
``task_conf_speechlm.py`` (commit 05bcf8e05e19dd8918fd60bf31ff7e4cd31c9b42) and
``espnet2/speechlm/utils/data.py`` (``pad_list``, 2e19ccbde671). (The wheel's
``espnet2.speechlm.model`` package cannot be imported: its ``__init__`` imports this very
``speechlm_job`` module, which the wheel lacks; so ``AbsJobTemplate``'s two-method contract,
``build_preprocessor`` and ``build_model``, is followed without subclassing it.) The rules
reproduced:

- vocabulary: 256 special slots (``<|pad|>`` 0, bos, eos, eot, system, user, assistant, text,
  audio, image, video, toolcall, then unused), then each *discrete* io in the config's order,
  its intervals offset by where it starts;
- a sample: ``<|bos|>``, then per message ``<|role|> <|modality|> content`` and ``<|eot|>``
  when the next message has the same role, else ``<|eos|>``; content ids offset by the io's
  first interval start except the pad id 0; each stream padded with 0 to the widest io;
- loss masks: specials carry their value in stream 0 only (1 in assistant turns, or in every
  turn with ``loss_region: all``; BOS 0); content carries the io's mask x that value;
- ``collate_fn``: ``key``, ``seqs`` [B, T, N] and ``loss_masks`` right-padded with 0, and
  ``conti_feats`` {io: [[(row, start, length), ...], (padded features [n, L, ...], lengths)]}.
"""

from __future__ import annotations

import re

import numpy as np
import torch
from espnet2.speechlm.dataloader.task_conf import TASK_CONFIGS

from tests.espnet_side.ios import ContinuousAudioIO, DiscreteAudioIO, HuggingFaceTextIO

SPECIALS = [
    "<|pad|>", "<|bos|>", "<|eos|>", "<|eot|>", "<|system|>", "<|user|>", "<|assistant|>",
    "<|text|>", "<|audio|>", "<|image|>", "<|video|>", "<|toolcall|>",
]  # fmt: skip
NUM_SPECIAL = 256

SPEECHLM_TASK_CONFIGS = {
    "text_to_audio": [("user", "text1"), ("assistant", "audio1")],
    "audio_to_text": [("user", "audio1"), ("assistant", "text1")],
    "text_only": [("assistant", "text1")],
}
assert {t: {e for _, e in v} for t, v in SPEECHLM_TASK_CONFIGS.items()} == {
    t: set(c["required_entries"]) for t, c in TASK_CONFIGS.items()
}  # the wheel's data-side tasks and these templates name the same entries

IOS = {
    "text": HuggingFaceTextIO,
    "discrete_audio": DiscreteAudioIO,
    "continuous_audio": ContinuousAudioIO,
}


def espnet_intervals(text_size: int, num_streams: int, codebook_size: int) -> dict:
    """``_build_vocabulary``'s intervals for a text io of ``text_size`` ids then a discrete
    audio io of ``num_streams`` streams (each its pad, then ``codebook_size`` codes)."""
    at = NUM_SPECIAL + text_size
    audio = [(at + k * (codebook_size + 1), at + (k + 1) * (codebook_size + 1))
             for k in range(num_streams)]  # fmt: skip
    return {"special_token": [(0, NUM_SPECIAL)], "text": [(NUM_SPECIAL, at)],
            "discrete_audio": audio}  # fmt: skip


def pad_list(seqs) -> tuple[torch.Tensor, torch.Tensor]:
    """utils/data.py: stack along a new batch axis, right-padded with 0 (first axis = time)."""
    tensors = [torch.from_numpy(s) if isinstance(s, np.ndarray) else s for s in seqs]
    lengths = [t.shape[0] for t in tensors]
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    out = torch.zeros((len(tensors), max(lengths)) + tuple(tensors[0].shape[1:]), dtype=dtype)
    for i, t in enumerate(tensors):
        out[i, : lengths[i]] = t.to(dtype)
    return out, torch.tensor(lengths, dtype=torch.long)


class SpeechLMJobTemplate:
    def __init__(self, config: dict):
        self.config = config
        self.multimodal_io = {
            name: IOS[name](**kwargs) for name, kwargs in config["multimodal_io"].items()
        }
        self.vocab, self.vocab_intervals = self._build_vocabulary()

    def _build_vocabulary(self):
        vocab = list(SPECIALS)
        vocab += [f"<|unused_{i}|>" for i in range(len(vocab), NUM_SPECIAL)]
        intervals = {"special_token": [(0, NUM_SPECIAL)]}
        start = NUM_SPECIAL
        for name, io in self.multimodal_io.items():
            if io.is_discrete:
                vocab.extend(io.get_vocabulary())
                intervals[name] = [(start + s, start + e) for s, e in io.get_stream_interval()]
                start = len(vocab)
        assert len(vocab) == len(set(vocab)), "There are duplicated tokens in the vocab"
        return vocab, intervals

    def build_preprocessor(self) -> SpeechLMPreprocessor:
        p = self.config["preprocessor"]
        return SpeechLMPreprocessor(
            {name: io.copy_for_worker() for name, io in self.multimodal_io.items()},
            self.vocab,
            self.vocab_intervals,
            audio_input=p["audio_input"],
            audio_output=p["audio_output"],
            loss_region=p["loss_region"],
            batchfy_method=self.config["data_loading"].get("batchfy_method", "bucket"),
        )

    def build_model(self):
        from tests.espnet_side.model import build_parallel_model

        m = self.config["model"]
        return build_parallel_model(
            m["model_hf_tag"], self.multimodal_io, self.vocab, self.vocab_intervals
        )


class SpeechLMPreprocessor:
    def __init__(self, multimodal_io, vocab, vocab_intervals, audio_input="continuous_audio",
                 audio_output="discrete_audio", loss_region="assistant", batchfy_method="bucket"):  # fmt: skip
        self.multimodal_io, self.vocab, self.vocab_intervals = multimodal_io, vocab, vocab_intervals
        self.audio_input, self.audio_output = audio_input, audio_output
        self.loss_region, self.batchfy_method = loss_region, batchfy_method
        self.pad_id = vocab.index("<|pad|>")
        widths = [io.num_stream() for io in multimodal_io.values() if io.is_discrete]
        if not widths:
            raise ValueError("You should have at least one discrete multimodal IO")
        self.num_stream = max(widths)

    def find_length(self, key, data_dict) -> int:
        task, _, _ = key
        length = 1
        for _, io, data in self._apply_chat_template(task, data_dict):
            length += 3 + self.multimodal_io[io].find_length(data)
        return length

    def collate_fn(self, data_lst):
        if self.batchfy_method != "bucket":
            raise NotImplementedError("Only bucket collate function is implemented")
        done = [self.preprocessing(key, d) for key, d in data_lst]
        feats: dict = {}
        for row, d in enumerate(done):
            for io, start, length, feat in d["conti_feats"]:
                segments, values = feats.setdefault(io, [[], []])
                segments.append((row, start, length))
                values.append(feat)
        for entry in feats.values():
            entry[1] = pad_list(entry[1])
        return {
            "key": [key for key, _ in data_lst],
            "seqs": pad_list([d["sequence"] for d in done])[0],
            "conti_feats": feats,
            "loss_masks": pad_list([d["loss_mask"] for d in done])[0],
        }

    def preprocessing(self, key, data_dict) -> dict:
        task, _, _ = key
        messages = self._apply_chat_template(task, data_dict)
        seq, masks, feats, at = [self.special_token("<|bos|>")], [self.special_mask(0.0)], [], 1
        same_role_next = [
            a[0] == b[0] for a, b in zip(messages[:-1], messages[1:], strict=True)
        ] + [False]
        for eot, (role, io_name, data) in zip(same_role_next, messages, strict=True):
            loss = float(role == "assistant" or self.loss_region == "all")
            io = self.multimodal_io[io_name]
            seq += [self.special_token(f"<|{role}|>"), self.special_token(f"<|{io.modality}|>")]
            masks += [self.special_mask(loss)] * 2
            at += 2
            this, feat, mask = io.preprocess(data)
            assert this.shape == mask.shape
            if io.is_discrete:
                bias = self.vocab_intervals[io_name][0][0]
                this = np.where(this == self.pad_id, self.pad_id, this + bias)
            if this.shape[1] < self.num_stream:
                this = np.pad(this, ((0, 0), (0, self.num_stream - this.shape[1])))
            seq.append(this)
            if feat is not None:
                feats.append((io_name, at, feat[0], feat[1]))
            if mask.shape[1] < self.num_stream:
                mask = np.pad(mask, ((0, 0), (0, self.num_stream - mask.shape[1])))
            masks.append(mask * loss)
            at += this.shape[0]
            seq.append(self.special_token("<|eot|>" if eot else "<|eos|>"))
            masks.append(self.special_mask(loss))
            at += 1
        return {
            "sequence": np.concatenate(seq, axis=0),
            "conti_feats": feats,
            "loss_mask": np.concatenate(masks, axis=0),
        }

    def special_mask(self, value: float) -> np.ndarray:
        out = np.zeros((1, self.num_stream), dtype=np.float32)
        out[0, 0] = value
        return out

    def special_token(self, token: str) -> np.ndarray:
        specials = self.vocab[: self.vocab_intervals["special_token"][0][1]]
        out = np.full((1, self.num_stream), self.pad_id, dtype=np.int64)
        out[0, 0] = specials.index(token)
        return out

    def _apply_chat_template(self, task, data_dict):
        if "dialogue" in data_dict:
            if len(data_dict) != 1:
                raise ValueError("If dialogue exist, there should be no more other entries")
            return data_dict["dialogue"]
        messages = []
        for role, entry in SPEECHLM_TASK_CONFIGS[task]:
            if re.match(r"^audio", entry):
                io = self.audio_input if role in ("user", "system") else self.audio_output
            elif re.match(r"^text", entry):
                io = "text"
            else:
                raise ValueError(f"Not supported data entry in template: {entry}")
            messages.append((role, io, data_dict[entry]))
        return messages
