"""Prepared datasets on object storage (data/remote.py), against a real S3 server: moto's server
mode started on 127.0.0.1 by this module, reached through s3fs and botocore exactly as an S3
bucket is (credentials from AWS_* variables, AWS_ENDPOINT_URL). Nothing of the reader is mocked.

- `torchtitan prepare --out-dir s3://...` prepares in its staging folder and uploads, metadata.json
  last; `torchtitan train` on `NAME=s3://...` consumes the same micro-batches (content hashes)
  as on the same manifest prepared to a local folder;
- read item by item through a mirror capped below the dataset's size, every item equals the
  local dataset's, and the mirror's arrays stay under the cap (shards evicted and fetched again);
- an object whose size differs from metadata.json's record, a missing bucket and missing
  credentials are each one line naming the URL.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.helpers import make_tiny_run_assets, run_train, write_tiny_config
from torchtitan_speechlm.commands.prepare import main as prepare_main
from torchtitan_speechlm.data.catalog import open_prepared
from torchtitan_speechlm.data.format import CorruptDatasetError
from torchtitan_speechlm.data.reader import PreparedDataset
from torchtitan_speechlm.data.remote import ARRAYS, RemoteCache, RemoteDatasetError

pytestmark = pytest.mark.slow
SHARD_SIZE = 5  # 24 items: 5 shards, for the cache to evict


@pytest.fixture(scope="module")
def s3():
    """A bucket on an S3 server on 127.0.0.1; the AWS_* variables every process of the test
    (and the ranks it forks) reads. Yields an fsspec filesystem of it."""
    pytest.importorskip("s3fs")
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://{host}:{port}"}  # fmt: skip
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir("speech")
    try:
        yield fs
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def prepared(s3, tmp_path_factory):
    """The tiny assets (a local prepared dataset) and the same manifest prepared to s3."""
    tmp = tmp_path_factory.mktemp("object_storage")
    assets = make_tiny_run_assets(tmp / "assets", n_items=24)
    local = str(tmp / "local")  # the same manifest and shard size, prepared to a folder
    url = "s3://speech/tiny"
    common = ["--manifest", str(tmp / "assets" / "manifest.jsonl"), "--codec", assets["codec"],
              "--tokenizer", assets["tokenizer"], "--shard-size", str(SHARD_SIZE),
              "--no-progress"]  # fmt: skip
    assert prepare_main([*common, "--out-dir", local]) == 0
    assert prepare_main([*common, "--out-dir", url, "--staging", str(tmp / "staging")]) == 0
    return {"assets": assets, "local": local, "url": url, "tmp": tmp}


def test_prepare_uploads_the_dataset_metadata_last(s3, prepared):
    staging = prepared["tmp"] / "staging"
    listed = {k.removeprefix("speech/tiny/"): v["size"]
              for k, v in s3.find("speech/tiny", detail=True).items()}  # fmt: skip
    meta = json.loads((staging / "metadata.json").read_text())
    assert len(meta["shards"]) == 5
    for entry in meta["shards"]:
        for name, rec in entry["files"].items():
            assert listed[f"shards/{entry['name']}/{name}"] == rec["bytes"]
    assert s3.cat_file("speech/tiny/metadata.json") == (staging / "metadata.json").read_bytes()
    assert not any(k.startswith("index/") for k in listed)  # built by the readers, locally


def test_a_capped_mirror_reads_every_item_as_the_local_dataset(prepared, tmp_path):
    cap_bytes = 2 * max(
        sum(f["bytes"] for n, f in e["files"].items() if n in ARRAYS)
        for e in json.loads((prepared["tmp"] / "staging" / "metadata.json").read_text())["shards"]
    )
    remote = RemoteCache(str(tmp_path / "mirror"), cap_bytes / 2**30)
    local = PreparedDataset(prepared["local"])
    ds = PreparedDataset(prepared["url"], verify="full", shard_cache=1, remote=remote)
    assert ds.source == prepared["url"] and ds.path.startswith(str(tmp_path / "mirror"))
    assert len(ds) == len(local) == 24
    for _ in range(2):  # twice through: shards evicted in the first pass are fetched again
        for i in range(len(ds)):
            a, b = ds[i], local[i]
            assert (a.id, a.text) == (b.id, b.text)
            np.testing.assert_array_equal(a.text_tokens, b.text_tokens)
            np.testing.assert_array_equal(a.audio_codes, b.audio_codes)
            held = sum(
                os.path.getsize(os.path.join(d, n))
                for d, _, names in os.walk(ds.path)
                for n in names
                if n in ARRAYS
            )
            assert held <= cap_bytes
    assert ds.mirror.fetched > 5  # evicted shards came back: the cap held, not the disk
    # a second open maps the index the first one built in the mirror
    again = PreparedDataset(prepared["url"], remote=remote)
    assert not again.index_info.built and again.index_info.folder.startswith(ds.path)


def test_train_on_s3_consumes_the_local_runs_batches(prepared, tmp_path):
    hashes = {}
    for name, data in (("local", prepared["local"]), ("s3", prepared["url"])):
        dump = tmp_path / name
        cfg = write_tiny_config(
            tmp_path / f"{name}.toml", dict(prepared["assets"], prepared=data), dump
        )
        r = run_train(
            cfg, "--training.steps", "3", "--validation.enable", "false",
            "--checkpoint.enable", "false", "--speechlm_data.log_batch_hashes", "true",
            "--speechlm_data.remote_cache_dir", str(tmp_path / "mirror"),
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        lines = (dump / "batch_hashes" / "rank0.jsonl").read_text().splitlines()
        hashes[name] = [json.loads(x)["hash"] for x in lines]
    assert len(hashes["local"]) == 3 and hashes["s3"] == hashes["local"]
    assert any((tmp_path / "mirror").rglob("audio_codes.npy"))  # read through the mirror


def test_an_object_of_the_wrong_size_names_its_url(s3, prepared, tmp_path):
    s3.copy("speech/tiny", "speech/damaged", recursive=True)
    key = "speech/damaged/shards/00002/audio_codes.npy"
    s3.pipe_file(key, s3.cat_file(key)[:-10])
    with pytest.raises(CorruptDatasetError) as e:
        PreparedDataset("s3://speech/damaged", remote=RemoteCache(str(tmp_path)))
    msg = str(e.value)
    assert f"s3://{key} has" in msg and "metadata.json recorded" in msg and "\n" not in msg


def test_a_changed_byte_of_a_fetched_shard_is_refused_under_full_verification(
    s3, prepared, tmp_path
):
    """Same size, other bytes: the listing cannot see it; with verify_shards = "full" the
    fetched array's sha256 is checked against metadata.json before the shard is read."""
    s3.copy("speech/tiny", "speech/flipped", recursive=True)
    key = "speech/flipped/shards/00001/text_tokens.npy"
    data = bytearray(s3.cat_file(key))
    data[-1] ^= 0xFF
    s3.pipe_file(key, bytes(data))
    ds = PreparedDataset("s3://speech/flipped", verify="full", remote=RemoteCache(str(tmp_path)))
    first = ds.index.shard_items(1)[0]
    assert ds[0].id == "u0"  # shard 0 is intact and reads
    with pytest.raises(CorruptDatasetError) as e:
        ds[first]
    assert f"s3://{key} was modified" in str(e.value) and "sha256" in str(e.value)
    loose = PreparedDataset(
        "s3://speech/flipped", verify="size", remote=RemoteCache(str(tmp_path / "b"))
    )
    assert len(loose[first].text_tokens)  # "size" does not hash: it reads what is there


def test_a_missing_bucket_or_credentials_is_one_line_naming_the_url(
    s3, prepared, tmp_path, monkeypatch
):
    cache = RemoteCache(str(tmp_path))
    with pytest.raises(RemoteDatasetError) as e:
        open_prepared("s3://no-such-bucket/tiny", "size", cache)
    assert "s3://no-such-bucket/tiny" in str(e.value) and "bucket does not exist" in str(e.value)
    # as `torchtitan train` says it: one line, before any rank starts
    assets = dict(prepared["assets"], prepared="s3://no-such-bucket/tiny")
    r = run_train(write_tiny_config(tmp_path / "t.toml", assets, tmp_path / "run"))
    said = [x for x in r.stderr.splitlines() if "no-such-bucket" in x]
    assert r.returncode != 0 and len(said) == 1 and "bucket does not exist" in said[0], r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "run").exists()
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    import fsspec

    fsspec.filesystem("s3").clear_instance_cache()
    with pytest.raises(RemoteDatasetError) as e:
        PreparedDataset("s3://speech/tiny", remote=cache)
    msg = str(e.value)
    assert msg.startswith("cannot read s3://speech/tiny: no credentials") and "\n" not in msg
    assert "AWS_ACCESS_KEY_ID" in msg
