"""lhotse cuts and Lhotse Shar as prepare sources, read through lhotse: manifests written by the
real lhotse package (speed-perturbed, resampled, mixed, padded, memory, command and
multi-channel cuts; Shar from ``CutSet.to_shar``), each item's codes equal to those of the cut's
own ``cut.load_audio()`` encoded directly; workers and resume on Shar; bad cuts, broken Shar
directories and a missing lhotse package."""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import sys
import tarfile

import numpy as np
import pytest
import soundfile as sf
from scipy.signal import resample_poly

from tests.data_fixtures import SR, assert_same_dataset, build_assets, tone
from torchtitan_speechlm.codecs import load_codec
from torchtitan_speechlm.commands.prepare import main
from torchtitan_speechlm.data.reader import PreparedDataset
from torchtitan_speechlm.prepare.items import ManifestError
from torchtitan_speechlm.prepare.pipeline import prepare_dataset
from torchtitan_speechlm.prepare.sources.lhotse import INSTALL, read_lhotse_cuts

lhotse = pytest.importorskip("lhotse")
from lhotse import CutSet, MonoCut, Recording, SupervisionSegment  # noqa: E402


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    a = build_assets(tmp_path_factory.mktemp("lhotse"))
    a["codec_obj"] = load_codec(a["codec"])
    return a


def expected_codes(assets, cut) -> np.ndarray:
    """The codes of lhotse's own ``cut.load_audio()``: channels averaged, resampled to the
    codec's rate with scipy's polyphase filter, encoded alone."""
    wav = np.asarray(cut.load_audio(), dtype=np.float32).mean(axis=0)
    g = math.gcd(cut.sampling_rate, SR)
    wav = resample_poly(wav, SR // g, cut.sampling_rate // g).astype(np.float32)
    return assets["codec_obj"].encode([wav])[0]


def prepare(assets, out, source, **kw) -> dict:
    return prepare_dataset(None, assets["codec"], assets["tok"], str(out), source=source,
                           progress=False, batch_size=1, **kw)  # fmt: skip


def items_by_id(out) -> dict:
    ds = PreparedDataset(str(out))
    return {ds[i].id: ds[i] for i in range(len(ds))}


def failures(out) -> dict:
    return {json.loads(x)["id"]: json.loads(x) for x in open(os.path.join(out, "failures.jsonl"))}


def sup(sid, rec, start, duration, text, channel=0):
    return SupervisionSegment(sid, rec, start, duration, channel=channel, text=text)


def recordings(root) -> dict:
    """rec0: 3 s mono at 8 kHz; rec1: 3 s stereo at 22.05 kHz (two different tones); rec2:
    2 s mono at 16 kHz. Written as files, listed by lhotse's Recording.from_file."""
    sf.write(root / "rec0.wav", tone(0, 3.0, 8000), 8000)
    sf.write(root / "rec1.wav", np.stack([tone(1, 3.0, 22050), tone(5, 3.0, 22050)], 1), 22050)
    sf.write(root / "rec2.wav", tone(3, 2.0, 16000), 16000)
    return {n: Recording.from_file(str(root / f"{n}.wav"), recording_id=n)
            for n in ("rec0", "rec1", "rec2")}  # fmt: skip


def base_cuts(recs) -> dict:
    a = MonoCut("a", 0.5, 1.5, 0, recording=recs["rec0"],
                supervisions=[sup("a1", "rec0", 0.75, 0.5, "the cat sat"),
                              sup("a0", "rec0", 0.0, 0.5, "hello there")])  # fmt: skip
    b = MonoCut("b", 0.0, 1.25, 0, recording=recs["rec2"],
                supervisions=[sup("b0", "rec2", 0.0, 1.25, "on the mat")])  # fmt: skip
    stereo = recs["rec1"].to_cut().with_id("st")
    stereo.supervisions = [sup("s0", "rec1", 0.0, 1.0, "left side", 0),
                           sup("s1", "rec1", 1.0, 1.0, "right side", 1)]  # fmt: skip
    return {"a": a, "b": b, "st": stereo}


def command_cut(recording, command: str):
    """A 1 s cut of ``recording`` whose audio comes from a shell command (lhotse runs it)."""
    source = {"type": "command", "channels": [0], "source": command}
    rec = Recording.from_dict(dict(recording.to_dict(), id="cmdrec", sources=[source]))
    return MonoCut("cmd", 0.0, 1.0, 0, recording=rec,
                   supervisions=[sup("x", "cmdrec", 0, 1, "hello there")])  # fmt: skip


def test_cut_manifest_written_by_lhotse(assets, tmp_path):
    """Transforms, a MixedCut, a padded cut, a command source and a stereo MultiCut from a
    ``CutSet.to_file`` manifest: codes equal the encoded ``cut.load_audio()``; a missing file
    and an empty text are recorded failures."""
    recs = recordings(tmp_path)
    c = base_cuts(recs)
    cuts = {
        "a": c["a"],
        "speed": c["a"].perturb_speed(1.1).with_id("speed"),
        "volume": c["b"].perturb_volume(0.5).with_id("volume"),
        "resampled": c["st"].resample(16000).with_id("resampled"),
        "mixed": c["a"].mix(c["b"].resample(8000), offset_other_by=0.5, snr=10).with_id("mixed"),
        "padded": c["b"].pad(duration=2.0, direction="both").with_id("padded"),
        "st": c["st"],
        "cmd": command_cut(recs["rec2"], f"cat {tmp_path / 'rec2.wav'}"),
    }
    sf.write(tmp_path / "gone.wav", tone(2, 1.0, 16000), 16000)
    gone = Recording.from_file(str(tmp_path / "gone.wav"), recording_id="gone")
    extra = [gone.to_cut().with_id("gone"), MonoCut("silent", 0, 1.0, 0, recording=recs["rec2"])]
    for x in extra[:1]:
        x.supervisions = [sup("g", "gone", 0, 1, "audio went missing")]
    manifest = str(tmp_path / "cuts.jsonl.gz")
    CutSet.from_cuts([*cuts.values(), *extra]).to_file(manifest)
    (tmp_path / "gone.wav").unlink()
    s = prepare(assets, tmp_path / "out", ("lhotse", manifest))
    got = items_by_id(tmp_path / "out")
    assert set(got) == set(cuts) and s["skipped_by_reason"] == {"empty_text": 1,
                                                                "missing_audio": 1}  # fmt: skip
    assert {k: v["reason"] for k, v in failures(tmp_path / "out").items()} == {
        "gone": "missing_audio", "silent": "empty_text"}  # fmt: skip
    for cut in CutSet.from_file(manifest).filter(lambda x: x.id in cuts):
        np.testing.assert_array_equal(got[cut.id].audio_codes, expected_codes(assets, cut))
    texts = {k: v.text for k, v in got.items()}
    assert texts["a"] == texts["speed"] == "hello there the cat sat"  # time order
    assert texts["mixed"] == "hello there on the mat the cat sat" and texts["cmd"] == "hello there"
    assert texts["st"] == texts["resampled"] == "left side right side"  # mix: every channel
    assert got["speed"].seconds == pytest.approx(1.5 / 1.1, abs=1e-3)
    assert got["padded"].seconds == pytest.approx(2.0, abs=1e-3)
    # the stereo cut's codes are its two channels averaged, not one of them
    assert c["st"].load_audio().shape[0] == 2
    assert not np.array_equal(
        got["st"].audio_codes, expected_codes(assets, c["st"].with_channels(0))
    )


def test_cutset_object_memory_trim_and_channel(assets, tmp_path):
    """From Python, a CutSet object: a memory cut equals the file cut it was made from,
    ``trim`` padding gives back the unpadded cut, channel 1 is that channel only."""
    c = base_cuts(recordings(tmp_path))
    padded = c["b"].pad(duration=2.5, direction="both").with_id("padded")
    memory = c["a"].move_to_memory().with_id("memory")
    cuts = CutSet.from_cuts([memory, padded, c["st"], c["b"].pad(3.0).tracks[1].cut.with_id("p")])
    s = prepare(assets, tmp_path / "out", ("lhotse", cuts),
                source_options={"lhotse_padding": "trim", "lhotse_channel": 1})  # fmt: skip
    got = items_by_id(tmp_path / "out")
    assert set(got) == {"memory", "padded", "st"}
    assert failures(tmp_path / "out")["p"]["reason"] == "empty_audio"  # all padding, trimmed
    assert s["items_skipped"] == 1
    np.testing.assert_array_equal(got["memory"].audio_codes, expected_codes(assets, c["a"]))
    np.testing.assert_array_equal(got["padded"].audio_codes, expected_codes(assets, c["b"]))
    assert got["padded"].seconds == pytest.approx(1.25, abs=1e-3)
    right = c["st"].load_audio()[1:2]  # channel 1 of lhotse's stereo load
    g = math.gcd(22050, SR)
    wav = resample_poly(right[0], SR // g, 22050 // g).astype(np.float32)
    np.testing.assert_array_equal(got["st"].audio_codes, assets["codec_obj"].encode([wav])[0])
    assert got["st"].text == "right side" and got["memory"].text == "hello there the cat sat"


def write_shar(tmp_path) -> tuple[str, list]:
    """A Shar directory written by lhotse (3 shards of 2 cuts; a speed-perturbed, a memory and a
    stereo cut among them); the original wavs are deleted afterwards."""
    c = base_cuts(recordings(tmp_path))
    cuts = [c["a"], c["a"].perturb_speed(0.9).with_id("slow"), c["b"],
            c["b"].move_to_memory().with_id("memory"), c["st"], c["a"].with_id("a2")]  # fmt: skip
    shar = tmp_path / "shar"
    shar.mkdir()
    CutSet.from_cuts(cuts).to_shar(str(shar), fields={"recording": "flac"}, shard_size=2)
    for name in ("rec0", "rec1", "rec2"):
        (tmp_path / f"{name}.wav").unlink()  # no detour through the original files
    return str(shar), [x.id for x in cuts]


def test_shar_codes_workers_and_resume(assets, tmp_path):
    shar, ids = write_shar(tmp_path)
    one = tmp_path / "one"
    prepare(assets, one, ("lhotse_shar", shar), shard_size=2)
    got = items_by_id(one)
    assert list(PreparedDataset(str(one)).ids) == ids
    for cut in CutSet.from_shar(in_dir=shar):  # lhotse's own Shar reader
        np.testing.assert_array_equal(got[cut.id].audio_codes, expected_codes(assets, cut))
    assert got["slow"].seconds == pytest.approx(1.5 / 0.9, abs=1e-3)
    assert got["st"].text == "left side right side"
    two = tmp_path / "two"
    rc = main(["--lhotse-shar", shar, "--codec", assets["codec"], "--tokenizer", assets["tok"],
               "--out-dir", str(two), "--workers", "2", "--shard-size", "2", "--codec-batch-size", "1",
               "--no-progress"])  # fmt: skip
    assert rc == 0
    assert_same_dataset(str(one), str(two))
    shutil.rmtree(two / "shards" / "00001")  # an interrupted run: one shard never finished
    os.remove(two / "metadata.json")
    s = prepare(assets, two, ("lhotse_shar", shar), shard_size=2)
    assert (s["shards_reused"], s["shards_written"]) == (2, 1)
    assert_same_dataset(str(one), str(two))


def test_shar_channel_choice(assets, tmp_path):
    shar, _ = write_shar(tmp_path)
    prepare(assets, tmp_path / "o", ("lhotse_shar", shar), shard_size=8,
            source_options={"lhotse_channel": 0})  # fmt: skip
    cut = next(x for x in CutSet.from_shar(in_dir=shar) if x.id == "st")
    item = items_by_id(tmp_path / "o")["st"]
    assert item.text == "left side"
    np.testing.assert_array_equal(item.audio_codes, expected_codes(assets, cut.with_channels(0)))


def test_broken_shar_named_before_any_work(assets, tmp_path, capsys):
    shar, _ = write_shar(tmp_path)
    args = ["--codec", assets["codec"], "--tokenizer", assets["tok"], "--no-progress"]
    tar = os.path.join(shar, "recording.000001.tar")
    data = open(tar, "rb").read()
    with open(tar, "wb") as f:
        f.write(data[: len(data) // 2])
    assert main(["--lhotse-shar", shar, "--out-dir", str(tmp_path / "o1"), *args]) == 1
    err = capsys.readouterr().err
    assert "recording.000001.tar: truncated" in err and not (tmp_path / "o1").exists()
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        third = t.getmembers()[2].offset
    with open(tar, "wb") as f:  # cut after its first cut's pair of members: one cut short
        f.write(data[:third])
    assert main(["--lhotse-shar", shar, "--out-dir", str(tmp_path / "o1"), *args]) == 1
    assert "holds audio for 1 of the 2 cuts" in capsys.readouterr().err
    os.remove(tar)
    assert main(["--lhotse-shar", shar, "--out-dir", str(tmp_path / "o2"), *args]) == 1
    assert "recording.000001.tar is missing" in capsys.readouterr().err
    assert not (tmp_path / "o2").exists()
    # a tar that lhotse cannot decode inside: that cut is recorded, the others prepared
    with open(tar, "wb") as f:
        f.write(data)
    bad = os.path.join(shar, "recording.000002.tar")
    raw = bytearray(open(bad, "rb").read())
    raw[512:600] = b"\0" * 88  # the first cut's flac header
    open(bad, "wb").write(bytes(raw))
    s = prepare(assets, tmp_path / "o3", ("lhotse_shar", shar), shard_size=2)
    fails = failures(tmp_path / "o3")
    assert set(fails) == {"st"} and fails["st"]["reason"] == "unreadable_audio"
    assert "lhotse cannot load it" in fails["st"]["detail"] and bad in fails["st"]["audio"]
    assert s["num_items"] == 5


def test_bad_cuts_and_options(assets, tmp_path, capsys):
    recs = recordings(tmp_path)
    c = base_cuts(recs)
    good = json.dumps(c["b"].to_dict())
    path = tmp_path / "cuts.jsonl"
    path.write_text(good + "\n" + '{"id": "x", "type": "Nope"}\n')
    with pytest.raises(ManifestError, match=r"cuts\.jsonl:2: lhotse cannot read this cut"):
        read_lhotse_cuts(str(path))
    path.write_text(good + "\n" + good + "\n")
    with pytest.raises(ManifestError, match=r"cuts\.jsonl:2: duplicate cut id 'b'"):
        read_lhotse_cuts(str(path))
    CutSet.from_cuts([c["st"]]).to_file(str(path))
    with pytest.raises(
        ManifestError, match=r"cut 'st' has channels \[0, 1\], not --lhotse-channel 4"
    ):
        read_lhotse_cuts(str(path), channel=4)
    with pytest.raises(ValueError, match="--lhotse-padding must be keep or trim"):
        read_lhotse_cuts(str(path), padding="cut")
    rc = main(["--lhotse", str(path), "--lhotse-channel", "left", "--codec", assets["codec"],
               "--tokenizer", assets["tok"], "--out-dir", str(tmp_path / "o"), "--no-progress"])  # fmt: skip
    assert (
        rc == 1 and "--lhotse-channel must be 'mix' or a channel number" in capsys.readouterr().err
    )
    # a cut lhotse cannot load (garbage where its audio should be): recorded with its id
    (tmp_path / "junk.wav").write_bytes(b"not audio at all" * 100)
    junk = dict(recs["rec2"].to_dict(), id="junk",
                sources=[{"type": "file", "channels": [0], "source": "junk.wav"}])  # fmt: skip
    bad = MonoCut("junk", 0, 1.0, 0, recording=Recording.from_dict(junk),
                  supervisions=[sup("j", "junk", 0, 1, "hello there")])  # fmt: skip
    rel = tmp_path / "rel.jsonl"
    CutSet.from_cuts([c["b"], bad]).to_file(str(rel))  # junk.wav relative: the manifest's folder
    s = prepare(assets, tmp_path / "o2", ("lhotse", str(rel)))
    fail = failures(tmp_path / "o2")["junk"]
    assert fail["reason"] == "unreadable_audio" and "lhotse cannot load it" in fail["detail"]
    assert str(tmp_path / "junk.wav") in fail["audio"] and s["num_items"] == 1


def test_missing_lhotse_names_the_install_line(assets, tmp_path, capsys, monkeypatch):
    path = tmp_path / "cuts.jsonl"
    path.write_text("{}\n")
    monkeypatch.setitem(sys.modules, "lhotse", None)  # `import lhotse` now raises ImportError
    rc = main(["--lhotse", str(path), "--codec", assets["codec"], "--tokenizer", assets["tok"],
               "--out-dir", str(tmp_path / "o"), "--no-progress"])  # fmt: skip
    assert rc == 1 and INSTALL in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
