"""`torchtitan train` with ``converters = ["lora"]`` (torchtitan's model converter seam): only
the adapters and the added rows change; the checkpoint holds optimizer state for the trainable
tensors only; the export merges the adapters (same logits) or writes a PEFT adapter folder
(same logits, loadable from any directory); bad settings stop before any rank starts, and a
rerun with other LoRA settings is refused naming every setting and the checkpoint to start from.
"""

import importlib.util
import json
import shutil

import pytest
import torch

from tests.helpers import (
    make_tiny_run_assets,
    params,
    run_train,
    text_only_inputs,
    write_tiny_config,
)
from tests.lora_fixtures import random_batch
from torchtitan_speechlm.commands.export import main as export_main
from torchtitan_speechlm.commands.train import torchtitan_args
from torchtitan_speechlm.config import ConfigError
from torchtitan_speechlm.generation.loading import load_model
from torchtitan_speechlm.model.lora import is_lora_param
from torchtitan_speechlm.model.model import SpeechLM, build_model
from torchtitan_speechlm.model.pretrained import args_from_record
from torchtitan_speechlm.model.run_record import read_run_record
from torchtitan_speechlm.trainer.preflight import preflight
from torchtitan_speechlm.trainer.run import prepare_run
from torchtitan_speechlm.utils.fileio import write_checked_json

# peft (about 1.5 s to import) is imported by the two tests that load an adapter with it, not
# when the module is collected: every test worker collects this file, one runs it
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("peft") is None, reason="peft is not installed (the dev extra)"
)


# ---------------------------------------------------------------------------------------------
# `torchtitan train` with converters = ["lora"], export
# ---------------------------------------------------------------------------------------------
LORA = ("--model.converters", "lora", "--lora.rank", "4", "--lora.target_modules", "q_proj,v_proj")
STEPS = ("--training.steps", "4", "--checkpoint.interval", "2", "--validation.enable", "false")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_tiny_run_assets(tmp_path_factory.mktemp("lora_assets"), n_items=24)


@pytest.fixture(scope="module")
def lora_run(assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_run")
    cfg = write_tiny_config(root / "c.toml", assets, root / "dump")
    r = run_train(cfg, *LORA, *STEPS, "--optimizer.weight_decay", "0.1")
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return root / "dump"


def initial_state(dump) -> dict[str, torch.Tensor]:
    """The run's weights before step 1, rebuilt from its record (backbone weights loaded)."""
    record = read_run_record(str(dump / "speechlm_run.json"))
    args = args_from_record(record["model_args"], record["hf_assets_path"])
    args.load_weights = True
    return {n: p.detach() for n, p in build_model(args).named_parameters()}


def test_after_training_only_adapters_and_added_rows_changed(lora_run):
    start, end = initial_state(lora_run), params(lora_run / "checkpoint" / "step-4")
    assert set(start) == set(end)
    record = read_run_record(str(lora_run / "speechlm_run.json"))
    layout = args_from_record(record["model_args"]).layout
    text = slice(layout.text_offset, layout.text_offset + layout.text_size)
    adapters = [n for n in start if is_lora_param(n)]
    assert len(adapters) == 2 * 2 * 2 and all(("q_proj" in n) or ("v_proj" in n) for n in adapters)
    for name in start:
        if ".lora_B." in name or name == "head.stream_emb.weight":
            assert not torch.equal(start[name], end[name]), name
        elif name in ("tok_embeddings.weight", "head.output.weight"):
            assert torch.equal(start[name][text], end[name][text]), name
            assert not torch.equal(start[name][text.stop :], end[name][text.stop :]), name
        elif ".lora_A." not in name:  # A moves once B has: checked below
            assert torch.equal(start[name], end[name]), name
    assert any(not torch.equal(start[n], end[n]) for n in adapters if ".lora_A." in n)


def test_checkpoint_has_optimizer_state_for_trainable_tensors_only(lora_run):
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(lora_run / "checkpoint" / "step-4")).read_metadata()
    moments = {
        k.removeprefix("optimizer.state.").removesuffix(".exp_avg")
        for k in keys.state_dict_metadata
        if k.startswith("optimizer.state.") and k.endswith(".exp_avg")
    }
    model = load_model(str(lora_run / "checkpoint" / "step-4")).model
    assert moments == {n for n, p in model.named_parameters() if p.requires_grad}
    assert "backbone.layers.0.self_attn.q_proj.base_layer.weight" not in moments


def test_export_merges_adapters_or_writes_a_peft_adapter(lora_run, tmp_path):
    assert_exports_agree(str(lora_run / "checkpoint" / "step-4"), tmp_path)


def assert_exports_agree(step: str, tmp_path) -> None:
    """The merged export and the ``--adapter`` export of LoRA checkpoint ``step`` compute what
    the LoRA model computes; the PEFT adapter on ``text/`` equals the merged ``text/``."""
    from transformers import AutoModelForCausalLM

    assert export_main(["--checkpoint", step, "--out-dir", str(tmp_path / "merged")]) == 0
    assert export_main(["--checkpoint", step, "--out-dir", str(tmp_path / "ad"), "--adapter"]) == 0
    unmerged = load_model(step).model
    merged = SpeechLM.from_pretrained(str(tmp_path / "merged"))
    assert not any(is_lora_param(n) for n, _ in merged.named_parameters())
    assert (
        json.loads((tmp_path / "merged" / "config.json").read_text())["model_args"]["lora"] is None
    )
    layout = unmerged.args.layout
    gen = torch.Generator().manual_seed(0)
    inputs, _, _ = random_batch(layout, 2, 12, gen)
    with torch.no_grad():
        for a, b in zip(unmerged.logits(inputs), merged.logits(inputs), strict=True):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
        for a, b in zip(
            unmerged.logits(inputs),
            SpeechLM.from_pretrained(str(tmp_path / "ad")).logits(inputs),
            strict=True,
        ):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
    files = sorted(p.name for p in (tmp_path / "ad" / "adapter").iterdir())
    assert files == ["adapter_config.json", "adapter_model.safetensors"]
    ids = torch.randint(0, layout.text_size, (2, 12), generator=gen)
    import peft

    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ad" / "text"))
    with torch.no_grad():
        plain = base(ids).logits
        adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "ad" / "adapter"))(ids).logits
        want = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged" / "text"))(ids).logits
        text = slice(layout.text_offset, layout.text_offset + layout.text_size)
        ours = unmerged.logits(text_only_inputs(layout, ids))[0][..., text]
    torch.testing.assert_close(adapted, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(want, ours, atol=1e-5, rtol=0)
    assert (plain - want).abs().max() > 1e-4  # the adapter is what makes them equal


def test_the_adapter_folder_loads_from_any_directory(lora_run, tmp_path, monkeypatch):
    """The adapter names its base by the exported text LM's absolute path (PEFT resolves it
    against the current directory): AutoPeftModelForCausalLM loads it from elsewhere and
    computes what the merged export computes."""
    from transformers import AutoModelForCausalLM

    step = str(lora_run / "checkpoint" / "step-4")
    assert export_main(["--checkpoint", step, "--out-dir", str(tmp_path / "merged")]) == 0
    assert export_main(["--checkpoint", step, "--out-dir", str(tmp_path / "ad"), "--adapter"]) == 0
    config = json.loads((tmp_path / "ad" / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "ad" / "text")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    import peft

    adapted = peft.AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "ad" / "adapter"))
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged" / "text"))
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids).logits, merged(ids).logits, atol=1e-5, rtol=0)


def test_adapter_export_of_a_run_without_lora_is_refused(lora_run, tmp_path, capsys):
    """Whether a run has adapters is its record's: refused before its checkpoint is read."""
    record = json.loads((lora_run / "speechlm_run.json").read_text())
    record.pop("sha256")  # the edited record is not the one its checksum covered
    record["model_args"]["lora"] = {}
    (tmp_path / "dump" / "checkpoint" / "step-1").mkdir(parents=True)
    write_checked_json(str(tmp_path / "dump" / "speechlm_run.json"), record)  # sealed, not damaged
    step = str(tmp_path / "dump" / "checkpoint" / "step-1")
    assert export_main(["--checkpoint", step, "--out-dir", str(tmp_path / "x"), "--adapter"]) == 2
    assert "not from a LoRA run" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------------------------------------
# Bad input: before any rank starts
# ---------------------------------------------------------------------------------------------
def test_a_target_pattern_that_matches_nothing_stops_before_any_rank_starts(assets, tmp_path):
    cfg = write_tiny_config(tmp_path / "c.toml", assets, tmp_path / "dump")
    r = run_train(cfg, *LORA, "--lora.target_modules", "q_proj,qkv", "--training.steps", "1")
    assert r.returncode == 2, (r.stdout + r.stderr)[-3000:]
    assert (
        "lora.target_modules entry 'qkv' matches no linear layer of the decoder. Its linear "
        "layers: self_attn.q_proj, self_attn.k_proj, self_attn.v_proj, self_attn.o_proj, "
        "mlp.gate_proj, mlp.up_proj, mlp.down_proj"
    ) in r.stderr, r.stderr[-3000:]
    assert "Building" not in r.stdout + r.stderr  # no rank built a model


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ("--model.converters", "lora,quantize.linear.float8"),
            "LoRA cannot be combined with ['quantize.linear.float8']",
        ),
        (
            ("--speechlm.freeze", "backbone", "--lora.train_audio_rows", "false"),
            "freezes every LoRA adapter",
        ),
        (
            ("--checkpoint.last_save_in_hf", "true", "--checkpoint.last_save_model_only", "true"),
            "checkpoint.last_save_in_hf = true with LoRA",
        ),
        (("--lora.rank", "0"), "lora.rank = 0: must be >= 1"),
        (("--lora.dropout", "1.0"), "lora.dropout = 1.0: must be in [0, 1)"),
    ],
)
def test_options_lora_cannot_work_with_are_refused_by_the_start_up_checks(
    assets, tmp_path, flags, message
):
    """The launcher's checks (``preflight``, as in the test above), called in this process."""
    from torchtitan.config import ConfigManager

    cfg = write_tiny_config(tmp_path / "c.toml", assets, tmp_path / "dump")
    args = torchtitan_args(["--job.config_file", cfg, *LORA, *flags])
    job = ConfigManager().parse_args(args)
    with pytest.raises(ConfigError) as e:
        preflight(job, prepare_run(job)[0], 1)
    assert message in str(e.value)


def test_without_peft_the_error_names_the_extra(monkeypatch):
    import sys

    from torchtitan_speechlm.model.lora import LoraError, peft_module

    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` raises ImportError
    with pytest.raises(LoraError, match=r'pip install "torchtitan-speechlm\[lora\]"'):
        peft_module()


def test_resuming_with_other_lora_settings_is_refused(lora_run, tmp_path):
    """The run record keeps the [lora] settings an export rebuilds the adapters with."""
    from torchtitan.config import ConfigManager

    dump = tmp_path / "dump"
    shutil.copytree(lora_run, dump)
    assets = json.loads((dump / "speechlm_run.json").read_text())
    cfg = write_tiny_config(
        tmp_path / "c.toml",
        {
            "backbone": assets["hf_assets_path"],
            "prepared": assets["datasets"]["tiny"],
        },
        dump,
    )
    start = f"--speechlm.init_from {dump / 'checkpoint' / 'step-4'}"
    for flags, shown in (
        (("--lora.alpha", "4.0"), "this run asks for LoRA rank=4, alpha=4.0,"),  # another function
        ((), "this run asks for no LoRA"),  # converters dropped
    ):
        lora = LORA if flags else ()
        job = ConfigManager().parse_args(torchtitan_args(["--job.config_file", cfg, *lora, *flags]))
        with pytest.raises(ConfigError) as e:
            preflight(job, prepare_run(job)[0], 1)
        message = str(e.value)
        assert "was made with LoRA rank=4, alpha=16.0, dropout=0.0," in message, message
        assert shown in message and "train_head=False" in message  # every setting, not cut
        assert message.endswith(start)  # a new run can start from the run's weights
