"""Pipeline parallelism through torchtitan's schedules (distributed/pipeline.py), end to end on
gloo: 1F1B and Interleaved1F1B on 2 processes, and PP x FSDP, PP x TP on 4, equal one process
after 3 steps in loss, grad norm, every logged statistic and every parameter, at the same global
batch, on packed rows of a varied corpus (espeak-ng speech of 0.4-6 s, Kaldi segments, a 4-layer
Llama, gradient accumulation); a pipeline checkpoint continues on one process and on FSDP, and
a one-process checkpoint on a pipeline; export reads a pipeline checkpoint. What a pipeline
cannot run is refused before any rank starts, naming the key."""

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
    "--model.flavor", "native", "--validation.enable", "false",
    "--training.steps", str(STEPS), "--training.local_batch_size", "4",
    "--training.global_batch_size", "8", "--training.seq_len", "256",
    "--checkpoint.interval", "1", "--lr_scheduler.total_steps", str(STEPS),
)  # fmt: skip
PP = ("--parallelism.pipeline_parallel_degree", "2")
MICRO = ("--parallelism.pipeline_parallel_microbatch_size", "2")
PATTERNS = {  # flatten: a frame is N positions, so rows are N times longer
    p: ("--speechlm.pattern", p, *(("--training.seq_len", "1280") if p == "flatten" else ()))
    for p in ("delay", "parallel", "flatten")
}
LAYOUTS = {  # name: (processes, flags)
    "one": (1, ()),
    "fsdp": (2, ("--parallelism.data_parallel_shard_degree", "2")),
    "pp_1f1b": (2, (*PP, *MICRO)),
    "pp_interleaved": (
        2,
        (
            *PP,
            "--parallelism.pipeline_parallel_microbatch_size",
            "1",
            "--parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B",
        ),
    ),  # fmt: skip
    "pp_fsdp": (4, (*PP, *MICRO, "--parallelism.data_parallel_shard_degree", "2")),
    "pp_tp": (4, (*PP, *MICRO, "--parallelism.tensor_parallel_degree", "2")),
    "pp_ac": (2, (*PP, *MICRO, "--activation_checkpoint.mode", "selective")),
}
# what one process and a pipeline must log alike (time, memory and throughput differ)
COMPARED = ("loss_metrics/global_avg_loss", "grad_norm", "train/")  # max: per data rank


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_varied_kaldi_assets(tmp_path_factory.mktemp("pp_assets"), n_utts=28, num_layers=4)


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory):
    """Each layout's dump folder, trained on demand (the long layouts only when selected)."""
    root, done = tmp_path_factory.mktemp("pp"), {}

    def get(name: str, pattern: str = "delay"):
        if (name, pattern) not in done:
            nproc, flags = LAYOUTS[name]
            dump = root / f"{name}_{pattern}"
            cfg = write_tiny_config(root / f"{name}_{pattern}.toml", assets, dump)
            r = run_train(cfg, *COMMON, *flags, *PATTERNS[pattern], nproc=nproc, timeout=600)
            log = r.stdout + r.stderr
            assert r.returncode == 0, log[-4000:]
            assert ("runs stage" in log) == ("pp" in name), log[-4000:]  # no silent fallback
            done[name, pattern] = dump
        return done[name, pattern]

    return get


def logged(dump) -> dict[int, dict]:
    return {
        m["step"]: {k: v for k, v in m.items() if k.startswith(COMPARED)}
        for m in read_metrics(dump)
    }


def assert_same_training(ref_dump, got_dump, step=STEPS):
    ref, got = logged(ref_dump), logged(got_dump)
    assert sorted(ref) == sorted(got) == list(range(1, STEPS + 1))
    for s in ref:
        assert set(got[s]) == set(ref[s]), (s, set(got[s]) ^ set(ref[s]))
        for key, value in ref[s].items():
            assert got[s][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (s, key)
    a, b = (
        params(ref_dump / "checkpoint" / f"step-{step}"),
        params(got_dump / "checkpoint" / f"step-{step}"),
    )
    assert set(a) == set(b) and "backbone.layers.3.attention.wq.weight" in a
    for key in a:
        assert_adam_close(b[key], a[key], key)


def assert_adam_close(got: torch.Tensor, ref: torch.Tensor, key: str) -> None:
    """Parameters after the same Adam steps: every element within 2e-5 (+1e-5 relative), save
    a few in 10^4 within 1% of the learning rate (1e-2). Adam divides each element's gradient
    by its running RMS, so an element whose gradient is near Adam's eps (a row of a token seen
    once: embeddings, output) turns a 1e-12 difference of summation order into a difference of
    a fraction of one step's update; the losses, gradient norms and statistics above are
    compared at 1e-5 relative every step."""
    diff = (got - ref).abs()
    beyond = int((diff > 2e-5 + 1e-5 * ref.abs()).sum())
    assert float(diff.max()) <= 1e-4, (key, float(diff.max()))
    assert beyond <= max(1, got.numel() // 5000), (key, beyond, got.numel())


@pytest.mark.parametrize(
    "name, pattern",
    [(n, "delay") for n in LAYOUTS if n.startswith("pp")]
    + [("pp_1f1b", "parallel"), ("pp_1f1b", "flatten")],
)
def test_a_pipeline_trains_as_one_process(runs, name, pattern):
    assert_same_training(runs("one", pattern), runs(name, pattern))
    ref = logged(runs("one", pattern))
    assert ref[3]["loss_metrics/global_avg_loss"] != ref[1]["loss_metrics/global_avg_loss"]
    assert ref[1]["train/loss_frames"] > 0 and "train/acc_stream0" in ref[1]


def resume(assets, tmp_path, source, nproc, flags):
    """Continue ``source``'s step-2 checkpoint to step 3 with another layout."""
    dump = tmp_path / "resumed"
    shutil.copytree(source, dump)
    shutil.rmtree(dump / "checkpoint" / f"step-{STEPS}")
    (dump / "metrics.jsonl").unlink()
    r = run_train(
        write_tiny_config(tmp_path / "r.toml", assets, dump), *COMMON, *flags, nproc=nproc
    )
    log = r.stdout + r.stderr
    assert r.returncode == 0 and f"Training starts at step {STEPS}" in log, log[-3000:]
    return dump


@pytest.mark.parametrize(
    "source, target",
    [
        ("pp_1f1b", "one"),
        ("one", "pp_interleaved"),
        ("pp_1f1b", "fsdp"),
        ("fsdp", "pp_1f1b"),
    ],
)
def test_a_checkpoint_continues_across_pipeline_layouts(assets, runs, tmp_path, source, target):
    nproc, flags = LAYOUTS[target]
    dump = resume(assets, tmp_path, runs(source), nproc, flags)
    a, b = (
        params(runs("one") / "checkpoint" / f"step-{STEPS}"),
        params(dump / "checkpoint" / f"step-{STEPS}"),
    )
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=2e-5, rtol=1e-5, msg=key)
    ref, got = logged(runs("one"))[STEPS], logged(dump)[STEPS]
    assert got["loss_metrics/global_avg_loss"] == pytest.approx(
        ref["loss_metrics/global_avg_loss"], rel=1e-5
    )


def test_export_generate_and_eval_read_a_pipeline_checkpoint(runs, tmp_path):
    """export writes the same model from a pipeline checkpoint as from a one-process one, and
    the loader of generate and eval reads the pipeline's step folder as it is."""
    from tests import forked
    from torchtitan_speechlm.generation.loading import load_model
    from torchtitan_speechlm.model.model import SpeechLM

    out = {}
    for name in ("one", "pp_1f1b"):
        out[name] = tmp_path / name
        r = forked.torchtitan(
            [
                "export",
                "--checkpoint",
                str(runs(name) / "checkpoint" / f"step-{STEPS}"),
                "--out-dir",
                str(out[name]),
            ]  # fmt: skip
        )
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    a, b = SpeechLM.from_pretrained(str(out["one"])), SpeechLM.from_pretrained(str(out["pp_1f1b"]))
    step = load_model(str(runs("pp_1f1b") / "checkpoint" / f"step-{STEPS}")).model
    sa, sb, sc = a.state_dict(), b.state_dict(), step.state_dict()
    for key in sa:
        torch.testing.assert_close(sb[key], sa[key], atol=2e-5, rtol=1e-5, msg=key)
        torch.testing.assert_close(sc[key], sb[key], atol=0, rtol=0, msg=key)


REFUSED = [  # (flags, words the one-line error must hold); stage layouts: tests/unit/distributed
    (("--model.flavor", "hf"), 'model.flavor = "native"'),
    (("--speechlm.tie_embeddings", "true"), 'speechlm.tie_embeddings = "false"'),
    (("--speechlm_data.batching", "bucket"), 'speechlm_data.batching = "pack"'),
    (("--validation.enable", "true"), "validation.enable = false"),
    (("--parallelism.pipeline_parallel_microbatch_size", "3"), "must divide"),
    (("--parallelism.pipeline_parallel_microbatch_size", "4"), "at least as many microbatches"),
    (("--parallelism.data_parallel_replicate_degree", "2"), "data_parallel_shard_degree"),
    (("--parallelism.pipeline_parallel_schedule", "Bogus"), "pipeline_parallel_schedule = 'Bogus'"),
]  # fmt: skip


@pytest.mark.parametrize("flags, words", REFUSED, ids=[w for _, w in REFUSED])
def test_what_a_pipeline_cannot_run_is_refused_before_any_rank_starts(
    assets, tmp_path, flags, words
):
    cfg = write_tiny_config(tmp_path / "c.toml", assets, tmp_path / "run")
    r = run_train(cfg, *COMMON, *PP, *flags, nproc=4 if "replicate" in flags[0] else 2)
    assert r.returncode == 2, (r.stdout + r.stderr)[-3000:]
    assert words in r.stderr and "config error" in r.stderr, r.stderr[-2000:]
    assert "pipeline_parallel" in r.stderr and not (tmp_path / "run" / "checkpoint").exists()
