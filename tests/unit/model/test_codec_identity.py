"""The codec of a run, typed once (model/codec_identity.py) and carried whole: metadata.json keeps
its shape, and the files whose shape changed (run record 2, checkpoint identity 2, export 2) are
written with the codec once while files of the format before are still read."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests.helpers import build_speechlm, save_tiny_backbone
from torchtitan_speechlm.components.resume import (
    IDENTITY_VERSION,
    DataIdentity,
    DataOrder,
    identity_difference,
    run_identity,
)
from torchtitan_speechlm.data.format import codec_of, first_difference
from torchtitan_speechlm.model.codec_identity import CodecIdentity
from torchtitan_speechlm.model.pretrained import EXPORT_VERSION, args_from_record, write_safetensors
from torchtitan_speechlm.model.run_record import (
    RECORD_VERSION,
    RUN_RECORD,
    RunRecordError,
    check_same_data,
    model_args_of,
    model_record,
    record_run,
    recorded_codec,
)

# metadata.json's codec entry as `torchtitan prepare` has always written it (prepare/plan.py)
ENTRY = {
    "name": "kmeans", "path": "/c/kmeans", "class": "KMeansCodec", "sample_rate": 16000,
    "frame_rate": 50, "num_streams": 2, "total_streams": 4, "codebook_size": 64,
    "config_hash": "aaaa1111",
}  # fmt: skip


def test_a_prepared_codec_entry_round_trips_with_its_keys_in_order():
    codec = CodecIdentity.from_dict(ENTRY)
    assert (codec.num_streams, codec.codebook_size, codec.frame_rate) == (2, 64, 50)
    assert codec.codec_class == "KMeansCodec" and codec.total_streams == 4
    assert list(codec.to_dict().items()) == list(ENTRY.items())
    loaded = SimpleNamespace(
        name="kmeans", path="/c/kmeans", class_name="KMeansCodec", sample_rate=16000,
        frame_rate=50, num_streams=2, total_streams=4, codebook_size=64, config_hash="aaaa1111",
    )  # fmt: skip
    assert CodecIdentity.of_codec(loaded).to_dict() == ENTRY  # what prepare writes
    # a Python data object's codec: the keys it knows, no empty path or class
    espnet = CodecIdentity(name="espnet:speech", num_streams=8, codebook_size=1024,
                           frame_rate=50.0, config_hash="e5")  # fmt: skip
    assert set(espnet.to_dict()) == {"name", "frame_rate", "num_streams", "codebook_size",
                                     "config_hash"}  # fmt: skip
    assert CodecIdentity.from_dict(espnet.to_dict()) == espnet


def test_datasets_mix_when_their_codecs_agree_on_what_the_codes_mean():
    other = {**ENTRY, "path": "/elsewhere", "sample_rate": 24000}
    assert first_difference({"codec": ENTRY}, {"codec": other}) is None
    assert first_difference({"codec": ENTRY}, {"codec": {**ENTRY, "codebook_size": 32}}) == (
        "codec.codebook_size"
    )
    assert codec_of({"codec": ENTRY}).same_codes(CodecIdentity(config_hash="bbbb")) is False
    assert CodecIdentity().same_codes(codec_of({"codec": ENTRY})) is None  # nothing to compare


def job(tmp_path):
    return SimpleNamespace(
        job=SimpleNamespace(dump_folder=str(tmp_path)),
        model=SimpleNamespace(name="speechlm", flavor="hf"),
    )


def test_the_run_record_names_the_codec_once_and_a_version_1_record_is_read(tmp_path):
    save_tiny_backbone(tmp_path / "bb")
    args = build_speechlm(tmp_path / "bb").args
    codec = CodecIdentity.from_dict(ENTRY)
    record = record_run(
        job(tmp_path), args, backbone_path=str(tmp_path / "bb"), codec=codec,
        tokenizer={"hash": "t1"}, datasets={"tiny": "data/tiny"},
    )  # fmt: skip
    written = json.loads((tmp_path / RUN_RECORD).read_text())
    assert written["version"] == RECORD_VERSION == 2
    assert written["codec"] == ENTRY and "codec_hash" not in written["model_args"]
    assert recorded_codec(record) == codec

    # version 1: the hash also (or only: a Python data object's run) in model_args.codec_hash
    v1 = {"version": 1, "codec": {"name": "espnet:speech", "num_streams": 8},
          "model_args": {**model_record(args), "codec_hash": "cccc"}}  # fmt: skip
    assert recorded_codec(v1).config_hash == "cccc" and recorded_codec(v1).num_streams == 8
    assert "codec_hash" not in model_args_of(v1)
    assert args_from_record(v1["model_args"]).vocab == args.vocab  # the old key is ignored
    with pytest.raises(RunRecordError, match="cccc"):
        check_same_data(v1, codec, None, {}, "R")
    # a version 2 record takes no hash from its model args
    assert recorded_codec({**v1, "version": 2}).config_hash == ""


def test_checkpoint_identity_2_carries_the_codec_whole_and_version_1_is_compared(tmp_path):
    codec = CodecIdentity.from_dict(ENTRY)
    data = DataIdentity(codec, {"hash": "t1", "path": "/t", "vocab_size": 9}, {})
    ours = run_identity(data, DataOrder(("tts:tiny",), 0, True, "pack"), "f00d")
    assert ours["version"] == IDENTITY_VERSION == 2 and ours["codec"] == ENTRY
    v1 = {"codec": {"name": "kmeans", "config_hash": "aaaa1111"}, "vocab": "f00d",
          "data_order": {"train": ["tts:tiny"], "seed": 0, "shuffle": True,
                         "batching": "pack"}}  # fmt: skip
    assert identity_difference(v1, ours) is None
    other = {**v1, "codec": {"name": "kmeans", "config_hash": "bbbb2222"}}
    why = identity_difference(other, ours)
    assert "codec kmeans (config_hash bbbb2222" in why and "aaaa1111" in why


def test_an_export_of_version_1_loads_with_its_codec(tmp_path):
    """Export 1 kept the codec's hash in model_args.codec_hash (its codec entry from a Python
    data object's run had none): its model builds and its codec is the folder it carries, with
    that hash; an export 2 names the codec once."""
    from torchtitan_speechlm.generation.loading import load_model

    assert EXPORT_VERSION == 2
    save_tiny_backbone(tmp_path / "bb")
    src = build_speechlm(tmp_path / "bb")
    out = tmp_path / "export"
    out.mkdir()
    write_safetensors(src.state_dict(), str(out), 1 << 30)
    config = {
        "model_type": "speechlm", "format_version": 1,
        "model_args": {**model_record(src.args), "codec_hash": "cccc"},
        "codec": {"name": "espnet:speech", "path": "/gone", "folder": "codec", "num_streams": 3},
        "tokenizer": {"path": ""},
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    loaded = load_model(str(out))
    assert loaded.codec_identity.config_hash == "cccc"
    assert loaded.codec_path == str(out / "codec")
    for (n, p), (_, q) in zip(src.named_parameters(), loaded.model.named_parameters(), strict=True):
        assert p.shape == q.shape and bool((p == q).all()), n


# Where a ``codec`` entry of a dict is read, each with its reason: the owners that turn an
# on-disk entry into a CodecIdentity, and dicts whose "codec" is not a codec identity.
CODEC_ENTRY_READERS = {
    ("data/format.py", "codec_of"): "metadata.json, shard.json and plan.json: the one reader",
    ("model/run_record.py", "recorded_codec"): "run records and exports (and their version 1)",
    ("components/resume.py", "identity_difference"): "a checkpoint's identity and the run's",
    ("prepare/worker.py", "_audio"): "the worker's loaded Codec object, not an identity",
    ("prepare/worker.py", "_encode_all"): "as above",
    ("prepare/worker.py", "_write"): "as above",
    ("prepare/worker.py", "run_shard"): "as above",
    ("demo/speaking.py", "build_corpus"): "a demo corpus plan's codec kind, not an identity",
}


def codec_entry_reads(root) -> set[tuple[str, str]]:
    """(module path, innermost function) of every ``x["codec"]`` / ``x.get("codec")`` read."""
    import ast

    found = set()

    def visit(node, where: str, path: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            where = node.name
        key = None
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            key = node.slice
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "get" and node.args):  # fmt: skip
            key = node.args[0]
        if isinstance(key, ast.Constant) and key.value == "codec":
            found.add((path, where))
        for child in ast.iter_child_nodes(node):
            visit(child, where, path)

    for path in root.rglob("*.py"):
        visit(ast.parse(path.read_text()), "<module>", str(path.relative_to(root)))
    return found


def test_a_codec_entry_is_read_only_where_it_becomes_a_codec_identity():
    """No module reads a codec's fields from a dict: the entry becomes a ``CodecIdentity`` at
    its owner (``CODEC_ENTRY_READERS``) and the value travels from there."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[3] / "torchtitan_speechlm"
    found = codec_entry_reads(root)
    assert found == set(CODEC_ENTRY_READERS), sorted(found ^ set(CODEC_ENTRY_READERS))
