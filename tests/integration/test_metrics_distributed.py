"""2 ranks x gradient accumulation 2 == 1 rank x 4 micro-batches: logged statistics and the
updated parameters (every one: embeddings, head, stream embeddings), for FSDP2 and DDP."""

import pytest
import torch

from tests.helpers import make_tiny_run_assets, read_metrics, run_train, write_tiny_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_tiny_run_assets(tmp_path_factory.mktemp("assets"))


def load_params(ckpt_dir, tmp_path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{ckpt_dir.parent.parent.name}.pt"
    dcp_to_torch_save(str(ckpt_dir), str(out))
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def run(assets, tmp_path, name, nproc, *extra):
    dump = tmp_path / name
    cfg = write_tiny_config(tmp_path / f"{name}.toml", assets, dump)
    r = run_train(
        cfg,
        "--training.steps",
        "2",
        "--training.local_batch_size",
        "2",
        "--training.global_batch_size",
        "8",
        "--checkpoint.interval",
        "2",
        "--checkpoint.last_save_model_only",
        "true",
        "--validation.enable",
        "false",
        *extra,
        nproc=nproc,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {m["step"]: m for m in read_metrics(dump) if "train/loss" in m}
    return rows, load_params(dump / "checkpoint" / "step-2", tmp_path)


@pytest.mark.parametrize("parallel", ["fsdp", pytest.param("ddp", marks=pytest.mark.long)])
def test_two_ranks_with_accumulation_match_one_rank(assets, tmp_path, parallel):
    ref_rows, ref_params = run(assets, tmp_path, "ref", 1)
    extra = (
        (
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "1",
        )
        if parallel == "ddp"
        else ()
    )
    rows, params = run(assets, tmp_path, parallel, 2, *extra)
    for step in (1, 2):
        for key, value in ref_rows[step].items():
            if key.startswith("train/") and "throughput" not in key:
                assert rows[step][key] == pytest.approx(value, abs=1e-5, rel=1e-5), (step, key)
        assert rows[step]["grad_norm"] == pytest.approx(ref_rows[step]["grad_norm"], rel=1e-4)
    assert set(params) == set(ref_params)
    for name in ("tok_embeddings.weight", "head.output.weight", "head.stream_emb.weight"):
        assert name in params
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, atol=2e-6, rtol=1e-5, msg=name)
    # the parameters really moved (we are not comparing two untouched inits)
    assert ref_rows[2]["train/loss"] != ref_rows[1]["train/loss"]
