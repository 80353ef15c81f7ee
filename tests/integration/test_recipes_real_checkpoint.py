"""The shipped GPU recipes on a backbone as users download it: train_configs/qwen3_0.6b_tts_asr.toml
and qwen3_1.7b_tts_asr.toml with only their FILL-IN paths filled (tests/recipes.py), the backbone
carrying the real Qwen3-0.6B / Qwen3-1.7B config.json keys and bf16 weights (tests/real_checkpoints.py:
layers cut to 2, widths shrunk, the real 151,936-word vocabulary), the recipe's own torch.compile,
activation checkpointing, bf16 mixed precision and fused AdamW, on 1 and on 2 gloo
processes (FSDP2), then export, generate (TTS and ASR) and serve on the result.

Before the fix the 2-process run stopped at step 1 (FSDP2: "uniform original parameter dtype",
{float32, bfloat16}); on one process it trained bf16 master weights silently. Here the saved
parameters are float32 and rank 0 says once that the stored bf16 became float32 master weights.
`make faults` runs the 0.6B recipe on 2 processes (long marker); the gpu_check dry run runs both
recipes on 1 and on 2 processes through the same steps."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import openai
import pytest
import soundfile as sf
import torch

from tests.helpers import make_tiny_run_assets, params, run_train
from tests.real_checkpoints import save_real_backbone
from tests.recipes import cut_overrides, filled_recipe

STEPS = 4
pytestmark = pytest.mark.long  # in make faults (make test budget)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipe_data")
    return make_tiny_run_assets(root / "assets", n_items=24)


def train_recipe(root, data, recipe: str, shipped_as: str, nproc: int) -> dict:
    backbone = str(root / shipped_as)
    save_real_backbone(backbone, shipped_as, num_layers=2, shrink=True)
    dump = str(root / "run")
    prepared = data["prepared"]
    config = filled_recipe(
        recipe, root / "recipe.toml", backbone, {"train": prepared, "dev": prepared}, dump
    )
    r = run_train(config, *cut_overrides(nproc, steps=STEPS), nproc=nproc, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    return {"dump": dump, "out": out, "backbone": backbone}


def check_training(run: dict) -> None:
    out = run["out"]
    assert out.count("stores the weights as bfloat16") == 1, out[-3000:]
    assert "Compiled each decoder layer" in out  # the recipe's compile (and its AC, as shipped)
    assert "validate step" in out  # the recipe's [validation] on its dev set
    step = os.path.join(run["dump"], "checkpoint", f"step-{STEPS}")
    state = params(step)
    assert state and {t.dtype for t in state.values() if t.is_floating_point()} == {torch.float32}
    assert all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point())


def check_export_generate_serve(run: dict, data: dict, tmp_path) -> None:
    from torchtitan_speechlm.commands.export import export
    from torchtitan_speechlm.commands.generate import generate_main

    folder = str(tmp_path / "export")
    export(os.path.join(run["dump"], "checkpoint", f"step-{STEPS}"), folder)
    wav = str(tmp_path / "hello.wav")
    argv = ["--model", folder, "--task", "tts", "--text", "hello there", "--out", wav]
    assert generate_main([*argv, "--max-frames", "20"]) == 0
    wave, rate = sf.read(wav)
    assert rate > 0 and len(wave) > 0 and np.isfinite(wave).all()
    text = str(tmp_path / "hello.txt")
    argv = ["--model", folder, "--task", "asr", "--audio", wav, "--out", text]
    assert generate_main([*argv, "--max-frames", "20"]) == 0
    assert os.path.isfile(text)
    serve_one_request(folder, wav)


def serve_one_request(folder: str, wav: str) -> None:
    cmd = [sys.executable, "-m", "torchtitan_speechlm.cli", "serve", "--model", folder,
           "--port", "0", "--max-frames", "20"]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)  # fmt: skip
    lines, url, started = [], [], threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if " on http://" in line and not url:
                url.append(line.split(" on ")[1].split()[0])
                started.set()
        started.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert started.wait(180) and url, "".join(lines[-30:])
        client = openai.OpenAI(base_url=url[0] + "/v1", api_key="none", max_retries=0, timeout=120)
        speech = client.audio.speech.create(model="export", voice="alloy", input="hello there")
        assert speech.content[:4] == b"RIFF"
        with open(wav, "rb") as f:
            assert isinstance(client.audio.transcriptions.create(model="export", file=f).text, str)
    finally:
        proc.terminate()
        proc.wait(30)


RUNS = [
    pytest.param("qwen3_0.6b_tts_asr.toml", "qwen3_0.6b", 2, id="0.6b-2ranks"),
]  # fmt: skip
# Both recipes on 1 rank and on 2 (compiled, exported, generated, served) are also run by
# `benchmarks/gpu_check.sh --dry-run` (tests/integration/test_gpu_check.py, make faults).


@pytest.mark.parametrize("recipe,shipped_as,nproc", RUNS)
def test_recipe_trains_compiled_on_a_bf16_checkpoint_then_exports_generates_serves(
    tmp_path, data, recipe, shipped_as, nproc
):
    run = train_recipe(tmp_path, data, recipe, shipped_as, nproc)
    check_training(run)
    check_export_generate_serve(run, data, tmp_path)
