"""Text tokenizer round trip (issue 18): a tokenizer that loses spaces made `torchtitan eval`
score transcripts that were right word for word as WER 1.000. `torchtitan prepare` and the
checks `torchtitan train` runs before any rank starts refuse such a tokenizer, naming the first
text that does not come back and the fix; byte-level BPE and SentencePiece-style (Metaspace)
tokenizers pass; a flag accepts a lossy one knowingly, with one warning line."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.data_fixtures import build_assets
from tests.helpers import TINY_BACKBONE, write_tiny_config
from torchtitan_speechlm.commands.prepare import main as prepare_main
from torchtitan_speechlm.data.tokenizer_check import (
    LossyTokenizerError,
    Sample,
    roundtrip_report,
    sample_indices,
)
from torchtitan_speechlm.demo.assets import SPECIAL_TOKENS, build_backbone
from torchtitan_speechlm.prepare.pipeline import prepare_dataset
from torchtitan_speechlm.utils.text_tokenizer import load_text_tokenizer

FIRST = "The quick brown fox jumps over the lazy dog."  # the corpus' first text (line 1, a0)


def save_tokenizer(out: str, sentences: list[str], kind: str) -> str:
    """``lossy``: Whitespace pre-tokenizer + BPE + BPEDecoder (spaces lost); ``lossy_nodecoder``:
    the same without a decoder (tokens joined by spaces); ``metaspace``: a SentencePiece-style
    Unigram (Metaspace pre-tokenizer and decoder), trained from an iterator."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", *SPECIAL_TOKENS.values()]
    if kind == "metaspace":
        tok = Tokenizer(models.Unigram())
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
        trainer = trainers.UnigramTrainer(
            vocab_size=200, special_tokens=specials, unk_token="<unk>", show_progress=False
        )
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        if kind == "lossy":
            tok.decoder = decoders.BPEDecoder()
        trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(sentences, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", **SPECIAL_TOKENS)
    fast.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The tone corpus of data_fixtures (6 items, byte-level BPE ``tok``, encodec codec), the
    other tokenizers, and a tiny backbone whose vocabulary holds any of them."""
    a = build_assets(tmp_path_factory.mktemp("roundtrip"))
    for kind in ("lossy", "lossy_nodecoder", "metaspace"):
        a[kind] = save_tokenizer(os.path.join(a["root"], kind), a["sentences"], kind)
    a["backbone"] = build_backbone(os.path.join(a["root"], "backbone"), vocab_size=320,
                                   **TINY_BACKBONE)  # fmt: skip
    return a


def prepare_args(a: dict, tokenizer: str, out, *extra: str) -> list[str]:
    return ["--manifest", a["manifest"], "--codec", a["codec"], "--tokenizer", tokenizer,
            "--out-dir", str(out), "--no-progress", *extra]  # fmt: skip


def metadata(path) -> dict:
    with open(os.path.join(str(path), "metadata.json")) as f:
        return json.load(f)


def warnings_in(err: str) -> list[str]:
    return [line for line in err.splitlines() if "warning:" in line]


def test_samples_are_spread_over_the_corpus_deterministically():
    assert sample_indices(5) == [0, 1, 2, 3, 4]
    picked = sample_indices(10_000)
    assert len(picked) == 200 == len(set(picked)) and picked == sorted(picked)
    assert (picked[0], picked[-1]) == (0, 9_999) and picked == sample_indices(10_000)
    assert max(b - a for a, b in zip(picked, picked[1:], strict=False)) <= 51


def test_the_report_compares_up_to_whitespace_and_names_the_first_failure(assets):
    good = load_text_tokenizer(assets["tok"])
    ids = tuple(good(FIRST, add_special_tokens=False)["input_ids"])
    spaced = Sample("x", "  The quick\tbrown fox   jumps over the lazy dog. ")
    assert roundtrip_report(good, [Sample("a", FIRST, ids), spaced, Sample("blank", "  ")]) == {
        "checked": 2, "failed": 0, "ok": True,
    }  # fmt: skip
    lossy = load_text_tokenizer(assets["lossy"])
    report = roundtrip_report(lossy, [Sample("a", "ok"), Sample("b", FIRST), Sample("c", FIRST)])
    assert report["ok"] is False and report["failed"] == 2  # "ok" is one token: it comes back
    assert report["first_failure"] == {
        "where": "b", "text": FIRST, "decoded": "Thequickbrownfoxjumpsoverthelazydog.",
    }  # fmt: skip


@pytest.mark.parametrize("kind", ["lossy", "lossy_nodecoder"])
def test_prepare_refuses_a_tokenizer_that_loses_spaces(assets, tmp_path, capsys, kind):
    out = tmp_path / "out"
    assert prepare_main(prepare_args(assets, assets[kind], out)) == 1
    err = capsys.readouterr().err
    assert f"{assets['manifest']}:1: item 'a0'" in err and repr(FIRST) in err
    decoded = load_text_tokenizer(assets[kind]).decode(
        load_text_tokenizer(assets[kind])(FIRST, add_special_tokens=False)["input_ids"]
    )
    assert f"came back as {decoded!r}" in err and assets[kind] in err
    assert "pre_tokenizers.ByteLevel + decoders.ByteLevel" in err and "Metaspace" in err
    assert "--allow-lossy-tokenizer" in err and "6 of 6 sampled texts" in err
    assert not out.exists()  # refused before any output (or codec work)
    with pytest.raises(LossyTokenizerError, match="Thequickbrownfox"):
        prepare_dataset(assets["manifest"], assets["codec"], assets["lossy"], str(out),
                        progress=False)  # fmt: skip


def test_prepare_accepts_a_lossy_tokenizer_with_the_flag_and_records_it(assets, tmp_path, capsys):
    out = tmp_path / "out"
    assert prepare_main(prepare_args(assets, assets["lossy"], out, "--allow-lossy-tokenizer")) == 0
    (line,) = warnings_in(capsys.readouterr().err)
    assert line.startswith("prepare: warning: ") and "accepted" in line and "Thequick" in line
    record = metadata(out)["tokenizer_roundtrip"]
    assert record["ok"] is False and record["allowed"] is True
    assert (record["checked"], record["failed"]) == (6, 6)
    assert record["first_failure"]["text"] == FIRST


@pytest.mark.parametrize("kind", ["tok", "metaspace"])  # byte-level BPE, SentencePiece-style
def test_prepare_accepts_tokenizers_that_give_the_texts_back(assets, tmp_path, capsys, kind):
    out = tmp_path / "out"
    assert prepare_main(prepare_args(assets, assets[kind], out)) == 0
    assert not warnings_in(capsys.readouterr().err)
    assert metadata(out)["tokenizer_roundtrip"] == {"checked": 6, "failed": 0, "ok": True}


@pytest.fixture(scope="module")
def prepared(assets, tmp_path_factory):
    """A dataset made (knowingly) with the lossy tokenizer and one with the byte-level BPE."""
    root = tmp_path_factory.mktemp("prepared")
    out = {}
    for kind, allow in (("lossy", True), ("tok", False)):
        out[kind] = str(root / kind)
        prepare_dataset(assets["manifest"], assets["codec"], assets[kind], out[kind],
                        progress=False, allow_lossy_tokenizer=allow)  # fmt: skip
    return out


def train_config(assets, dataset: str, tmp_path) -> str:
    paths = {"backbone": assets["backbone"], "prepared": dataset}
    return write_tiny_config(tmp_path / "c.toml", paths, tmp_path / "run")


def checked(cfg: str, *extra: str):
    from torchtitan_speechlm.commands.train import check_config, torchtitan_args

    return check_config(torchtitan_args(["--job.config_file", cfg, *extra]))


def test_train_refuses_a_lossy_dataset_before_any_rank_starts(assets, prepared, tmp_path, capsys):
    from torchtitan_speechlm.commands.train import train_command

    cfg = train_config(assets, prepared["lossy"], tmp_path)
    assert train_command(["--job.config_file", cfg]) == 2
    err = capsys.readouterr().err
    assert "torchtitan train: config error: dataset 'tiny': the text tokenizer" in err
    assert f"dataset 'tiny' item 'a0': {FIRST!r} came back as" in err and assets["lossy"] in err
    assert "'Thequickbrownfoxjumpsoverthelazydog.'" in err
    assert "speechlm_data.allow_lossy_tokenizer = true" in err and "decoders.ByteLevel" in err
    assert not (tmp_path / "run").exists()

    checked(cfg, "--speechlm_data.allow_lossy_tokenizer", "true")  # accepted knowingly
    (line,) = warnings_in(capsys.readouterr().err)
    assert line.startswith("torchtitan train: warning: the text tokenizer") and "Thequick" in line


def test_train_accepts_a_dataset_whose_tokenizer_gives_the_texts_back(
    assets, prepared, tmp_path, capsys
):
    checked(train_config(assets, prepared["tok"], tmp_path))
    assert "tokenizer" not in capsys.readouterr().err


def test_train_without_the_tokenizer_folder_reads_what_prepare_recorded(
    assets, prepared, tmp_path, capsys
):
    data = tmp_path / "data"
    shutil.copytree(prepared["lossy"], data)
    meta = metadata(data)
    meta["tokenizer"]["path"] = str(tmp_path / "moved_away")
    (data / "metadata.json").write_text(json.dumps(meta))
    cfg = train_config(assets, str(data), tmp_path)
    from torchtitan_speechlm.config import ConfigError

    with pytest.raises(ConfigError, match="as torchtitan prepare recorded") as e:
        checked(cfg)
    assert f"{assets['manifest']}:1: item 'a0'" in str(e.value) and "Thequick" in str(e.value)

    del meta["tokenizer_roundtrip"]  # prepared before the check existed: cannot check, says so
    (data / "metadata.json").write_text(json.dumps(meta))
    checked(cfg)
    (line,) = warnings_in(capsys.readouterr().err)
    assert "cannot check" in line and "moved_away" in line


def test_dialogue_text_turns_are_checked_at_prepare_and_train(assets, tmp_path):
    from torchtitan_speechlm.data.reader import PreparedDataset
    from torchtitan_speechlm.data.tokenizer_check import dataset_samples

    corpus = os.path.dirname(assets["manifest"])
    manifest = tmp_path / "dialogue.jsonl"
    turns = [{"role": "user", "audio": os.path.join(corpus, "wavs", "a0.wav")},
             {"role": "assistant", "text": FIRST}]  # fmt: skip
    manifest.write_text(json.dumps({"id": "d1", "turns": turns}) + "\n")
    with pytest.raises(LossyTokenizerError, match=r"dialogue.jsonl:1: item 'd1' turn 1: 'The"):
        prepare_dataset(str(manifest), assets["codec"], assets["lossy"], str(tmp_path / "x"),
                        progress=False)  # fmt: skip
    out = str(tmp_path / "out")
    prepare_dataset(str(manifest), assets["codec"], assets["lossy"], out, progress=False,
                    allow_lossy_tokenizer=True)  # fmt: skip
    (sample,) = dataset_samples(PreparedDataset(out), "dataset 'd'")
    assert (sample.where, sample.text) == ("dataset 'd' item 'd1' turn 1", FIRST)
    report = roundtrip_report(load_text_tokenizer(assets["lossy"]), [sample])
    assert report["first_failure"]["decoded"] == "Thequickbrownfoxjumpsoverthelazydog."
