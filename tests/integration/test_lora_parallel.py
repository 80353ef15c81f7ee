"""LoRA (``converters = ["lora"]``) under torchtitan's parallelisms, end to end on gloo, against
one process with the same global batch: 2-process FSDP2 with activation checkpointing, TP=2 on
the native backbone (the adapters sharded beside their base layers), per-layer torch.compile,
and an exact resume from the DCP checkpoint (which holds the adapters and the frozen base); a
native run's merged and PEFT-adapter exports agree with it (q/k rows permuted to HF's order)."""

import shutil

import pytest
import torch

from tests.helpers import (
    HSDP,
    make_tiny_run_assets,
    params,
    read_metrics,
    run_train,
    write_tiny_config,
)
from tests.integration.test_lora_training import assert_exports_agree

pytest.importorskip("peft")
pytestmark = [pytest.mark.slow, pytest.mark.long]  # about 100 s of 2-process runs: make faults
COMMON = (
    "--model.converters",
    "lora",
    "--lora.rank",
    "4",
    "--validation.enable",
    "false",
    "--training.steps",
    "3",
    "--training.global_batch_size",
    "4",
    "--checkpoint.interval",
    "2",
)


def train(assets, root, name, *flags, nproc=1):
    dump = root / name
    r = run_train(
        write_tiny_config(root / f"{name}.toml", assets, dump),
        *COMMON,
        *flags,
        nproc=nproc,
        timeout=400,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return dump, r.stdout + r.stderr


def steps(dump) -> dict[int, dict]:
    return {m["step"]: m for m in read_metrics(dump) if "grad_norm" in m}


def assert_same_run(got, ref, loss_rel=1e-5, grad_rel=1e-5, atol=2e-5):
    a, b = steps(ref), steps(got)
    for s in (1, 2, 3):
        assert b[s]["loss_metrics/global_avg_loss"] == pytest.approx(
            a[s]["loss_metrics/global_avg_loss"], rel=loss_rel
        ), s
        assert b[s]["grad_norm"] == pytest.approx(a[s]["grad_norm"], rel=grad_rel), s
    pa, pb = params(ref / "checkpoint" / "step-3"), params(got / "checkpoint" / "step-3")
    assert set(pa) == set(pb) and any(".lora_B." in k for k in pa)
    for key in pa:
        torch.testing.assert_close(pb[key], pa[key], atol=atol, rtol=1e-5, msg=key)


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory):
    assets = make_tiny_run_assets(tmp_path_factory.mktemp("lora_par_assets"), n_items=24)
    root = tmp_path_factory.mktemp("lora_par")
    return assets, root, train(assets, root, "one")[0]


def test_fsdp2_with_activation_checkpointing_equals_one_process(hf_runs):
    assets, root, one = hf_runs
    fsdp, log = train(assets, root, "fsdp", "--activation_checkpoint.mode", "full", nproc=2)
    assert "Applied FSDP to the SpeechLM" in log and "LoRA (rank 4" in log
    assert_same_run(fsdp, one)


def test_hsdp_on_four_ranks_equals_one_process(hf_runs):
    # 2 replicas x 2 shards: the adapters are sharded within a replica and their gradients
    # averaged across replicas; the frozen base must stay out of both
    assets, root, one = hf_runs
    hsdp, log = train(assets, root, "hsdp", *HSDP, "--training.local_batch_size", "1", nproc=4)
    assert "Applied HSDP to the SpeechLM" in log, log[-3000:]
    assert_same_run(hsdp, one)


def test_compiled_layers_equal_eager(hf_runs):
    assets, root, one = hf_runs
    comp, log = train(
        assets, root, "compiled", "--compile.enable", "true", "--compile.backend", "aot_eager"
    )
    assert "Compiled each decoder layer" in log
    assert_same_run(comp, one, loss_rel=1e-4, grad_rel=1e-3, atol=1e-4)


def test_resume_from_the_checkpoint_is_exact(hf_runs):
    assets, root, one = hf_runs
    dump = root / "resumed"
    shutil.copytree(one, dump)
    shutil.rmtree(dump / "checkpoint" / "step-3")
    (dump / "metrics.jsonl").unlink()
    _, log = train(assets, root, "resumed")
    assert "Training starts at step 3" in log, log[-3000:]
    for key in ("loss_metrics/global_avg_loss", "grad_norm"):
        assert steps(dump)[3][key] == steps(one)[3][key], key
    a, b = params(one / "checkpoint" / "step-3"), params(dump / "checkpoint" / "step-3")
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_tensor_parallel_on_native_equals_one_process(tmp_path_factory):
    assets = make_tiny_run_assets(
        tmp_path_factory.mktemp("lora_tp_assets"), n_items=24, family="llama"
    )
    root = tmp_path_factory.mktemp("lora_tp")
    native = ("--model.flavor", "native")
    one, _ = train(assets, root, "one", *native)
    tp, log = train(
        assets, root, "tp", *native, "--parallelism.tensor_parallel_degree", "2", nproc=2
    )
    assert "Applied tensor + sequence parallelism" in log
    assert_same_run(tp, one)
    start = params(one / "checkpoint" / "step-2")
    end = params(tp / "checkpoint" / "step-3")
    # TP made new parameters: the frozen ones must still be frozen there
    assert torch.equal(start["backbone.norm.weight"], end["backbone.norm.weight"])
    assert torch.equal(
        start["backbone.layers.0.attention.wq.base_layer.weight"],
        end["backbone.layers.0.attention.wq.base_layer.weight"],
    )
    # the native q/k rows are permuted on the way to HF names: the adapter's B rows too
    assert_exports_agree(str(one / "checkpoint" / "step-3"), root / "exports")
