"""A run's checkpoints hold weights trained on the codes of one codec and the ids of one text
tokenizer: a resume (or a new run's ``speechlm.init_from``) onto data made with another codec
is refused before any rank starts, naming both codecs, the datasets and the fix (issue 39,
finding 1). Data re-prepared with the same codec and tokenizer still resumes."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers import make_tiny_run_assets, run_train, write_tiny_config
from tests.tiny_codecs import build_codec
from torchtitan_speechlm.model.codec_identity import CodecIdentity
from torchtitan_speechlm.model.run_record import RunRecordError, check_same_data
from torchtitan_speechlm.prepare.pipeline import prepare_dataset

FAST = ("--validation.enable", "false")


@pytest.mark.long  # in make faults (make test budget)
def test_resume_onto_data_of_another_codec_is_refused_naming_both(tmp_path):
    assets = make_tiny_run_assets(tmp_path)
    dump = tmp_path / "run"
    cfg = write_tiny_config(tmp_path / "run.toml", assets, dump)
    r = run_train(cfg, "--training.steps", "2", "--checkpoint.interval", "2", *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    record = json.loads((dump / "speechlm_run.json").read_text())
    old_hash = record["codec"]["config_hash"]
    assert old_hash and record["tokenizer"]["hash"]  # the resume identity is recorded

    # the same corpus encoded with another codec of the same shape (4 x 64, another seed)
    manifest = str(tmp_path / "manifest.jsonl")
    other_codec = build_codec(str(tmp_path / "codec_seed1"), seed=1)
    other = str(tmp_path / "prepared_seed1")
    prepare_dataset(manifest, other_codec, assets["tokenizer"], other, progress=False)
    new_hash = json.loads(open(os.path.join(other, "metadata.json")).read())["codec"]["config_hash"]
    assert new_hash != old_hash

    extend = ("--training.steps", "4", "--checkpoint.interval", "2", *FAST)
    r = run_train(cfg, *extend, "--speechlm_data.datasets", f"tiny={other}")
    assert r.returncode == 2, r.stderr[-3000:]
    err = r.stderr
    assert "config error:" in err and "Traceback" not in err
    for needed in (old_hash, new_hash, assets["prepared"], other, assets["codec"], other_codec):
        assert needed in err, needed
    assert "torchtitan prepare" in err and "job.dump_folder" in err
    assert "speechlm.init_from" in err
    assert not (dump / "checkpoint" / "step-4").exists()

    # a new run from that checkpoint's weights on the other codec's data: refused too
    step2 = str(dump / "checkpoint" / "step-2")
    r = run_train(
        cfg, *extend, "--speechlm_data.datasets", f"tiny={other}",
        "--job.dump_folder", str(tmp_path / "new_run"), "--speechlm.init_from", step2,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-3000:]
    assert "another codec" in r.stderr and old_hash in r.stderr and new_hash in r.stderr
    assert not (tmp_path / "new_run" / "checkpoint").exists()

    # the same codec and tokenizer, re-prepared elsewhere: the run continues
    again = str(tmp_path / "prepared_again")
    prepare_dataset(manifest, assets["codec"], assets["tokenizer"], again, progress=False)
    r = run_train(cfg, *extend, "--speechlm_data.datasets", f"tiny={again}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert (dump / "checkpoint" / "step-4").is_dir()


CODEC_ENTRY = {"name": "encodec", "path": "/c/a", "config_hash": "aaaa"}  # as records hold it
CODEC = CodecIdentity.from_dict(CODEC_ENTRY)
TOKENIZER = {"path": "/t/a", "vocab_size": 259, "hash": "t1"}


def test_another_tokenizer_is_refused_and_an_old_record_resumes_with_a_warning():
    record = {"codec": CODEC_ENTRY, "tokenizer": TOKENIZER, "datasets": {"tiny": "/d/a"}}
    other_tok = {"path": "/t/b", "vocab_size": 259, "hash": "t2"}
    try:
        check_same_data(record, CODEC, other_tok, {"tiny": "/d/b"}, "R")
    except RunRecordError as e:
        msg = str(e)
    else:
        raise AssertionError("another tokenizer was accepted")
    assert "/t/a" in msg and "/t/b" in msg and "t1" in msg and "t2" in msg and "/d/b" in msg
    check_same_data(record, CODEC, TOKENIZER, {"tiny": "/d/elsewhere"}, "R")  # re-prepared

    warnings = []
    old = {"model_args": {}, "datasets": {"tiny": "/d/a"}}  # a record from before the codec key
    check_same_data(old, CODEC, TOKENIZER, {"tiny": "/d/a"}, "R", warn=warnings.append)
    assert len(warnings) == 2 and "resuming anyway" in warnings[0]
    # the codec hash in the model args of a record without the codec section still counts
    old = {"model_args": {"codec_hash": "bbbb"}}
    try:
        check_same_data(old, CODEC, TOKENIZER, {}, "R")
    except RunRecordError as e:
        assert "bbbb" in str(e) and "aaaa" in str(e)
    else:
        raise AssertionError("another codec hash in model_args was accepted")
