"""A SpeechLM with a continuous audio encoder trained through `torchtitan train` (torchtitan's own
Trainer, real processes on CPU/gloo): 2-process FSDP2 (encoder layers and the tower as units of
their own, activation checkpointing on) equals one process in loss, grad norm and parameters,
with the encoder frozen and trained; the DCP checkpoint exports to a folder `from_pretrained`
loads with its audio encoder."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import make_tiny_run_assets, read_metrics, run_train, write_tiny_config
from tests.tiny_whisper import save_tiny_whisper
from torchtitan_speechlm.commands.export import export
from torchtitan_speechlm.model.model import SpeechLM
from torchtitan_speechlm.model.pretrained import read_safetensors
from torchtitan_speechlm.prepare.waveforms import add_waveforms

pytestmark = [pytest.mark.slow, pytest.mark.long]  # 2-process runs, 71-113 s: make faults
STEPS = 3


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("audio_train")
    run = make_tiny_run_assets(root / "run", n_items=24)
    add_waveforms(run["prepared"], str(root / "run" / "manifest.jsonl"))
    return {**run, "whisper": save_tiny_whisper(root / "whisper"), "root": root}


RUNS: dict = {}  # name -> (metrics by step, log, export folder): each run once per session


def train(assets, name: str, *flags: str, nproc: int, local: int) -> tuple[dict, str, str]:
    if name in RUNS:
        return RUNS[name]
    root = assets["root"]
    cfg = write_tiny_config(root / f"{name}.toml", assets, root / name)
    r = run_train(
        cfg,
        "--training.steps", str(STEPS),
        "--training.local_batch_size", str(local),
        "--validation.enable", "false",
        "--speechlm_data.train", "asr_wave:tiny:0.5,tts:tiny:0.5",
        "--audio_encoder.path", assets["whisper"],
        "--audio_encoder.stack", "2",
        *flags,
        nproc=nproc,
        timeout=400,
    )  # fmt: skip
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-8000:]
    rows = {row["step"]: row for row in read_metrics(root / name) if "grad_norm" in row}
    out = str(root / f"{name}_export")
    export(str(root / name / "checkpoint" / f"step-{STEPS}"), out)
    RUNS[name] = rows, log, out
    return RUNS[name]


@pytest.mark.parametrize("freeze", [True, False])
def test_two_process_fsdp_equals_one_process(assets, freeze):
    flags = () if freeze else ("--audio_encoder.no-freeze-encoder",)
    tag = "frozen" if freeze else "trained"
    one, _, out1 = train(assets, f"one_{tag}", *flags, nproc=1, local=4)
    two, log, out2 = train(
        assets, f"two_{tag}", *flags, "--activation_checkpoint.mode", "full", nproc=2, local=2
    )
    assert "Applied FSDP to the SpeechLM" in log
    for s in range(1, STEPS + 1):
        a, b = one[s], two[s]
        assert a["loss_metrics/global_avg_loss"] == pytest.approx(
            b["loss_metrics/global_avg_loss"], abs=1e-5
        ), s
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), s
    p1, p2 = read_safetensors(out1), read_safetensors(out2)
    assert p1.keys() == p2.keys() and any(k.startswith("audio_encoder.encoder.") for k in p1)
    for k in p1:
        torch.testing.assert_close(p1[k], p2[k], atol=2e-5, rtol=0, msg=k)
    folder = read_safetensors(assets["whisper"])
    moved = [k for k in folder if k.startswith("encoder.layers.")
             and not torch.equal(folder[k], p1[f"audio_encoder.{k}"])]  # fmt: skip
    assert bool(moved) != freeze  # a frozen encoder is the folder's, a trained one moved
    model = SpeechLM.from_pretrained(out1)
    assert model.audio_encoder is not None
    for k, v in model.state_dict().items():
        if k in p1:
            torch.testing.assert_close(v, p1[k], atol=0, rtol=0)


def test_compiled_encoder_layers_match_eager(assets):
    """--compile.enable compiles each encoder layer too (aot_eager): the same losses and grad
    norms as the eager run with the encoder trained."""
    flags = ("--audio_encoder.no-freeze-encoder",)
    eager, _, _ = train(assets, "one_trained", *flags, nproc=1, local=4)
    comp, log, _ = train(
        assets, "one_compiled", *flags, "--compile.enable", "true", "--compile.backend",
        "aot_eager", nproc=1, local=4,
    )  # fmt: skip
    assert "Compiled each audio encoder layer with torch.compile (backend=aot_eager)" in log
    for s in range(1, STEPS + 1):
        assert comp[s]["loss_metrics/global_avg_loss"] == pytest.approx(
            eager[s]["loss_metrics/global_avg_loss"], abs=1e-4
        ), s
        assert comp[s]["grad_norm"] == pytest.approx(eager[s]["grad_norm"], rel=1e-3), s
