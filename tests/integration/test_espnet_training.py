"""ESPnet's ``bin/train.py`` with only the trainer import changed (tests/espnet_side/
train_main.py): ESPnet's real ``DataIteratorFactory``, its job template, ``build_model()`` as the
model, audio tokenised in the step by the io's ``encode_batch``; trained on 1 and 2 processes
(gloo) and resumed bit for bit; an ESPnet checkpoint continued (weights, Adam state, step, LR,
data position, checked against ESPnet's tensors by rule); a bad one refused before training."""

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from tests import forked
from tests.espnet_side.assets import job_config, prepare_stats, specifiers
from tests.helpers import aborted_in_torch_teardown, read_metrics

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAIN = os.path.join(ROOT, "tests", "espnet_side", "train_main.py")
# the straight run of one 2-rank case is started through torch's own launcher (torchrun), as an
# ESPnet user starts it; its stopped and resumed runs, and the other 2-rank cases, fork their
# ranks from the test process (tests/forked.py: real ranks on a real gloo group, without three
# processes importing torch, ESPnet and torchtitan again), so that case also proves that a run
# torchrun started and one the forked ranks stopped and resumed log the same numbers
TORCHRUN_TASKS = "tts+asr"
# ESPnet's bucket batches come in order of length within an epoch (its factory shuffles each
# build_iter chunk only), so a 4-step run of the three tasks trains text_only batches only:
# "tts+asr" is the mixture make test trains, "mixture" (with text) runs in make faults
TASKS = {
    "tts": ("text_to_audio",),
    "asr": ("audio_to_text",),
    "tts+asr": ("text_to_audio", "audio_to_text"),
    "mixture": ("text_to_audio", "audio_to_text", "text_only"),
}
ESPNET_TASKS = {"text_to_audio": "tts", "audio_to_text": "asr", "text_only": "text"}


def trainer_args(max_step: int) -> dict:
    """ESPnet's trainer section: the LR schedule's end fixed, so a shorter run is a prefix."""
    return {
        "max_step": max_step,
        "save_interval": 2,
        "log_interval": 1,
        "titan_config": {
            "mixed_precision_param": "float32",
            "optimizer": {"lr": 1e-2},
            "lr_scheduler": {"warmup_steps": 2, "decay_end_step": 4},
        },
        "speechlm": {"z_loss_weight": 1e-3},
    }


def env() -> dict:
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))  # fmt: skip


def train(assets, tmp_path, out, tasks, max_step, nproc=1, resume_path=None, check=True,
          torchrun=False):  # fmt: skip
    """``bin/train.py`` as an ESPnet user runs it (``torchrun``: its ranks started by torch's
    launcher, else forked from this process)."""
    config = job_config(assets)
    config["trainer"] = trainer_args(max_step)
    conf = tmp_path / f"conf_{'_'.join(tasks)}.yaml"
    conf.write_text(yaml.safe_dump(config))
    stats = tmp_path / "stats"
    specs = specifiers(assets, tasks)
    prepare_stats(dict(assets, stats=str(stats)), config, specs)
    argv = ["--train-config", str(conf), "--output-dir", str(out),
            "--train-unregistered-specifier", specs, "--stats-dir", str(stats),
            "--valid-unregistered-specifier", specifiers(assets, tasks[:1], "dev")]  # fmt: skip
    prepare_stats(dict(assets, stats=str(stats)), config, specifiers(assets, tasks[:1], "dev"))
    if resume_path:
        argv += ["--resume_path", str(resume_path)]
    if nproc == 1:  # the script in a fork of this process (tests/forked.py: no imports again)
        r = forked.python_script(MAIN, argv, cwd=ROOT, timeout=600)
    elif not torchrun:  # its ranks forked from this process (tests/forked.py)
        r = forked.python_script_ranks(MAIN, argv, nproc, cwd=ROOT, timeout=600)
    else:  # torch's launcher, as an ESPnet user starts it
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", MAIN, *argv]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env(), cwd=ROOT)
    last = out / "checkpoint" / f"step-{max_step}"
    if check and not (nproc > 1 and aborted_in_torch_teardown(r.stderr, last)):
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r  # (a completed 2-rank run that torch's gloo teardown aborted: tests/helpers.py)


def steps_of(out) -> dict[int, dict]:
    """Per step: the loss and every train/ statistic (timings and throughput aside)."""
    steps: dict[int, dict] = {}
    for row in read_metrics(out):
        keys = {k: v for k, v in row.items() if k.startswith(("train/", "loss_metrics/", "lr"))}
        keys.pop("train/data/skipped_too_long", None)
        if keys and "train/loss" in keys:
            steps.setdefault(row["step"], {}).update(keys)
    return steps


def espnet_batches(assets, tmp_path, tasks, steps: int, chunk: int = 2) -> list[dict]:
    """The batches ESPnet's trainer would take for ``steps`` steps on one rank (its
    ``build_iter(global_step, save_interval)`` chunks), from a factory built as train_main's."""
    from espnet2.speechlm.dataloader.iterator import DataIteratorFactory

    from tests.espnet_side.job import SpeechLMJobTemplate

    config = job_config(assets)
    f = DataIteratorFactory(specifiers(assets, tasks), "", stats_dir=str(tmp_path / "stats"),
                            collate_fn=SpeechLMJobTemplate(config).build_preprocessor().collate_fn,
                            batch_size=config["data_loading"]["batch_size"], num_workers=0,
                            shuffle=True, seed=config["data_loading"]["seed"])  # fmt: skip
    return [b for start in range(0, steps, chunk) for b in f.build_iter(start, chunk)][:steps]


def espnet_lr(step: int, peak: float = 1e-2, warmup: int = 2, end: int = 4) -> float:
    """ESPnet's LambdaLR (trainer/titan_trainer.py): linear from 0, cosine to 0 at ``end``."""
    import math

    if step < warmup:
        return peak * step / warmup
    if step < end:
        return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (end - warmup)))
    return 0.0


@pytest.mark.parametrize(
    "tasks,nproc",
    [
        # make test trains through ESPnet's factory in the checkpoint test below (a train()
        # chunk); the straight/resumed runs (25 s and more each) run in make faults
        pytest.param("tts+asr", 1, marks=pytest.mark.long),
        pytest.param("mixture", 1, marks=pytest.mark.long),
        pytest.param("tts", 1, marks=pytest.mark.long),
        pytest.param("asr", 1, marks=pytest.mark.long),
        pytest.param("tts+asr", 2, marks=pytest.mark.long),
        pytest.param("tts", 2, marks=pytest.mark.long),
        pytest.param("asr", 2, marks=pytest.mark.long),
    ],
)
def test_espnets_train_script_trains_and_resumes_bit_for_bit(espnet_assets, tmp_path, tasks, nproc):
    """4 steps straight; then 3 steps and a rerun to 4 in another folder (resume_path None: the
    newest checkpoint, step 3, in the middle of the second build_iter chunk): the same fp32
    statistics at every step. The LR is ESPnet's schedule (0 at the first step), ESPnet's keys
    are logged, validation runs (val/SPEC/...), the task counters count ESPnet's tasks."""
    names = TASKS[tasks]
    straight = tmp_path / "straight"
    log = train(espnet_assets, tmp_path, straight, names, 4, nproc,
                torchrun=nproc > 1 and tasks == TORCHRUN_TASKS)  # fmt: skip
    log = log.stdout + log.stderr  # the console says what the batches are, not seq_len's
    assert "ESPnet data: DataIteratorFactory batches as ESPnet's batchfy made them" in log
    assert "Trainer is initialized with the batches of the Python data object" in log
    assert "local batch size" not in log
    a = steps_of(straight)
    assert sorted(a) == [1, 2, 3, 4]
    assert [a[s]["train/lr"] for s in a] == pytest.approx([espnet_lr(s - 1) for s in a])
    assert all(a[s]["train/lr"] == a[s]["lr"] for s in a)
    assert all("train/grad_norm" in a[s] for s in a)
    rows = read_metrics(straight)
    assert any("time/iter" in r and "time/step_codec_s" in r for r in rows) == (tasks != "text")
    val = [k for r in rows for k in r if k.startswith("val/")]
    assert any(k.endswith("/loss") and "dev" in k for k in val)
    if nproc == 1:  # the counters count the tasks of each step's batch, by ESPnet's keys
        for s, batch in enumerate(espnet_batches(espnet_assets, tmp_path, names, 4), start=1):
            for espnet_task, ours in ESPNET_TASKS.items():
                want = sum(k[0] == espnet_task for k in batch["key"])
                assert a[s][f"train/data/task_{ours}"] == want, (s, ours)

    resumed = tmp_path / "resumed"
    train(espnet_assets, tmp_path, resumed, names, 3, nproc)
    assert sorted(os.listdir(resumed / "checkpoint")) == ["step-2", "step-3"]
    train(espnet_assets, tmp_path, resumed, names, 4, nproc)
    assert steps_of(resumed) == a

    # the backbone saved from ESPnet's model object is the pretrained text LM it was built from
    from safetensors.torch import load_file

    saved = load_file(str(straight / "backbone" / "model.safetensors"))
    original = load_file(os.path.join(espnet_assets["backbone"], "model.safetensors"))
    assert saved.keys() == original.keys()
    assert all(torch.equal(saved[k].float(), original[k].float()) for k in saved)


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.long)])
def test_an_espnet_checkpoint_continues_here(espnet_assets, tmp_path, nproc):
    """ESPnet's checkpoints/step_3 as resume_path, on 1 and 2 ranks (FSDP shards): each of
    our parameters and both Adam moments equal ESPnet's at the ids mapped by rule (ours
    without an ESPnet id: a fresh Adam state), the Adam step and the trainer's step are 3, the
    LR is ESPnet's schedule at 3, and training goes on from ESPnet's next chunk
    (build_iter(global_step=3))."""
    config = job_config(espnet_assets)
    stats = tmp_path / "stats"
    specs = specifiers(espnet_assets, TASKS["tts+asr"])
    prepare_stats(dict(espnet_assets, stats=str(stats)), config, specs)
    args = trainer_args(6)
    args["titan_config"]["optimizer"]["lr"] = 1e-3  # ESPnet's run's peak (model.py)
    args["titan_config"]["lr_scheduler"] = {"warmup_steps": 2, "decay_end_step": 10}
    spec = {"assets": espnet_assets, "out": str(tmp_path), "stats": str(stats), "specs": specs,
            "trainer_args": args, "espnet_steps": 3, "espnet_total": 10}  # fmt: skip
    check = os.path.join(ROOT, "tests", "espnet_side", "continue_check.py")
    r = forked.python_script(check, [json.dumps(spec), "make"], cwd=ROOT, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    if nproc == 1:
        r = forked.python_script(check, [json.dumps(spec), "continue"], cwd=ROOT, timeout=300)
    else:  # its ranks forked from this process (tests/forked.py), as torchrun would start them
        r = forked.python_script_ranks(check, [json.dumps(spec), "continue"], nproc, cwd=ROOT,
                                       timeout=600)  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert len(report["params"]) == 26
    for key in ("params", "exp_avg", "exp_avg_sq"):
        assert max(report[key].values()) == 0.0, (key, report[key])
    assert report["unmapped_moments"] == 0.0
    assert all(ours == theirs == 3.0 for ours, theirs in report["adam_step"].values())
    assert report["step"] == 3 and report["lr"] == pytest.approx(report["espnet_lr"], rel=1e-12)
    assert report["build_iter_calls"] == [[3, 2]] and report["step_after_train"] == 5


def test_an_espnet_checkpoint_of_another_model_is_refused_before_training(espnet_assets, tmp_path):
    """A checkpoint of a job that kept 3 codebooks (another vocabulary): bin/train.py ends with
    the one line naming the sizes and the weights-only alternative, and nothing is trained."""
    from tests.espnet_side.job import SpeechLMJobTemplate
    from tests.espnet_side.model import save_espnet_checkpoint, train_some_steps

    other = job_config(espnet_assets, audio_kwargs={"codec_max_token_per_frame": 3})
    model = SpeechLMJobTemplate(other).build_model()
    ckpt = save_espnet_checkpoint(model, *train_some_steps(model, 1), 1, str(tmp_path / "old"))
    out = tmp_path / "run"
    r = train(espnet_assets, tmp_path, out, TASKS["tts"], 4, resume_path=ckpt, check=False)
    assert r.returncode != 0
    last = [line for line in r.stderr.strip().splitlines() if line.strip()][-1]
    assert "vocabulary of 710 ids" in last and "bin/export_checkpoint.py" in last, last
    assert not (out / "checkpoint").exists() and not (out / "metrics.jsonl").exists()
