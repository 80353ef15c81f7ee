"""The Python API (``TitanTrainer``, ESPnet's interface): the same run as ``torchtitan train``
with the TOML it writes, on 1 and 2 processes; chunks, validation and resume; ESPnet's iterator
factories; the caller's wandb run. Real processes (gloo), tiny models, fp32."""

import glob
import json
import os

import pytest

from tests import forked
from tests.helpers import make_tiny_run_assets, read_metrics, run_train

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "python_api_script.py")
VALID = {"dev": "asr:tiny", "tts_dev": "tts:tiny"}


def trainer_args(**overrides) -> dict:
    args = {
        "max_step": 4,
        "save_interval": 2,
        "log_interval": 1,
        "titan_config": {
            "mixed_precision_param": "float32",
            "optimizer": {"lr": 1e-2},
            "lr_scheduler": {"warmup_steps": 2},
        },
        "training": {"local_batch_size": 2, "seq_len": 160},
        "speechlm": {"z_loss_weight": 1e-3},
        "validation": {"local_batch_size": 2, "seq_len": 160},
        "metrics": {"enable_wandb": False},
    }
    args.update(overrides)
    return args


def run_script(spec: dict, nproc: int = 1, timeout: int = 300):
    """``python tests/python_api_script.py SPEC`` (``torchrun --nproc-per-node 2`` for 2), as
    a fork of this process (tests/forked.py: real processes on a real gloo group, without
    importing torch, torchtitan and transformers again)."""
    env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    if nproc == 1:
        r = forked.python_script(SCRIPT, [json.dumps(spec)], ROOT, timeout, env)
    else:
        r = forked.python_script_ranks(SCRIPT, [json.dumps(spec)], nproc, ROOT, timeout, env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r


def by_step(rows: list[dict], prefix: str) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for r in rows:
        keys = {k: v for k, v in r.items() if k.startswith(prefix)}
        if keys:
            out.setdefault(r["step"], {}).update(keys)
    return out


def training(rows: list[dict]) -> dict[int, dict]:
    """Per step: torchtitan's loss and every speech statistic (not timings or throughput)."""
    steps = by_step(rows, "train/")
    for step, loss in by_step(rows, "loss_metrics/").items():
        steps[step].update(loss)
    for values in steps.values():
        values.pop("train/data/skipped_too_long", None)
    return steps


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_tiny_run_assets(tmp_path_factory.mktemp("assets"))


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory):
    """``TitanTrainer(...).run()`` in one process, with a transformers model object."""
    out = tmp_path_factory.mktemp("api") / "run"
    spec = dict(assets=assets, output_dir=str(out), trainer_args=trainer_args(),
                actions=["run"], model_object=True, valid=VALID)  # fmt: skip
    run_script(spec)
    return out


# 2 processes: make faults (make test proves 2-process training equal elsewhere)
@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.long)])
def test_run_equals_torchtitan_train_with_the_written_toml(assets, reference, tmp_path, nproc):
    import tomllib

    if nproc == 1:
        api = reference
    else:
        api = tmp_path / "api"
        spec = dict(assets=assets, output_dir=str(api), trainer_args=trainer_args(),
                    actions=["run"], model_object=True, valid=VALID,
                    parallel_dims=True)  # the caller's ParallelDims is used  # fmt: skip
        log = run_script(spec, nproc=2)
        assert "Applied FSDP to the SpeechLM" in log.stdout + log.stderr
    toml = api / "titan_trainer.toml"
    config = tomllib.loads(toml.read_text())
    assert config["model"]["hf_assets_path"] == str(api / "backbone")
    assert (api / "backbone" / "config.json").is_file()  # the model object, saved once
    assert config["speechlm_data"]["valid"] == ["dev=asr:tiny", "tts_dev=tts:tiny"]
    assert config["lr_scheduler"]["decay_type"] == "cosine"

    cli = tmp_path / "cli"
    r = run_train(str(toml), "--job.dump_folder", str(cli), nproc=nproc)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = read_metrics(api), read_metrics(cli)
    assert sorted(training(a)) == [1, 2, 3, 4]
    assert training(a) == training(b)  # identical, fp32
    val_a, val_b = by_step(a, "val/"), by_step(b, "val/")
    assert sorted(val_a) == [1, 2, 4] and val_a == val_b
    assert sorted(os.listdir(api / "checkpoint")) == ["step-2", "step-4"]


@pytest.mark.long  # 28 s: kept out of make test's 15 minutes
def test_train_chunks_save_valid_and_resume(assets, reference, tmp_path):
    ref = training(read_metrics(reference))
    out = tmp_path / "run"
    spec = dict(assets=assets, output_dir=str(out), trainer_args=trainer_args(),
                actions=["train", "valid"], valid=VALID)  # fmt: skip
    run_script(spec)
    assert json.loads((out / "actions.json").read_text()) == [["train", 2], ["valid", 2]]
    assert sorted(os.listdir(out / "checkpoint")) == ["step-2"]  # train() saved its chunk
    rows = read_metrics(out)
    assert training(rows) == {s: ref[s] for s in (1, 2)}
    val = by_step(rows, "val/")
    assert sorted(val) == [2]  # only valid(): train() does not validate
    for name in VALID:
        for key in ("loss", "ce_loss", "z_loss", "acc_layer0"):
            assert f"val/{name}/{key}" in val[2]
    assert val[2] == {k: v for k, v in by_step(read_metrics(reference), "val/")[2].items()}

    # a new TitanTrainer on the same output_dir continues from its newest checkpoint; a
    # checkpoint section given with ESPnet's keys wins over save_interval, chunks included
    run_script(dict(spec, actions=["train", "train"],
                    trainer_args=trainer_args(checkpoint={"interval": 1})))  # fmt: skip
    assert json.loads((out / "actions.json").read_text()) == [["train", 3], ["train", 4]]
    assert training(read_metrics(out)) == ref

    # resume_path: another run's checkpoint, continued in a fresh output_dir
    other = tmp_path / "other"
    run_script(dict(spec, output_dir=str(other), actions=["train"],
                    resume_path=str(out / "checkpoint" / "step-2")))  # fmt: skip
    assert training(read_metrics(other)) == {s: ref[s] for s in (3, 4)}
    assert sorted(os.listdir(other / "checkpoint")) == ["step-4"]


@pytest.mark.long  # 25 s: kept out of make test's 15 minutes
def test_espnet_factory_trains_logs_into_the_callers_wandb_run_and_resumes(espnet_assets, tmp_path):
    """``train()`` / ``valid()`` / ``train()`` over ESPnet's real factory (its chunks asked with
    ESPnet's ``build_iter`` arguments), logged into the caller's wandb run; a new trainer on
    the same output_dir continues at the data position."""
    from tests.espnet_side.assets import job_config, prepare_stats, specifiers
    from torchtitan_speechlm.commands.wandb_offline import read_history

    specs = specifiers(espnet_assets)
    valid = specifiers(espnet_assets, ("audio_to_text",), "dev")
    stats = dict(espnet_assets, stats=str(tmp_path / "stats"))
    for s in (specs, valid):
        prepare_stats(stats, job_config(espnet_assets), s)
    out = tmp_path / "run"
    args = trainer_args(metrics={"log_freq": 1})  # wandb on: the caller's run is used
    for key in ("training", "validation"):
        args.pop(key)
    espnet = {"assets": espnet_assets, "stats": stats["stats"], "specs": specs, "valid": valid}
    spec = dict(assets={}, output_dir=str(out), trainer_args=args,
                actions=["train", "valid", "train"], espnet=espnet,
                wandb=str(tmp_path / "wandb"))  # fmt: skip
    run_script(spec)
    calls = [json.loads(line) for line in open(out / "build_iter_rank0.jsonl")]
    assert calls == [{"global_step": 0, "length": 2}, {"global_step": 2, "length": 2}]
    rows = read_metrics(out)
    steps = training(rows)
    assert sorted(steps) == [1, 2, 3, 4]
    assert sum(s["train/data/task_tts"] + s["train/data/task_asr"] for s in steps.values()) > 0
    assert "val/dev/loss" in by_step(rows, "val/")[2]
    assert not glob.glob(str(out / "tb" / "*" / "wandb"))  # no second wandb run
    (run,) = glob.glob(str(tmp_path / "wandb" / "wandb" / "offline-run-*"))
    history = {h["_step"]: h for h in read_history(run) if "train/loss" in h}
    assert {s: history[s]["train/loss"] for s in steps} == {
        s: v["train/loss"] for s, v in steps.items()
    }

    run_script(dict(spec, actions=["train"], wandb=None,
                    trainer_args=dict(args, max_step=6)))  # fmt: skip
    calls = [json.loads(line) for line in open(out / "build_iter_rank0.jsonl")]
    assert calls[-1] == {"global_step": 4, "length": 2}  # the data position came back
    assert sorted(training(read_metrics(out))) == [1, 2, 3, 4, 5, 6]


# ---------------------------------------------------------------------------------------------
# In-process checks: the mapping and the batch conversion
# ---------------------------------------------------------------------------------------------
def test_trainer_args_mapping_and_errors(tmp_path):
    from torchtitan_speechlm.config import ConfigError
    from torchtitan_speechlm.python_api.args import trainer_args_to_sections

    def sections(**kw):
        return trainer_args_to_sections(kw, output_dir=str(tmp_path), backbone_path="b",
                                        world_size=2)  # fmt: skip

    s = sections(
        max_step=100,
        save_interval=10,
        log_interval=5,
        freeze_param=["model.embed_tokens", "model.layers.0", "lm_head", "stream_emb"],
        gradient_accumulation_steps=3,
        titan_config={
            "dp_shard": -1,
            "dp_replicate": 1,
            "gradient_clipping": 0.5,
            "activation_checkpoint": "full",
            "lr_scheduler": {"warmup_steps": 10, "decay_end_step": 50, "min_lr_ratio": 0.1},
        },
        training={"local_batch_size": 4},
    )
    assert s["training"]["steps"] == 100 and s["metrics"]["log_freq"] == 5
    assert s["checkpoint"]["interval"] == 10 and s["validation"]["freq"] == 10
    assert s["training"]["mixed_precision_param"] == "bfloat16"  # ESPnet's default
    assert s["training"]["max_norm"] == 0.5 and s["activation_checkpoint"]["mode"] == "full"
    assert s["training"]["global_batch_size"] == 4 * 2 * 3  # local x dp x accumulation
    assert s["speechlm"]["freeze"] == [
        "tok_embeddings", "backbone.layers.0", "head.output", "head.stream_emb"
    ]  # fmt: skip
    lr = s["lr_scheduler"]
    assert (lr["warmup_steps"], lr["total_steps"], lr["min_lr_factor"]) == (10, 50, 0.1)
    assert lr["decay_ratio"] == pytest.approx(40 / 50) and lr["decay_type"] == "cosine"
    assert s["optimizer"]["lr"] == 1e-4 and s["optimizer"]["beta2"] == 0.95

    with pytest.raises(ConfigError) as e:
        sections(max_step=1, save_interval=1, save_intervall=2)
    assert "save_intervall" in str(e.value) and "Did you mean `save_interval`" in str(e.value)
    assert "max_step" in str(e.value) and "speechlm_data" in str(e.value)
    with pytest.raises(ConfigError, match=r"titan_config\.dp_shards"):
        sections(max_step=1, save_interval=1, titan_config={"dp_shards": 2})
    with pytest.raises(ConfigError, match="needs `save_interval`"):
        sections(max_step=1)


def test_docs_map_every_espnet_key():
    from torchtitan_speechlm.python_api.args import ESPNET_KEYS, ESPNET_LR_KEYS, TITAN_CONFIG_KEYS

    text = open(os.path.join(ROOT, "docs", "python-api.md")).read()
    for key in ESPNET_KEYS:
        assert f"`{key}" in text, key
    for key in TITAN_CONFIG_KEYS:
        assert f"`titan_config.{key}" in text, key
    for key in ESPNET_LR_KEYS:
        assert f"lr_scheduler.{key}`" in text, key


def test_a_valid_fraction_that_holds_out_nothing_is_one_line(assets, tmp_path):
    """docs/python-api.md's migration example on a small set: the validation set on a
    valid_fraction that holds out no item ends the script with the setting, the count, the set
    and the fix in one line, after a short traceback (the checks' own call stack cut off)."""
    from tests import forked

    code = f"""
from torchtitan_speechlm import PreparedData, TitanTrainer
TitanTrainer(
    PreparedData({{"ljs": {assets["prepared"]!r}}}, ["tts:ljs:1.0", "asr:ljs:0.5"]),
    {{"asr_dev": "asr:ljs"}}, {assets["backbone"]!r}, None, {str(tmp_path / "exp")!r},
    {trainer_args(speechlm_data={"valid_fraction": 0.0001})!r},
)
"""
    r = forked.python_code(code, cwd=str(tmp_path))
    assert r.returncode == 1
    trace = r.stderr.strip().splitlines()
    assert trace[-1].startswith(
        "torchtitan_speechlm.config.errors.ConfigError: speechlm_data.valid_fraction = 0.0001 "
        "holds out 0 of the "
    ), r.stderr[-3000:]
    assert "'asr_dev' (asr:ljs) would be empty: raise valid_fraction to " in trace[-1]
    frames = [ln for ln in trace if ln.startswith("  File ") and "tests/forked.py" not in ln]
    assert len(frames) <= 3, r.stderr  # the script's line, TitanTrainer's __init__ and _parse
