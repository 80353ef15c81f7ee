"""lhotse CutSet manifests as a prepare source: the same checks as the Kaldi source (segments,
missing audio, empty text, refused inputs, the CLI's report), plus channels, gzip, and
manifests written by the real lhotse package (a test dependency)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile as sf

from tests.data_fixtures import SR, build_assets, tone
from torchtitan_speechlm.audio import load_audio
from torchtitan_speechlm.codecs import load_codec
from torchtitan_speechlm.data.reader import PreparedDataset
from torchtitan_speechlm.prepare.items import ManifestError
from torchtitan_speechlm.prepare.pipeline import main, prepare_dataset
from torchtitan_speechlm.prepare.sources.lhotse import read_lhotse_cuts
from torchtitan_speechlm.text_tokenizer import load_text_tokenizer

lhotse = pytest.importorskip("lhotse")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    a = build_assets(tmp_path_factory.mktemp("lhotse"))
    a["codec_obj"] = load_codec(a["codec"])
    a["tok_obj"] = load_text_tokenizer(a["tok"])
    return a


def encode(assets, wav):
    return assets["codec_obj"].encode([wav])[0]


def make_recordings(root):
    """rec0: 3 s mono at 8 kHz; rec1: 3 s stereo at 22.05 kHz (two different tones)."""
    sf.write(root / "rec0.wav", tone(0, 3.0, 8000), 8000)
    stereo = np.stack([tone(1, 3.0, 22050), tone(5, 3.0, 22050)], axis=1)
    sf.write(root / "rec1.wav", stereo, 22050)


def make_cuts(root) -> str:
    """The Kaldi test's corpus as lhotse cuts, written by lhotse itself: segments as cut
    offsets, a cut without text, a supervision whose recording file is gone, a stereo channel."""
    from lhotse import CutSet, Recording, RecordingSet, SupervisionSegment, SupervisionSet

    make_recordings(root)
    recs = [
        Recording.from_file(str(root / "rec0.wav"), recording_id="rec0"),
        Recording.from_file(str(root / "rec1.wav"), recording_id="rec1"),
    ]
    sf.write(root / "gone.wav", tone(2, 2.0, 16000), 16000)
    recs.append(Recording.from_file(str(root / "gone.wav"), recording_id="gone"))
    sups = [
        SupervisionSegment("u1", "rec0", 0.0, 1.0, channel=0, text="hello there"),
        SupervisionSegment("u2", "rec0", 1.5, 1.25, channel=0, text="the cat sat"),
        SupervisionSegment("u3", "rec1", 0.25, 2.0, channel=1, text="on the mat"),
        SupervisionSegment("u4", "rec1", 1.0, 1.0, channel=0, text=""),
        SupervisionSegment("u9", "gone", 0.0, 1.0, channel=0, text="audio went missing"),
    ]
    cuts = CutSet.from_manifests(
        RecordingSet.from_recordings(recs), SupervisionSet.from_segments(sups)
    ).trim_to_supervisions(keep_overlapping=False)
    path = str(root / "cuts.jsonl.gz")
    cuts.to_file(path)
    (root / "gone.wav").unlink()
    return path


def test_lhotse_cuts_prepare(assets, tmp_path):
    cuts = make_cuts(tmp_path)
    out = tmp_path / "out"
    s = prepare_dataset(
        None,
        assets["codec"],
        assets["tok"],
        str(out),
        source=("lhotse", cuts),
        progress=False,
        batch_size=1,
    )
    ds = PreparedDataset(str(out))
    got = dict(zip(ds.ids, range(len(ds)), strict=True))
    assert ds.metadata["source"]["type"] == "lhotse" and set(got) == {"u1", "u2", "u3"}
    spans = {
        "u1": ("rec0", 0.0, 1.0, 0, "hello there"),
        "u2": ("rec0", 1.5, 2.75, 0, "the cat sat"),
        "u3": ("rec1", 0.25, 2.25, 1, "on the mat"),
    }
    cutset = {c.supervisions[0].id: c for c in lhotse.CutSet.from_file(cuts)}
    for utt, (rec, start, end, channel, text) in spans.items():
        item, cut = ds[got[utt]], cutset[utt]
        assert (cut.start, cut.end) == pytest.approx((start, end), abs=1e-3)  # sample-rounded
        wav = load_audio(
            str(tmp_path / f"{rec}.wav"), SR, start=cut.start, end=cut.end, channel=channel
        )
        assert item.text == text
        assert item.seconds == pytest.approx(end - start, abs=1e-3)
        np.testing.assert_array_equal(item.audio_codes, encode(assets, wav))
        # the very samples lhotse itself loads for the cut (its channel, its offset)
        native = load_audio(
            str(tmp_path / f"{rec}.wav"),
            cut.sampling_rate,
            start=cut.start,
            end=cut.end,
            channel=channel,
        )
        ref = cut.load_audio()[0]
        n = min(len(ref), len(native))
        assert abs(len(ref) - len(native)) <= 1
        np.testing.assert_allclose(native[:n], ref[:n], atol=1e-6)
    fails = {json.loads(x)["id"]: json.loads(x)["reason"] for x in open(out / "failures.jsonl")}
    assert fails == {"u4": "empty_text", "u9": "missing_audio"}
    assert s["skipped_by_reason"] == {"empty_text": 1, "missing_audio": 1}


def write_cuts(path, cuts: list[dict]) -> str:
    path.write_text("".join(json.dumps(c) + "\n" for c in cuts))
    return str(path)


def plain_cut(root, **over) -> dict:
    cut = {
        "id": "c1",
        "start": 0.5,
        "duration": 1.0,
        "channel": 0,
        "type": "MonoCut",
        "recording": {
            "id": "rec0",
            "sampling_rate": 8000,
            "num_samples": 24000,
            "duration": 3.0,
            "channel_ids": [0],
            "sources": [{"type": "file", "channels": [0], "source": "rec0.wav"}],
        },
        "supervisions": [
            {
                "id": "s1",
                "recording_id": "rec0",
                "start": 0.0,
                "duration": 1.0,
                "channel": 0,
                "text": "hi",
            }
        ],
    }
    cut.update(over)
    return cut


def test_plain_jsonl_relative_paths_and_refused_inputs(tmp_path):
    make_recordings(tmp_path)
    items = read_lhotse_cuts(write_cuts(tmp_path / "cuts.jsonl", [plain_cut(tmp_path)]))
    assert [(it.id, it.text, it.ref.start, it.ref.end, it.ref.channel) for it in items] == [
        ("c1", "hi", 0.5, 1.5, 0)
    ]
    assert items[0].audio == str(tmp_path / "rec0.wav")  # relative: the manifest's folder
    bad = [
        (
            {
                "recording": dict(
                    plain_cut(tmp_path)["recording"],
                    sources=[{"type": "command", "channels": [0], "source": "sox x.sph -t wav -"}],
                )
            },
            "'command' source; only 'file'",
        ),
        (
            {
                "recording": dict(
                    plain_cut(tmp_path)["recording"],
                    transforms=[{"name": "Speed", "kwargs": {"factor": 1.1}}],
                )
            },
            r"transforms \['Speed'\]",
        ),
        ({"type": "MixedCut"}, "is a MixedCut"),
        ({"channel": [0, 1]}, r"has channels \[0, 1\]"),
        ({"recording": None}, "no attached 'recording'"),
        ({"duration": "long"}, "'duration' must be a number"),
    ]
    for over, message in bad:
        path = write_cuts(
            tmp_path / "bad.jsonl", [plain_cut(tmp_path), plain_cut(tmp_path, **over)]
        )
        with pytest.raises(ManifestError, match=rf"bad\.jsonl:2: .*{message}"):
            read_lhotse_cuts(path)
    dup = write_cuts(tmp_path / "dup.jsonl", [plain_cut(tmp_path), plain_cut(tmp_path)])
    with pytest.raises(ManifestError, match="duplicate cut id 'c1'"):
        read_lhotse_cuts(dup)


def test_cli_reports_a_refused_cut(assets, tmp_path, capsys):
    make_recordings(tmp_path)
    cut = plain_cut(
        tmp_path,
        recording=dict(
            plain_cut(tmp_path)["recording"],
            sources=[{"type": "url", "channels": [0], "source": "https://example.org/a.wav"}],
        ),
    )
    path = write_cuts(tmp_path / "cuts.jsonl", [cut])
    rc = main(
        [
            "--lhotse",
            path,
            "--codec",
            assets["codec"],
            "--tokenizer",
            assets["tok"],
            "--out",
            str(tmp_path / "o"),
            "--no-progress",
        ]
    )
    assert rc == 1 and "'url' source" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
