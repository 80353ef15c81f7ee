"""`torchtitan train` end to end: real processes, gloo, FSDP2, DCP checkpoints, resume."""

import pytest

from tests import forked
from tests.helpers import (
    TINY_BACKBONE,
    make_tiny_run_assets,
    read_metrics,
    run_train,
    write_tiny_config,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_tiny_run_assets(tmp_path_factory.mktemp("assets"))


def train_steps(rows):
    return {r["step"]: r for r in rows if "train/loss" in r}


def test_two_process_fsdp_trains_saves_and_resumes(assets, tmp_path):
    dump = tmp_path / "run"
    cfg = write_tiny_config(tmp_path / "c.toml", assets, dump)
    first = run_train(cfg, "--training.steps", "9", nproc=2)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "Applied FSDP to the SpeechLM" in first.stdout + first.stderr
    steps = train_steps(read_metrics(dump))
    assert sorted(steps) == list(range(1, 10))
    assert steps[9]["train/loss"] < 0.8 * steps[1]["train/loss"]
    assert (dump / "checkpoint" / "step-9").is_dir()
    val = [r for r in read_metrics(dump) if "val/asr_tiny/loss" in r]
    assert val
    for r in val:  # ASR: only stream 0 carries loss; the audio streams have no mean to log
        assert r["val/asr_tiny/ce_stream0"] > 0 and "val/asr_tiny/acc_stream0" in r
        assert not any(
            f"val/asr_tiny/{s}{k}" in r for s in ("ce_stream", "acc_stream") for k in (1, 2, 3)
        )
    assert all(f"train/ce_stream{k}" in steps[1] for k in range(4))  # TTS trains them

    second = run_train(cfg, "--training.steps", "11", nproc=2)
    log = second.stdout + second.stderr
    assert second.returncode == 0, log[-3000:]
    assert "Loading the checkpoint from" in log and "step-9" in log
    assert "Training starts at step 10" in log
    assert sorted(train_steps(read_metrics(dump))) == list(range(1, 12))


@pytest.mark.long  # make test: test_metrics_distributed's fsdp variant proves the same
def test_one_and_two_processes_give_the_same_first_steps(assets, tmp_path):
    """Same global batch (1 x 4 rows vs 2 x 2 rows): same losses and statistics (fp32)."""
    runs = {}
    for nproc, local in ((1, 4), (2, 2)):
        dump = tmp_path / f"n{nproc}"
        cfg = write_tiny_config(tmp_path / f"c{nproc}.toml", assets, dump)
        r = run_train(
            cfg,
            "--training.steps",
            "2",
            "--training.local_batch_size",
            str(local),
            "--checkpoint.enable",
            "false",
            "--validation.enable",
            "false",
            nproc=nproc,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        runs[nproc] = train_steps(read_metrics(dump))
    for step in (1, 2):
        a, b = runs[1][step], runs[2][step]
        assert a["loss_metrics/global_avg_loss"] == pytest.approx(
            b["loss_metrics/global_avg_loss"], abs=1e-5
        )
        for key in a:
            if key.startswith("train/") and not key.startswith("train/data/"):
                assert a[key] == pytest.approx(b[key], abs=1e-5), key


def test_bad_config_fails_before_any_work_naming_key_and_fix(assets, tmp_path):
    cfg = write_tiny_config(tmp_path / "c.toml", assets, tmp_path / "run")
    text = open(cfg).read().replace("pattern = ", "patern = ")
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    r = run_train(str(bad))
    assert r.returncode == 2
    assert "speechlm.patern" in r.stderr and "Did you mean `speechlm.pattern`" in r.stderr
    assert not (tmp_path / "run").exists()

    bad.write_text(open(cfg).read().replace("z_loss_weight = 1e-3", 'z_loss_weight = "big"'))
    r = run_train(str(bad))
    assert r.returncode == 2 and "speechlm.z_loss_weight" in r.stderr

    bad.write_text(open(cfg).read().replace(assets["backbone"], str(tmp_path / "missing")))
    r = run_train(str(bad))
    assert r.returncode == 2 and "missing" in r.stderr and "config.json" in r.stderr

    # a mistyped override: one line in the docs' spelling, before anything is read (not tyro's
    # box with the hyphenated form); both spellings of a real key and a bool's no_ form pass it
    r = run_train(cfg, "--training.local-batch-size", "2", "--speechlm.stepz", "3")
    assert r.returncode == 2 and "╭" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "torchtitan train: config error: unknown command-line key --speechlm.stepz: [speechlm] "
        "has no such key (`torchtitan train --help` lists our sections, `--help-all` every key)"
    )

    r = run_train(cfg, "--speechlm.stream_weights", "1", "2")
    assert r.returncode == 2 and "stream_weights" in r.stderr and "4 streams" in r.stderr

    # a seq_len no sample fits stops before any rank starts (it used to spin for ever)
    r = run_train(cfg, "--training.seq_len", "8", timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "no sample of tts:tiny fits training.seq_len = 8" in r.stderr
    assert "set training.seq_len >=" in r.stderr
    assert not (tmp_path / "run").exists()

    # no config at all: torchtitan's own default job (llama3, ./assets/tokenizer) never starts
    for argv in (["train"], ["train", "--training.steps", "3"], ["train", "--job.config_file"]):
        r = forked.torchtitan(argv, cwd=str(tmp_path))
        assert r.returncode == 2 and r.stdout == "", argv
        assert r.stderr.splitlines() == [
            "torchtitan train: config error: --job.config_file is required: a training TOML "
            "(e.g. `torchtitan train --job.config_file train_configs/speechlm_debug.toml`, the "
            "demo's; `torchtitan train --help` lists our keys, `--help-all` every key)"
        ], argv


def test_stock_torchtitan_parses_the_same_toml_and_its_trainer_is_told_what_to_run(
    assets, tmp_path
):
    """`python -m torchtitan.train --job.config_file X`: the config merges and the spec
    resolves, but torchtitan's own Trainer cannot hand the spec's builders the run (no global
    state to fall back on), so its first builder stops with the commands that run it."""
    import importlib

    from torchtitan.config import ConfigManager
    from torchtitan.protocols.train_spec import get_train_spec

    from torchtitan_speechlm.config import ConfigError

    cfg = write_tiny_config(tmp_path / "c.toml", assets, tmp_path / "run")
    job = ConfigManager().parse_args(["--job.config_file", cfg])
    assert job.model.hf_assets_path == assets["backbone"]
    importlib.import_module(job.experimental.custom_import)
    spec = get_train_spec(job.model.name)
    with pytest.raises(ConfigError, match="-m torchtitan_speechlm.train"):
        spec.build_dataloader_fn(dp_world_size=1, dp_rank=0, tokenizer=None, job_config=job)
    with pytest.raises(ConfigError, match="torchtitan train --job.config_file"):
        spec.build_loss_fn(job)


def test_each_builder_gets_the_run_its_trainer_resolved_once(assets, tmp_path, monkeypatch):
    """One resolve per trainer, handed to the spec's builders (builders.RunBuilders): the model args
    torchtitan reads, the data loader, loss, metrics and optimizers all see that run's plan and
    share its training state; a second run in the same process gets its own state; nothing is
    stored on the job config."""
    import torch
    from torchtitan.protocols.train_spec import get_train_spec

    from torchtitan_speechlm.commands.train import check_config, torchtitan_args
    from torchtitan_speechlm.trainer import plan as plan_module
    from torchtitan_speechlm.trainer.builders import RunBuilders
    from torchtitan_speechlm.trainer.run import start_run

    cfg = write_tiny_config(tmp_path / "c.toml", assets, tmp_path / "run")
    job = check_config(torchtitan_args(["--job.config_file", cfg]))
    attributes = set(vars(job))
    builds = []
    real = plan_module.RunPlan.resolve.__func__
    monkeypatch.setattr(
        plan_module.RunPlan, "resolve",
        classmethod(lambda cls, *a, **k: builds.append(a) or real(cls, *a, **k)),
    )  # fmt: skip
    run = start_run(job)
    spec = RunBuilders(run).train_spec(get_train_spec(job.model.name))
    assert len(builds) == 1
    args = spec.model_args[job.model.flavor]
    assert args is run.model_args and args.layout == run.plan.layout
    assert args.vocab == run.plan.layout.to_dict()
    args.update_from_config(job)  # torchtitan's call: nothing left to fill
    assert args is run.model_args and args.vocab == run.plan.layout.to_dict()
    loader = spec.build_dataloader_fn(dp_world_size=1, dp_rank=0, tokenizer=None, job_config=job)
    loss = spec.build_loss_fn(job)
    assert loader.on_batch.__self__ is run.state.guard
    assert loss.accumulator is run.state.stats and loss.guard is run.state.guard
    model = torch.nn.Linear(2, 2)
    optimizers = spec.build_optimizers_fn([model], job.optimizer, None)
    schedulers = spec.build_lr_schedulers_fn(optimizers, job.lr_scheduler, job.training.steps)
    assert run.state.guard.schedulers is schedulers
    assert len(builds) == 1  # the builders resolved nothing again
    other = start_run(job)
    assert other.state.stats is not run.state.stats and other.state.guard is not run.state.guard
    assert set(vars(job)) == attributes


@pytest.mark.long  # 19 s: in `make faults`, beside test_cluster.py's multi-node launches
def test_torchtitan_train_inside_torchrun_runs_as_that_rank(assets, tmp_path):
    """Multi-node is plain torchrun: `torchtitan train` sees RANK/WORLD_SIZE and just runs."""
    import os
    import shutil
    import subprocess
    import sys

    dump = tmp_path / "run"
    cfg = write_tiny_config(tmp_path / "c.toml", assets, dump)
    exe = shutil.which("torchtitan", path=os.path.dirname(sys.executable))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--no-python",
        exe,
        "train",
        "--job.config_file",
        cfg,
        "--training.steps",
        "2",
        "--checkpoint.enable",
        "false",
        "--validation.enable",
        "false",
    ]
    r = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Applied FSDP to the SpeechLM" in r.stdout + r.stderr
    assert [m["step"] for m in read_metrics(dump)] == [1, 2]

    # the README's multi-node form: booleans take true|false there too (one parser path)
    dump2 = tmp_path / "run_m"
    cfg2 = write_tiny_config(tmp_path / "c2.toml", assets, dump2)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "torchtitan_speechlm.train",
        "--job.config_file",
        cfg2,
        "--training.steps",
        "2",
        "--checkpoint.enable",
        "false",
        "--validation.enable=false",
    ]
    r = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert [m["step"] for m in read_metrics(dump2)] == [1, 2]
    assert not (dump2 / "checkpoint").exists()


def test_validation_set_smaller_than_the_ranks(assets, tmp_path):
    """One validation item on 2 ranks: rank 1 has nothing and must keep step with rank 0."""
    import json
    import os

    from torchtitan_speechlm.prepare.pipeline import prepare_dataset

    with open(os.path.join(os.path.dirname(assets["prepared"]), "manifest.jsonl")) as f:
        src = json.loads(f.readline())
    manifest = tmp_path / "one.jsonl"
    manifest.write_text(json.dumps(src) + "\n")
    one = tmp_path / "one"
    prepare_dataset(str(manifest), assets["codec"], assets["tokenizer"], str(one), progress=False)
    dump = tmp_path / "run"
    cfg = write_tiny_config(tmp_path / "c.toml", assets, dump)
    text = open(cfg).read().replace('datasets = ["tiny=', f'datasets = ["one={one}", "tiny=')
    text = text.replace('valid = ["asr:tiny"]', 'valid = ["asr:one"]')
    open(cfg, "w").write(text)
    r = run_train(
        cfg,
        "--training.steps",
        "2",
        "--validation.freq",
        "2",
        "--checkpoint.enable",
        "false",
        nproc=2,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    val = [m for m in read_metrics(dump) if "val/asr_one/loss" in m]
    assert [m["step"] for m in val] == [1, 2]  # torchtitan validates at step 1 and every freq
    assert all(m["val/asr_one/data/examples"] == 1.0 for m in val)


def test_moe_backbone_trains_under_fsdp_with_load_balance_loss(assets, tmp_path):
    from transformers import AutoTokenizer

    from torchtitan_speechlm.demo.assets import build_backbone

    vocab = len(AutoTokenizer.from_pretrained(assets["tokenizer"]))
    moe = build_backbone(
        str(tmp_path / "moe"), family="qwen3_moe", vocab_size=vocab, **TINY_BACKBONE
    )
    dump = tmp_path / "run"
    cfg = write_tiny_config(tmp_path / "c.toml", dict(assets, backbone=moe), dump)
    r = run_train(
        cfg,
        "--training.steps",
        "2",
        "--speechlm.load_balance_weight",
        "0.01",
        "--checkpoint.enable",
        "false",
        "--validation.enable",
        "false",
        nproc=2,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    for m in read_metrics(dump):
        # Switch aux loss E * sum_e f_e P_e is ~top_k (2) for a near-uniform router at init
        assert 1.5 < m["train/router_aux_loss"] < 3.0
        # our statistics' loss (sums reduced by components/stats.py) against the loss torchtitan
        # itself reduced from the backpropagated sum: the load balance term is in both
        assert m["train/loss"] == pytest.approx(m["loss_metrics/global_avg_loss"], rel=1e-5)
        assert m["train/load_balance_loss"] > 0.005  # 0.01 x aux, inside that loss


def test_extending_a_run_whose_last_save_is_weights_only(assets, tmp_path):
    """last_save_model_only = true (torchtitan's default): the rerun with more steps resumes
    from the newest *full* checkpoint, retraining the same steps identically; a folder with
    only weights-only checkpoints is refused with the fix, never a DCP traceback."""
    dump = tmp_path / "run"
    cfg = write_tiny_config(tmp_path / "c.toml", assets, dump)
    common = (
        "--validation.enable",
        "false",
        "--checkpoint.last_save_model_only",
        "true",
        "--checkpoint.interval",
        "2",
        "--lr_scheduler.total_steps",
        "6",
    )
    first = run_train(cfg, "--training.steps", "4", *common)
    assert first.returncode == 0, first.stderr[-3000:]
    losses = {m["step"]: m["loss_metrics/global_avg_loss"] for m in read_metrics(dump)}
    second = run_train(cfg, "--training.steps", "6", *common)
    log = second.stdout + second.stderr
    assert second.returncode == 0, log[-3000:]
    assert "step-4 holds model weights only" in log and "resuming from step-2" in log
    assert "Training starts at step 3" in log and "Traceback" not in log
    rerun = [m for m in read_metrics(dump)][len(losses) :]
    assert [m["step"] for m in rerun] == [3, 4, 5, 6]
    for m in rerun[:2]:  # steps 3-4 again, from the step-2 state: the same numbers
        assert m["loss_metrics/global_avg_loss"] == pytest.approx(losses[m["step"]], rel=1e-6)

    only = tmp_path / "only_weights"
    cfg2 = write_tiny_config(tmp_path / "c2.toml", assets, only)
    r = run_train(cfg2, "--training.steps", "2", *common[:4], "--checkpoint.interval", "10")
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_train(cfg2, "--training.steps", "4", *common[:4], "--checkpoint.interval", "10")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "only weights-only checkpoints" in r.stderr and "initial_load_path" in r.stderr


def test_rerunning_a_finished_run_says_so(assets, tmp_path):
    dump = tmp_path / "run"
    cfg = write_tiny_config(tmp_path / "c.toml", assets, dump)
    args = ("--training.steps", "2", "--validation.enable", "false")
    assert run_train(cfg, *args).returncode == 0
    r = run_train(cfg, *args)
    assert r.returncode == 0
    assert "already complete" in r.stderr and "step-2" in r.stderr
    assert "raise --training.steps" in r.stderr and f"delete {dump}" in r.stderr
    assert "Training starts" not in r.stdout + r.stderr


@pytest.mark.faults  # 13 s: kept out of make test's 15 minutes
def test_a_save_request_stops_every_rank_after_a_saved_step_and_the_rerun_continues(
    assets, tmp_path
):
    """{dump_folder}/SAVE_AND_STOP (what the SLURM script writes on preemption): both ranks
    stop after the same step, that step is checkpointed although it is off the save interval,
    the run ends with status 0; the rerun removes the request, continues from that step and
    trains exactly what an uninterrupted run trains."""
    import threading
    import time

    flags = ("--training.steps", "30", "--checkpoint.interval", "1000",
             "--validation.enable", "false", "--metrics.log_freq", "1")  # fmt: skip
    ref = tmp_path / "ref"
    assert (
        run_train(write_tiny_config(tmp_path / "r.toml", assets, ref), *flags, nproc=2).returncode
        == 0
    )
    dump = tmp_path / "run"
    cfg = write_tiny_config(tmp_path / "c.toml", assets, dump)
    result = {}
    worker = threading.Thread(target=lambda: result.update(r=run_train(cfg, *flags, nproc=2)))
    worker.start()
    deadline = time.monotonic() + 240
    while not ((dump / "metrics.jsonl").exists() and len(read_metrics(dump)) >= 2):
        assert worker.is_alive() and time.monotonic() < deadline
        time.sleep(0.05)
    (dump / "SAVE_AND_STOP").touch()
    worker.join(timeout=240)
    r = result["r"]
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [m["step"] for m in read_metrics(dump)]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) < 30
    assert f"step {steps[-1]} is saved" in r.stdout + r.stderr
    assert (dump / "checkpoint" / f"step-{steps[-1]}").is_dir()
    rerun = run_train(cfg, *flags, nproc=2)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert not (dump / "SAVE_AND_STOP").exists()
    keys = ("step", "loss_metrics/global_avg_loss", "grad_norm")
    assert [[m[k] for k in keys] for m in read_metrics(dump)] == [
        [m[k] for k in keys] for m in read_metrics(ref)
    ]
