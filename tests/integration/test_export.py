"""Models out of the trainer: a checkpoint written by 2 FSDP ranks is exported in one CPU
process, loads back with SpeechLM.from_pretrained giving the checkpoint's logits exactly, and
its text LM loads into transformers' AutoModelForCausalLM with the same text logits; bad input
is refused with the file and the fix, nothing overwritten."""

import json
import os
import shutil

import pytest
import torch

from tests.helpers import make_tiny_run_assets, run_train, text_only_inputs, write_tiny_config
from torchtitan_speechlm.commands.export import export, export_command, main
from torchtitan_speechlm.commands.export_args import ExportArgs
from torchtitan_speechlm.model.model import SpeechLM, build_model
from torchtitan_speechlm.model.pretrained import (
    PretrainedError,
    args_from_record,
    load_checkpoint_state,
)
from torchtitan_speechlm.model.run_record import record_for_checkpoint

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """3 steps on 2 FSDP ranks (untied head), a full checkpoint at step 3."""
    root = tmp_path_factory.mktemp("export")
    assets = make_tiny_run_assets(root / "assets", n_items=24)
    dump = root / "run"
    cfg = write_tiny_config(root / "c.toml", assets, dump)
    r = run_train(cfg, "--training.steps", "3", "--validation.enable", "false", nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    return {"assets": assets, "step": str(dump / "checkpoint" / "step-3"), "root": root}


def checkpoint_model(step: str) -> SpeechLM:
    """The model exactly as the checkpoint holds it (independent of the export code path)."""
    record = record_for_checkpoint(step)
    model = build_model(args_from_record(record["model_args"]))
    names = {n for n, _ in model.named_parameters()}
    model.load_state_dict(load_checkpoint_state(step, names), strict=False)
    return model.eval()


def sample_inputs(layout, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.empty(2, 17, layout.num_streams, dtype=torch.long)
    for k in range(layout.num_streams):
        a, b = layout.stream_range(k)
        x[..., k] = torch.randint(a, b, (2, 17), generator=g)
    return x


def test_export_loads_back_with_identical_logits(trained, tmp_path):
    out = tmp_path / "exported"
    assert main(["--checkpoint", trained["step"], "--out-dir", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "speechlm" and cfg["codec"]["folder"] == "codec"
    assert (out / "vocab.json").is_file() and (out / "tokenizer.json").is_file()
    assert (out / "codec" / "config.json").is_file()
    ref = checkpoint_model(trained["step"])
    got = SpeechLM.from_pretrained(str(out))
    assert not torch.equal(
        ref.head.stream_emb.weight[1], torch.zeros_like(ref.head.stream_emb.weight[1])
    )  # really trained
    x = sample_inputs(ref.args.layout)
    with torch.no_grad():
        for a, b in zip(ref.logits(x), got.logits(x), strict=True):
            assert torch.equal(a, b)
    # bf16 export: the same values rounded, half the bytes
    small = tmp_path / "bf16"
    export(trained["step"], str(small), dtype="bf16")
    assert os.path.getsize(small / "model.safetensors") < 0.6 * os.path.getsize(
        out / "model.safetensors"
    )
    got16 = SpeechLM.from_pretrained(str(small))
    for (n, p), (_, q) in zip(ref.named_parameters(), got16.named_parameters(), strict=True):
        torch.testing.assert_close(q.float(), p.bfloat16().float(), rtol=0, atol=0, msg=n)


def test_text_lm_loads_into_transformers_with_the_same_text_logits(trained, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "exported"
    export(trained["step"], str(out))
    ours = checkpoint_model(trained["step"])
    lay = ours.args.layout
    ids = torch.randint(0, lay.text_size, (2, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        text_rows = slice(lay.text_offset, lay.text_offset + lay.text_size)
        mine = ours.logits(text_only_inputs(lay, ids))[0][..., text_rows]
        for folder in (out / "text", tmp_path / "text_only"):
            if folder.name == "text_only":
                assert (
                    main(["--checkpoint", trained["step"], "--out-dir", str(folder), "--text-only"])
                    == 0
                )
            hf = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
            theirs = hf(input_ids=ids).logits
            torch.testing.assert_close(theirs, mine, atol=1e-5, rtol=1e-5)


def test_sharded_export(trained, tmp_path):
    out = tmp_path / "sharded"
    export(trained["step"], str(out), max_shard_size=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    ref, got = checkpoint_model(trained["step"]), SpeechLM.from_pretrained(str(out))
    for (n, p), (_, q) in zip(ref.named_parameters(), got.named_parameters(), strict=True):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_an_export_has_the_modes_of_the_users_umask(trained, tmp_path, umask):
    """Every folder and file of an export (its temporary folder was mkdtemp's 0700, the
    safetensors safetensors' 0600) has the mode a plain mkdir / open gives under the umask."""
    out = tmp_path / "shared"
    old = os.umask(umask)
    try:
        export(trained["step"], str(out), max_shard_size=40_000)
    finally:
        os.umask(old)
    modes = {}
    for root, dirs, files in os.walk(out):
        for name in dirs + files:
            path = os.path.join(root, name)
            modes[os.path.relpath(path, out)] = os.stat(path).st_mode & 0o777
    modes["."] = os.stat(out).st_mode & 0o777
    assert any(p.endswith(".safetensors") for p in modes) and "text" in modes
    want = {p: (0o777 if os.path.isdir(out / p) else 0o666) & ~umask for p in modes}
    assert modes == want


def test_export_command_from_python_and_the_old_out_spelling(trained, tmp_path, capsys):
    """``export_command(ExportArgs)``: the command without a command line; ``--out``, the
    folder flag's old spelling, writes the same folder and says ``--out-dir`` in one line."""
    args = ExportArgs(checkpoint=trained["step"], out_dir=str(tmp_path / "a"), dtype="bf16")
    assert export_command(args) == 0
    said = capsys.readouterr()
    assert "is now" not in said.err and f"to {tmp_path / 'a'}:" in said.out
    assert main(["--checkpoint", trained["step"], "--out", str(tmp_path / "b"), "--dtype",
                 "bf16"]) == 0  # fmt: skip
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "is now" in line]  # (and transformers' bars)
    assert said == ["torchtitan export: --out is now --out-dir: use --out-dir (the old spelling "
                    "still works)"], err  # fmt: skip
    assert sorted(os.listdir(tmp_path / "a")) == sorted(os.listdir(tmp_path / "b"))
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"


def test_bad_input_is_refused_naming_the_file(trained, tmp_path, capsys):
    out = tmp_path / "exported"
    export(trained["step"], str(out))
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    assert main(["--checkpoint", trained["step"], "--out-dir", str(out)]) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before
    # an export given back to export, by the name generate/eval/serve use (--model)
    assert main(["--model", str(out), "--out-dir", str(tmp_path / "again")]) == 2
    err = capsys.readouterr().err
    assert f"{out} is a model folder (it has a config.json), not a training checkpoint" in err
    assert not (tmp_path / "again").exists()
    # a half-written checkpoint (no .metadata) and a truncated shard
    half = tmp_path / "run" / "checkpoint" / "step-9"
    shutil.copytree(trained["step"], half)
    shutil.copy(
        os.path.join(os.path.dirname(os.path.dirname(trained["step"])), "speechlm_run.json"),
        tmp_path / "run",
    )
    (half / ".metadata").unlink()
    with pytest.raises(PretrainedError, match="not a complete checkpoint"):
        export(str(half), str(tmp_path / "x"))
    shutil.copy(os.path.join(trained["step"], ".metadata"), half / ".metadata")
    shard = next(half.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(PretrainedError, match="unreadable"):
        export(str(half), str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()
    # a corrupted safetensors file of an export
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(PretrainedError, match="model.safetensors is unreadable or truncated"):
        SpeechLM.from_pretrained(str(out))
    # a folder that is not a SpeechLM export
    with pytest.raises(PretrainedError, match="model_type is 'qwen3'"):
        SpeechLM.from_pretrained(trained["assets"]["backbone"])


def first_loss(dump) -> float:
    from tests.helpers import read_metrics

    return next(m for m in read_metrics(dump) if "loss_metrics/global_avg_loss" in m)[
        "loss_metrics/global_avg_loss"
    ]


def test_new_runs_start_from_an_export_or_a_checkpoint_weights_only(trained, tmp_path):
    """`speechlm.init_from` an export and torchtitan's `initial_load_path` +
    `initial_load_model_only` from the DCP checkpoint start from the same weights (fresh
    optimizer, step 1, data from the start): equal first losses, below a from-scratch run's."""
    out = tmp_path / "exported"
    export(trained["step"], str(out))
    losses = {}
    runs = {
        "export": ("--speechlm.init_from", str(out)),
        "dcp": (
            "--checkpoint.initial_load_path",
            trained["step"],
            "--checkpoint.initial_load_model_only",
            "true",
        ),
        "scratch": (),
    }
    for name, flags in runs.items():
        dump = tmp_path / name
        cfg = write_tiny_config(tmp_path / f"{name}.toml", trained["assets"], dump)
        r = run_train(cfg, "--training.steps", "1", "--validation.enable", "false", *flags, nproc=2)
        log = r.stdout + r.stderr
        assert r.returncode == 0, log[-3000:]
        assert "Training starts at step 1" in log
        losses[name] = first_loss(dump)
    assert losses["export"] == pytest.approx(losses["dcp"], rel=1e-6)
    assert losses["export"] < losses["scratch"] - 0.05


def test_checkpoint_of_another_pattern_is_refused_before_any_rank(trained, tmp_path):
    cfg = write_tiny_config(tmp_path / "c.toml", trained["assets"], tmp_path / "run")
    r = run_train(
        cfg,
        "--speechlm.pattern",
        "parallel",
        "--checkpoint.initial_load_path",
        trained["step"],
        "--checkpoint.initial_load_model_only",
        "true",
    )
    assert r.returncode == 2 and "another pattern" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()


def test_torchtitan_hf_load_and_last_save_use_our_adapter(trained, tmp_path):
    """checkpoint.initial_load_in_hf starts exactly like our own pretrained load;
    last_save_in_hf writes the text LM inside under transformers' names."""
    from transformers import AutoModelForCausalLM

    from torchtitan_speechlm.model.pretrained import read_safetensors

    assets = trained["assets"]
    runs = {
        "ours": (),
        "hf": (
            "--speechlm.init",
            "normal",
            "--checkpoint.initial_load_in_hf",
            "true",
            "--checkpoint.initial_load_model_only",
            "true",
        ),
        "hf_out": (
            "--checkpoint.last_save_model_only",
            "true",
            "--checkpoint.last_save_in_hf",
            "true",
        ),
    }
    for name, flags in runs.items():
        dump = tmp_path / name
        cfg = write_tiny_config(tmp_path / f"{name}.toml", assets, dump)
        r = run_train(
            cfg,
            "--training.steps",
            "2",
            "--validation.enable",
            "false",
            "--checkpoint.interval",
            "10",
            *flags,
            nproc=2,
        )
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert first_loss(tmp_path / "hf") == pytest.approx(first_loss(tmp_path / "ours"), rel=1e-6)
    # the HF save holds exactly the text LM of the full save of the same (deterministic) run
    from torchtitan_speechlm.commands.export import text_lm_state

    full = checkpoint_model(str(tmp_path / "ours" / "checkpoint" / "step-2"))
    want = text_lm_state(full, dict(full.named_parameters()))
    got = read_safetensors(str(tmp_path / "hf_out" / "checkpoint" / "step-2"))
    assert set(got) == set(want) - {"lm_head.weight"} or set(got) == set(want)
    for key, value in got.items():
        torch.testing.assert_close(value, want[key].detach(), atol=2e-6, rtol=1e-5, msg=key)
    folder = tmp_path / "hf_out" / "checkpoint" / "step-2"
    # the HF-format save has its manifest too (utils/checkpoint_manifest.py), every file listed
    from torchtitan_speechlm.utils.checkpoint_manifest import MANIFEST, verify

    assert verify(str(folder)) == "", verify(str(folder))
    listed = json.loads((folder / MANIFEST).read_text())["files"]
    assert any(n.endswith(".safetensors") for n in listed), listed
    shutil.copy(os.path.join(assets["backbone"], "config.json"), folder)  # torchtitan writes none
    AutoModelForCausalLM.from_pretrained(str(folder))  # loads with transformers as it is
