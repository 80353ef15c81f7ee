"""Preference pairs in the data stream (tts_pref, asr_pref) over a dataset prepared by the real
`torchtitan prepare` path: a pair's two documents side by side in one row, each with its own
positions and laid out as the plain task lays out one document; the pref_* tensors consistent
with the frames (checked against the codec and tokenizer run on the input files); labels
counting the pairs; reference log-probs looked up; identical pairs skipped and counted; a
mixture with other tasks refused."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch

from tests.data_fixtures import build_assets
from tests.fake_stream import FakePrepared
from tests.helpers import build_speechlm, save_tiny_backbone
from tests.preference_fixtures import prepare_pairs
from torchtitan_speechlm.codecs import load_codec
from torchtitan_speechlm.data.collation import batch_hash
from torchtitan_speechlm.data.mixing import Source
from torchtitan_speechlm.data.pairs import PairSide, build_pair
from torchtitan_speechlm.data.reader import PreparedDataset
from torchtitan_speechlm.data.stream import SpeechLMDataset
from torchtitan_speechlm.data.tasks import LossWeights, Task, TemplateBuilder, get_task
from torchtitan_speechlm.model.vocab import VocabLayout
from torchtitan_speechlm.utils.audio import load_audio
from torchtitan_speechlm.utils.text_tokenizer import load_text_tokenizer

TASKS = ("tts_pref", "asr_pref")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    assets = build_assets(tmp_path_factory.mktemp("pref"))
    out, rows = prepare_pairs(assets, os.path.join(assets["root"], "prepared"))
    ds = PreparedDataset(out)
    layout = VocabLayout(text_size=int(ds.metadata["tokenizer"]["vocab_size"]),
                         num_streams=ds.num_streams,
                         codebook_size=int(ds.metadata["codec"]["codebook_size"]))  # fmt: skip
    codec, tok = load_codec(assets["codec"]), load_text_tokenizer(assets["tok"])
    here = os.path.join(assets["root"], "pairs")
    expected = {}  # item id -> (prompt, chosen, rejected) from the input files, independently
    for r in rows:
        codes = [codec.encode([load_audio(os.path.join(here, p), codec.sample_rate)])[0]
                 for p in ([r["chosen"]["audio"], r["rejected"]["audio"]] if r["task"] == "tts"
                           else [r["audio"]])]  # fmt: skip
        texts = [tok(t, add_special_tokens=False)["input_ids"] for t in
                 ([r["text"]] if r["task"] == "tts" else [r["chosen"]["text"],
                                                          r["rejected"]["text"]])]  # fmt: skip
        expected[r["id"]] = (texts[0], *codes) if r["task"] == "tts" else (codes[0], *texts)
    return {"ds": ds, "layout": layout, "rows": {r["id"]: r for r in rows}, "expected": expected}


def builder(data, pattern="delay") -> TemplateBuilder:
    n = data["layout"].num_streams
    return TemplateBuilder(data["layout"], pattern, LossWeights(1.0, 1.0, (1 / n,) * n))


def stream(data, tasks=TASKS, mode="pack", infinite=True, rows=2, pattern="delay", **kw):
    ds = data["ds"]
    sources = [Source(t, "pairs", 1.0, ds, np.arange(len(ds))) for t in tasks]
    return SpeechLMDataset(sources, builder(data, pattern), seq_len=kw.pop("seq_len", 480),
                           local_batch_size=rows, mode=mode, window=kw.pop("window", 8),
                           dp_rank=0, dp_world_size=1, seed=kw.pop("seed", 0), shuffle=True,
                           infinite=infinite, **kw)  # fmt: skip


def plain_document(data, b: TemplateBuilder, item_id: str, side: int):
    """The example the plain task lays out for a pair's side (1 chosen, 2 rejected) from the
    input files' codes and tokens, not from the prepared dataset."""
    row, (prompt, *answers) = data["rows"][item_id], data["expected"][item_id]
    answer = np.asarray(answers[side - 1])
    if row["task"] == "tts":
        return b.build("tts", PairSide(item_id, np.asarray(prompt), answer))
    return b.build("asr", PairSide(item_id, answer, np.asarray(prompt)))


@pytest.mark.parametrize("pattern", ["delay", "parallel", "flatten"])
def test_a_pair_is_two_plain_documents_and_its_length_is_budgeted(data, pattern):
    b = builder(data, pattern)
    st = stream(data, pattern=pattern, seq_len=2048)
    ds = data["ds"]
    for src, s in enumerate(st.sources):
        assert {ds.ids[i] for i in s.indices} == {
            k for k, r in data["rows"].items()
            if f"{r['task']}_pref" == s.task and not k.startswith("same_")}  # fmt: skip
        for i, length in zip(s.indices, st.lengths(src), strict=True):
            pair = build_pair(b, s.task, ds[int(i)])
            assert length == len(pair.chosen.frames) + len(pair.rejected.frames) - 1
            for side, doc in ((1, pair.chosen), (2, pair.rejected)):
                want = plain_document(data, b, ds.ids[i], side)
                np.testing.assert_array_equal(doc.frames, want.frames)
                np.testing.assert_array_equal(doc.weights, want.weights)


def documents(batch) -> list[tuple[int, int, int, int]]:
    """(doc, row, first frame, frames) of every preference document of a batch."""
    out = []
    doc = batch["pref_doc"]
    for d in range(int(doc.max()) + 1):
        rows, frames = (doc == d).nonzero(as_tuple=True)
        assert len(set(rows.tolist())) == 1, "a document within one row"
        first, n = int(frames.min()), len(frames)
        assert frames.tolist() == list(range(first, first + n)), "a document is contiguous"
        out.append((d, int(rows[0]), first, n))
    return out


@pytest.mark.parametrize("mode", ["pack", "bucket"])
def test_batches_carry_each_pair_together_and_consistent_with_its_frames(data, mode):
    st = stream(data, mode=mode, rows=3)
    b, ds = builder(data), data["ds"]
    seen = 0
    for batch, labels in itertools.islice(iter(st), 6):
        pairs, keys = batch["pref_pairs"], batch["pref_key"]
        p = len(pairs)
        assert torch.equal(pairs, torch.arange(2 * p).reshape(p, 2))
        assert batch["pref_ref"].shape == (p, 2) and batch["pref_ref"].isnan().all()
        docs = documents(batch)
        assert len(docs) == 2 * p
        inp, tgt, pos, w = (batch[k] for k in ("input", "targets", "position_ids", "loss_weights"))
        for d, r, first, n in docs:
            assert torch.equal(pos[r, first : first + n], torch.arange(n))  # restarts at 0
            src, item = keys[d // 2].tolist()
            assert st.sources[src].task in TASKS
            frames = torch.cat([inp[r, first : first + 1], tgt[r, first : first + n]])
            want = plain_document(data, b, ds.ids[item], 1 + d % 2)
            np.testing.assert_array_equal(frames.numpy(), want.frames)
            np.testing.assert_array_equal(w[r, first : first + n].numpy(), want.weights[1:])
            if d % 2:  # the rejected starts where its chosen ends, in the same row
                assert docs[d - 1][1] == r and docs[d - 1][2] + docs[d - 1][3] == first
        has_loss = (w > 0).any(-1)
        assert not (has_loss & (batch["pref_doc"] < 0)).any()  # all loss is in the pairs
        counted = (labels != -100).nonzero().tolist()
        assert len(counted) == p  # torchtitan's normaliser: the pairs
        assert sorted(int(batch["pref_doc"][r, j]) for r, j in counted) == list(range(0, 2 * p, 2))
        assert all(has_loss[r, j] for r, j in counted)
        assert stat(st, batch, "examples") == p
        for c, j in pairs.tolist():  # no trained pair's two documents carry the same loss
            rows = [batch["pref_doc"] == k for k in (c, j)]
            assert not (rows[0].sum() == rows[1].sum() and torch.equal(tgt[rows[0]], tgt[rows[1]])
                        and torch.equal(w[rows[0]], w[rows[1]])), (c, j)  # fmt: skip
        seen += p
    assert seen > 6


def stat(st, batch, key) -> float:
    return batch["data_stats"][0, st.stats_keys.index(key)].item()


def test_identical_pairs_are_skipped_and_counted(data):
    """copy_tts's answers are two copies of one file: identical in tokens, never trained."""
    st = stream(data, infinite=False, rows=2)
    ds = data["ds"]
    batches = list(iter(st))
    keys = [tuple(k) for b, _ in batches for k in b["pref_key"].tolist()]
    copy = list(ds.ids).index("copy_tts")
    assert (0, copy) not in keys
    assert sum(stat(st, b, "pref_identical") for b, _ in batches) == 1
    want = {(src, int(i)) for src, s in enumerate(st.sources) for i in s.indices} - {(0, copy)}
    assert sorted(keys) == sorted(want)  # a finite pass: every other pair once
    assert sum((lab != -100).sum().item() for _, lab in batches) == len(want)


def test_reference_logps_are_looked_up_outside_the_stream_state(data):
    ds = data["ds"]
    table = {0: np.arange(2 * len(ds), dtype=np.float32).reshape(-1, 2) - 100.0}  # tts_pref only
    plain, st = stream(data), stream(data)
    state = st.state_dict()
    st.set_reference_logps(table)
    assert st.state_dict() == state
    for (a, _), (b, _) in itertools.islice(zip(iter(plain), iter(st), strict=True), 4):
        assert batch_hash(a) == batch_hash(b)  # not data order
        for (src, item), ref in zip(b["pref_key"].tolist(), b["pref_ref"], strict=True):
            if src == 0:
                np.testing.assert_array_equal(ref.numpy(), table[0][item])
            else:
                assert ref.isnan().all()  # no table for asr_pref
    st.set_reference_logps(None)
    assert next(iter(st))[0]["pref_ref"].isnan().all()


def test_the_reference_pass_log_probs_equal_each_document_alone(data, tmp_path):
    """The model's pref_logps_only on a packed preference batch equals the log-probs of each
    document run through the model alone: the positions, pref_doc and pref_pairs separate and
    name the documents as the loss needs."""
    layout, n = data["layout"], data["layout"].num_streams
    save_tiny_backbone(tmp_path / "bb", vocab_size=layout.text_size)
    model = build_speechlm(tmp_path / "bb", num_streams=n, codebook_size=layout.codebook_size,
                           preference={"kind": "simpo"}).eval()  # fmt: skip
    batch, _ = next(iter(stream(data, rows=2, seq_len=480)))
    inputs = {k: v for k, v in batch.items() if k != "pref_key"}
    with torch.no_grad():
        got = model(inputs.pop("input"), **inputs, pref_logps_only=True)
        alone, docs = [], documents(batch)
        assert len(docs) >= 4
        for _, r, first, m in docs:
            sl = slice(first, first + m)
            logits = model(batch["input"][r : r + 1, sl], position_ids=torch.arange(m)[None])
            logp = 0.0
            for k, lg in enumerate(logits):
                lo, _ = model.head.ranges[k]
                t, w = batch["targets"][r, sl, k], batch["loss_weights"][r, sl, k]
                ll = torch.log_softmax(lg[0].float(), -1)
                idx = (t - lo).clamp(0, ll.shape[-1] - 1)
                logp += float((w * ll.gather(-1, idx[:, None])[:, 0]).sum())
            alone.append(logp)
    torch.testing.assert_close(got.float(), torch.tensor(alone).reshape(-1, 2), rtol=1e-4,
                               atol=1e-3)  # fmt: skip


def test_a_mixture_of_preference_and_other_tasks_is_refused(data):
    fake = FakePrepared(n=20)
    sources = [Source("tts_pref", "pairs", 1.0, data["ds"], np.arange(len(data["ds"]))),
               Source("tts", "fake", 1.0, fake, np.arange(20))]  # fmt: skip
    with pytest.raises(ValueError) as e:
        SpeechLMDataset(sources, builder(data), seq_len=480, local_batch_size=2, mode="pack",
                        window=8, dp_rank=0, dp_world_size=1, seed=0, shuffle=True,
                        infinite=True)  # fmt: skip
    msg = str(e.value)
    assert "speechlm_data.train mixes preference tasks (tts_pref:pairs)" in msg
    assert "other tasks (tts:fake)" in msg


def test_a_source_without_pairs_of_its_task_is_refused(data):
    ds = data["ds"]
    asr = np.array([i for i in range(len(ds)) if ds.ids[i].startswith("a")])
    with pytest.raises(ValueError, match="tts_pref:pairs has no tts preference pairs"):
        SpeechLMDataset([Source("tts_pref", "pairs", 1.0, ds, asr)], builder(data), seq_len=480,
                        local_batch_size=2, mode="pack", window=8, dp_rank=0, dp_world_size=1,
                        seed=0, shuffle=True, infinite=True)  # fmt: skip


def test_no_cfg_dropout_for_pairs(data):
    st = stream(data, cfg_dropout=0.9)
    for batch, _ in itertools.islice(iter(st), 3):
        assert stat(st, batch, "cfg_dropped") == 0


def test_a_preference_task_mirrors_its_base_task():
    tts, prompted = get_task("tts"), get_task("tts_prompt")
    for bad in (
        dict(
            name="p",
            kinds=("preference",),
            turns=prompted.turns,
            pair_of="tts_prompt",
            prompt_turn=0,
        ),  # a pair holds its own prompt: none drawn
        dict(name="p", kinds=("preference",), turns=tts.turns, pair_of="tts_prompt"),
        dict(name="p", kinds=("speech",), turns=tts.turns, pair_of="tts"),
        dict(name="p", kinds=("preference",), turns=tts.turns, cfg_turn=0, pair_of="tts"),
        dict(name="p", kinds=("preference",), turns=tts.turns[::-1], pair_of="tts"),
    ):
        with pytest.raises(ValueError, match="a preference task takes kind 'preference'"):
            Task(**bad)
    assert get_task("asr_pref").turns == get_task("asr").turns
    pref = get_task("tts_prompt_pref")
    assert pref.turns == prompted.turns and pref.pair_of == "tts_prompt"
    assert not pref.prompted and pref.prompt_budget  # no prompt drawn, one cut to the budget
    assert not get_task("tts_pref").prompt_budget


# tts_prompt pairs: (speaker prompt, chosen, rejected) seconds; p1's prompt is the longest
PROMPTED = [(0.5, 0.3, 0.9), (1.2, 1.0, 0.5), (0.3, 0.7, 0.6)]


@pytest.fixture(scope="module")
def prompted(tmp_path_factory):
    """tts_prompt pairs (and a tts pair in the same file) prepared by the real CLI, with
    each side's codes and tokens from the codec and tokenizer run on the input files."""
    import json

    import soundfile as sf

    from tests.data_fixtures import SR, tone
    from torchtitan_speechlm.commands.prepare import main

    assets = build_assets(tmp_path_factory.mktemp("pref_prompt"))
    root = os.path.join(assets["root"], "pairs")
    os.makedirs(root)
    rows, sentences = [], assets["sentences"]
    for i, seconds in enumerate(PROMPTED):
        names = [f"q{i}{side}.wav" for side in "pcr"]
        for k, (name, sec) in enumerate(zip(names, seconds, strict=True)):
            sf.write(os.path.join(root, name), tone(10 + 3 * i + k, sec, SR), SR)
        rows.append({"id": f"q{i}", "task": "tts_prompt", "audio": names[0], "text": sentences[i],
                     "chosen": {"audio": names[1]}, "rejected": {"audio": names[2]},
                     "scores": {"chosen": {"sim": 0.9}, "rejected": {"sim": 0.2}}})  # fmt: skip
    rows.append({**rows[0], "id": "t0", "task": "tts"})  # a tts pair: not a tts_prompt pair
    del rows[-1]["audio"]
    path = os.path.join(root, "pairs.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    out = os.path.join(assets["root"], "prepared")
    argv = ["--preference", path, "--codec", assets["codec"], "--tokenizer", assets["tok"],
            "--out-dir", out, "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    ds = PreparedDataset(out)
    codec, tok = load_codec(assets["codec"]), load_text_tokenizer(assets["tok"])
    expected = {  # item id -> (prompt codes, text tokens, chosen codes, rejected codes)
        r["id"]: (
            *[codec.encode([load_audio(os.path.join(root, r[k]), codec.sample_rate)])[0]
              for k in ("audio",) if k in r],
            tok(r["text"], add_special_tokens=False)["input_ids"],
            *[codec.encode([load_audio(os.path.join(root, r[k]["audio"]), codec.sample_rate)])[0]
              for k in ("chosen", "rejected")],
        ) for r in rows
    }  # fmt: skip
    layout = VocabLayout(text_size=int(ds.metadata["tokenizer"]["vocab_size"]),
                         num_streams=ds.num_streams,
                         codebook_size=int(ds.metadata["codec"]["codebook_size"]))  # fmt: skip
    return {"ds": ds, "layout": layout, "expected": expected}


def prompt_builder(prompted, max_prompt_frames: int, pattern="delay") -> TemplateBuilder:
    n = prompted["layout"].num_streams
    return TemplateBuilder(prompted["layout"], pattern, LossWeights(1.0, 1.0, (1 / n,) * n),
                           max_prompt_frames=max_prompt_frames)  # fmt: skip


def prompted_stream(prompted, b: TemplateBuilder, rows=2, **kw):
    ds = prompted["ds"]
    return SpeechLMDataset([Source("tts_prompt_pref", "pairs", 1.0, ds, np.arange(len(ds)))], b,
                           seq_len=kw.pop("seq_len", 2048), local_batch_size=rows, mode="pack",
                           window=8, dp_rank=0, dp_world_size=1, seed=0, shuffle=True,
                           infinite=kw.pop("infinite", True), **kw)  # fmt: skip


@pytest.mark.parametrize("pattern", ["delay", "flatten"])
def test_a_tts_prompt_pair_is_two_plain_tts_prompt_documents(prompted, pattern):
    """Each side is the plain tts_prompt task's document for the pair's speaker prompt (the
    codec's codes of the prompt file, cut to the budget), text and answer; the pair's budgeted
    length is exact when the prompt has the budget's frames and never short otherwise."""
    ds, expected = prompted["ds"], prompted["expected"]
    frames = {i: len(expected[f"q{i}"][0]) for i in range(len(PROMPTED))}
    assert frames[1] > frames[0] > frames[2]
    for budget in (frames[0], frames[2]):  # p0's frames: exact for it; p2's: every prompt cut
        b = prompt_builder(prompted, budget, pattern)
        st = prompted_stream(prompted, b)
        (source,) = st.sources
        assert sorted(ds.ids[i] for i in source.indices) == ["q0", "q1", "q2"]  # not t0
        for i, length in zip(source.indices, st.lengths(0), strict=True):
            item_id = ds.ids[int(i)]
            prompt, text, *answers = expected[item_id]
            pair = build_pair(b, "tts_prompt_pref", ds[int(i)])
            for doc, answer in zip(pair.documents, answers, strict=True):
                plain = b.build("tts_prompt", PairSide(item_id, np.asarray(text), answer),
                                prompt=PairSide("prompt", np.zeros(0), prompt))  # fmt: skip
                np.testing.assert_array_equal(doc.frames, plain.frames)
                np.testing.assert_array_equal(doc.weights, plain.weights)
            actual = len(pair.chosen.frames) + len(pair.rejected.frames) - 1
            p = len(prompt)
            assert length - actual == abs(p - budget) * (ds.num_streams if pattern == "flatten"
                                                        else 1)  # fmt: skip
            if p <= budget:  # the whole prompt is in both documents
                assert len(plain.frames) == len(b.build("tts", PairSide(
                    item_id, np.asarray(text), answers[1])).frames) + b.prompt_length(p)  # fmt: skip


def test_tts_prompt_pairs_in_batches(prompted):
    """A finite pass places every tts_prompt pair once, its two documents side by side with
    positions restarting, the loss only on the answers, one label per pair."""
    b = prompt_builder(prompted, len(prompted["expected"]["q0"][0]))
    st = prompted_stream(prompted, b, infinite=False)
    ds, keys = prompted["ds"], []
    for batch, labels in iter(st):
        for d, r, first, n in documents(batch):
            item = int(batch["pref_key"][d // 2][1])
            pair = build_pair(b, "tts_prompt_pref", ds[item])
            want = pair.documents[d % 2]
            frames = torch.cat([batch["input"][r, first : first + 1],
                                batch["targets"][r, first : first + n]])  # fmt: skip
            np.testing.assert_array_equal(frames.numpy(), want.frames)
            np.testing.assert_array_equal(batch["loss_weights"][r, first : first + n].numpy(),
                                          want.weights[1:])  # fmt: skip
            assert torch.equal(batch["position_ids"][r, first : first + n], torch.arange(n))
        keys += [int(k) for _, k in batch["pref_key"].tolist()]
        assert int((labels != -100).sum()) == len(batch["pref_pairs"])
    assert sorted(ds.ids[k] for k in keys) == ["q0", "q1", "q2"]


def test_tts_prompt_pairs_need_a_prompt_budget(prompted):
    with pytest.raises(ValueError, match="speechlm.prompt_seconds > 0"):
        prompted_stream(prompted, prompt_builder(prompted, 0))
