"""Expert parallelism through torchtitan's MoE plan (distributed/expert_parallel.py) on the qwen3
backbone, end to end on gloo: EP=2 (2 processes) and EP=2 x FSDP (4 processes: experts sharded
over 2 EP ranks x 2 efsdp ranks) equal one process after 3 steps in loss, grad norm, every
logged statistic (the MoE load-balance loss and the experts' token shares included) and every
parameter, at the same global batch, on packed rows of a varied corpus (espeak-ng speech of
0.4-6 s, Kaldi segments, a Qwen3-MoE with 4 experts, top 2); an EP checkpoint continues on one
process; what expert parallelism cannot run is refused before any rank starts."""

import shutil

import pytest
import torch

from tests.helpers import (
    make_varied_kaldi_assets,
    params,
    read_metrics,
    run_train,
    write_tiny_config,
)

pytestmark = pytest.mark.slow
STEPS = 3
COMMON = (
    "--model.flavor", "qwen3", "--validation.enable", "false",
    "--training.steps", str(STEPS), "--training.global_batch_size", "4",
    "--training.seq_len", "256", "--speechlm.load_balance_weight", "0.01",
    "--checkpoint.interval", "1", "--lr_scheduler.total_steps", str(STEPS),
)  # fmt: skip
EP = ("--parallelism.expert_parallel_degree", "2")
LAYOUTS = {  # name: (processes, flags); the global batch is 4 rows in each
    "one": (1, ("--training.local_batch_size", "2")),  # 2 micro-batches of 2
    "one_rows1": (1, ("--training.local_batch_size", "1")),  # 4 micro-batches of 1
    "ep2": (2, (*EP, "--training.local_batch_size", "2")),
    "ep2_fsdp": (4, (*EP, "--training.local_batch_size", "1")),
}
COMPARED = ("loss_metrics/global_avg_loss", "grad_norm", "train/")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_varied_kaldi_assets(
        tmp_path_factory.mktemp("ep_assets"), n_utts=24, family="qwen3_moe"
    )


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory):
    root, done = tmp_path_factory.mktemp("ep"), {}

    def get(name: str):
        if name not in done:
            nproc, flags = LAYOUTS[name]
            dump = root / name
            r = run_train(
                write_tiny_config(root / f"{name}.toml", assets, dump),
                *COMMON,
                *flags,
                nproc=nproc,
                timeout=600,
            )
            log = r.stdout + r.stderr
            assert r.returncode == 0, log[-4000:]
            assert ("Applied expert parallelism" in log) == ("ep" in name), log[-3000:]
            done[name] = dump
        return done[name]

    return get


def logged(dump) -> dict[int, dict]:
    return {
        m["step"]: {k: v for k, v in m.items() if k.startswith(COMPARED)}
        for m in read_metrics(dump)
    }


@pytest.mark.parametrize("name, reference", [("ep2", "one"), ("ep2_fsdp", "one_rows1")])
def test_expert_parallelism_trains_as_one_process(runs, name, reference):
    """Against one process with the same micro-batches (the load-balance loss is a function of
    each micro-batch's routing, as in transformers: rows per micro-batch matter)."""
    ref, got = logged(runs(reference)), logged(runs(name))
    assert sorted(ref) == sorted(got) == list(range(1, STEPS + 1))
    for s in ref:
        assert set(got[s]) == set(ref[s]), (s, set(got[s]) ^ set(ref[s]))
        for key, value in ref[s].items():
            assert got[s][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (s, key)
    assert ref[1]["train/load_balance_loss"] > 0 and "train/moe/expert3_share" in ref[1]
    a = params(runs(reference) / "checkpoint" / f"step-{STEPS}")
    b = params(runs(name) / "checkpoint" / f"step-{STEPS}")
    assert set(a) == set(b) and "backbone.layers.1.moe.experts.w1" in a
    for key in a:  # as test_tensor_parallel: Adam turns 1e-7 gradient differences into <= 1e-5
        torch.testing.assert_close(b[key], a[key], atol=2e-5, rtol=1e-5, msg=key)


def test_an_expert_parallel_checkpoint_continues_on_one_process(assets, runs, tmp_path):
    dump = tmp_path / "resumed"
    shutil.copytree(runs("ep2"), dump)
    shutil.rmtree(dump / "checkpoint" / f"step-{STEPS}")
    (dump / "metrics.jsonl").unlink()
    r = run_train(write_tiny_config(tmp_path / "r.toml", assets, dump), *COMMON, *LAYOUTS["one"][1])
    log = r.stdout + r.stderr
    assert r.returncode == 0 and f"Training starts at step {STEPS}" in log, log[-3000:]
    a = params(runs("one") / "checkpoint" / f"step-{STEPS}")
    b = params(dump / "checkpoint" / f"step-{STEPS}")
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=2e-5, rtol=1e-5, msg=key)


REFUSED = [  # (flags, processes, words the one-line error must hold)
    ((*EP, "--model.flavor", "hf"), 2, 'model.flavor = "qwen3"'),
    (("--parallelism.expert_parallel_degree", "8"), 8, "does not divide the backbone's 4 experts"),
    (("--parallelism.expert_parallel_degree", "4"), 2, "must divide the data-parallel shard"),
    ((*EP, "--parallelism.expert_tensor_parallel_degree", "2"), 2, "expert_tensor_parallel"),
    ((*EP, "--parallelism.pipeline_parallel_degree", "2"), 4, "pipeline_parallel_degree = 2"),
]


@pytest.mark.parametrize("flags, nproc, words", REFUSED, ids=[w for *_, w in REFUSED])
def test_what_expert_parallelism_cannot_run_is_refused(assets, tmp_path, flags, nproc, words):
    cfg = write_tiny_config(tmp_path / "c.toml", assets, tmp_path / "run")
    r = run_train(cfg, *COMMON, "--training.local_batch_size", "1", *flags, nproc=nproc)
    assert r.returncode == 2, (r.stdout + r.stderr)[-3000:]
    assert words in r.stderr and "config error" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "run" / "checkpoint").exists()


def test_expert_parallelism_on_a_dense_backbone_is_refused(tmp_path):
    from tests.helpers import make_tiny_run_assets

    assets = make_tiny_run_assets(tmp_path / "dense", n_items=8, family="qwen3")
    cfg = write_tiny_config(tmp_path / "c.toml", assets, tmp_path / "run")
    r = run_train(cfg, *COMMON, "--training.local_batch_size", "1", *EP, nproc=2)
    assert r.returncode == 2 and "is dense (no experts to shard)" in r.stderr, r.stderr[-2000:]
