"""The six journeys README.md lists after the demo, walked as a new user walks them: in a fresh
copy of the repository (its tracked and new files; `.venv` is the repository's, as `make`
leaves it), after the demo's steps (its corpus at a small size, then README's own `torchtitan
train` command), every command of each journey's section runs as written through `bash` with
`.venv` activated and nothing else on the PATH (`source .venv/bin/activate`, as the quickstart
says), and each ```python block of the section is saved to a file and run with `python FILE`.

Each journey must end in success (exit status 0 and the files it promises, with a fact or two
checked: the wav reads back, the bf16 note is an INFO line, DPO's first loss is log 2), and
every command must never be silent for more than 10 s once it has printed its first line (the
progress lines of generate, eval, prepare and the DPO reference pass, torchtitan's step lines);
its start-up (Python importing torch) is measured apart.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import subprocess
import threading
import time

import pytest
import soundfile as sf

from tests.command_parsing import ROOT
from tests.docs.test_doc_commands import FENCE

pytestmark = [pytest.mark.slow, pytest.mark.long]

# journey -> (page, heading of its section); README.md lists them in this order
JOURNEYS = {
    "export and generate": ("README.md", "### After the demo: six journeys"),
    "bring your own data": ("docs/data.md", "## Your own recordings, after the demo"),
    "a bf16 Qwen3 folder": ("docs/checkpoints.md", "### A bf16 Qwen3 folder"),
    "LoRA and a PEFT adapter": ("docs/checkpoints.md", "## Parameter-efficient fine-tuning: LoRA"),
    "the Python API": ("docs/python-api.md", "### On the demo's data"),
    "DPO": ("docs/preference.md", "## The recipe, after the demo: pairs from judges, then DPO"),
}
SILENCE_S = 10.0  # the longest a command may be silent after its first line
STARTUP_S = 60.0  # before its first line (imports; generous: these CPUs are shared)


def section(page: str, heading: str) -> str:
    """The text under ``heading`` up to the next heading of its level or above."""
    text = (ROOT / page).read_text()
    start = text.index(heading + "\n")
    level = len(heading.split()[0])
    rest = text[start + len(heading) :]
    end = re.search(rf"^#{{1,{level}}} ", rest, re.M)
    return rest[: end.start()] if end else rest


def steps(page: str, heading: str) -> list[tuple[str, str]]:
    """("bash", command) and ("python", code) in the section's order (shell lines joined over
    `\\`; a README journey's blocks end where its numbered list goes on)."""
    out = []
    for m in FENCE.finditer(section(page, heading)):
        lang, body = m.group(2).lower(), m.group(3)
        if lang == "bash":
            for line in body.replace("\\\n", " ").splitlines():
                line = line.split("  #")[0]  # the docs' comments: two spaces, then #
                if line.strip() and not line.strip().startswith("#"):
                    out.append(("bash", " ".join(line.split())))
        elif lang == "python":
            out.append(("python", body))
    return out


def test_readme_lists_the_six_journeys_and_each_section_has_its_steps():
    listed = re.findall(r"^\d\. \*\*(.+?)\*\*", section(*JOURNEYS["export and generate"]), re.M)
    assert len(listed) == 6, listed
    for name, (page, heading) in JOURNEYS.items():
        assert steps(page, heading), f"{name}: {page} '{heading}' shows no command"


class Timed:
    """A command's output lines with the time each came (stdout and stderr, read as they come)."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []
        self.lock = threading.Lock()

    def read(self, stream) -> None:
        for raw in iter(stream.readline, ""):
            with self.lock:
                self.lines.append((time.monotonic(), raw.rstrip("\n")))

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def run(clone, command: str, timeout: float = 900) -> Timed:
    """``command`` in ``clone`` as a user's shell runs it after `source .venv/bin/activate`,
    with nothing but the system's folders on the PATH before that; checks its silences."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    env.update(PATH="/usr/local/bin:/usr/bin:/bin", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    start = time.monotonic()
    proc = subprocess.Popen(
        ["bash", "-c", f"source .venv/bin/activate && {command}"], cwd=clone, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
    )  # fmt: skip
    timed = Timed()
    readers = [threading.Thread(target=timed.read, args=(s,)) for s in (proc.stdout, proc.stderr)]
    for t in readers:
        t.start()
    try:
        code = proc.wait(timeout=timeout)
    finally:
        for t in readers:
            t.join(timeout=10)
    end = time.monotonic()
    assert code == 0, f"`{command}` exited {code}:\n{timed.text()[-5000:]}"
    stamps = sorted(t for t, _ in timed.lines)
    assert stamps, f"`{command}` printed nothing"
    assert stamps[0] - start < STARTUP_S, (command, stamps[0] - start)
    gaps = [(b - a, i) for i, (a, b) in enumerate(zip(stamps, [*stamps[1:], end], strict=True))]
    longest, at = max(gaps)
    assert longest <= SILENCE_S, (
        f"`{command}` was silent for {longest:.1f} s after: {sorted(timed.lines)[at][1]!r}"
    )
    print(
        f"{end - start:6.1f} s, first line after {stamps[0] - start:4.1f} s, longest silence "
        f"{longest:4.1f} s: {command[:100]}"
    )  # fmt: skip  (pytest -s: the measurements)
    return timed


def walk(clone, name: str) -> list[Timed]:
    page, heading = JOURNEYS[name]
    outs = []
    for k, (kind, what) in enumerate(steps(page, heading)):
        if kind == "python":
            script = "journey_{}_{}.py".format(re.sub(r"\W+", "_", name), k)
            (clone / script).write_text(what)
            what = f"python {shlex.quote(script)}"
        outs.append(run(clone, what))
    return outs


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """A fresh copy of the repository after the demo: its corpus, tokenizer, backbone, codec and
    prepared data at a small size (demo/speaking.py, as `make demo` makes them), then README's
    training command as a user types it (400 steps of a 32-wide, 2-layer Llama)."""
    root = tmp_path_factory.mktemp("journeys") / "clone"
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split("\0")  # fmt: skip
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, root / name)
    os.symlink(ROOT / ".venv", root / ".venv")
    run(root, "python -c 'import shutil, sys; assert shutil.which(\"torchtitan\") == "
        "sys.prefix + \"/bin/torchtitan\"; print(\"torchtitan is on the PATH\")'")  # fmt: skip
    # the k-means codec, not make demo's mel codec: tests/docs/test_docs_after_demo.py says why
    code = (
        "from torchtitan_speechlm.demo.speaking import CorpusPlan, build_corpus\n"
        "build_corpus('demo_work', CorpusPlan(train=48, held_out=4, hidden=32, layers=2, "
        "heads=2, tokenizer_vocab=320, kmeans_seconds=60.0), workers=2)\n"
    )
    (root / "small_demo.py").write_text(code)
    run(root, "python small_demo.py")
    readme = steps("README.md", "## Quickstart (fresh machine)")  # (make demo is above)
    assert ("bash", "make demo") in readme
    run(root, "torchtitan train --job.config_file train_configs/speechlm_debug.toml")
    assert (root / "outputs/speechlm_debug/checkpoint/step-400/.metadata").is_file()
    return root


def test_export_and_generate(clone):
    export, speak, hear = walk(clone, "export and generate")
    assert (clone / "exported" / "text" / "config.json").is_file()
    wav, rate = sf.read(clone / "hello.wav")
    assert rate == 16000 and len(wav) > 0
    assert "torchtitan generate: tts: decoding" in speak.text()
    assert "torchtitan generate: asr: decoding" in hear.text()


def test_bring_your_own_data(clone):
    prepare, train, evaluate = walk(clone, "bring your own data")
    assert (clone / "own_data" / "train" / "metadata.json").is_file()
    assert "Starting job: the demo's model on my recordings" in train.text()
    assert "loaded from speechlm.init_from" in train.text()
    assert (clone / "outputs/own_data/checkpoint/step-100/.metadata").is_file()
    table = evaluate.text()
    assert re.search(r"^tts:dev +\d", table, re.M) and re.search(r"^asr:dev +\d", table, re.M)
    assert "torchtitan eval: tts:dev: 1/" in table  # per item


def test_a_bf16_qwen3_folder(clone):
    folder, train = walk(clone, "a bf16 Qwen3 folder")
    assert json.loads((clone / "qwen3_bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    log = train.text()
    assert re.search(r" - INFO - qwen3_bf16/config.json stores the weights as bfloat16: they are "
                     r"loaded into float32 master weights", log), log[-3000:]  # fmt: skip
    assert re.search(r" - INFO - weights of \d+ parameters: \d+ loaded from the backbone "
                     r"qwen3_bf16 ", log)  # fmt: skip
    assert re.search(r" - INFO - Building speechlm hf: backbone hf \(qwen3, 2 layers", log)
    assert not re.search(r"lspci|Peak flops|mfu|WARNING - .*bfloat16", log)
    assert (clone / "outputs/qwen3_bf16/checkpoint/step-20/.metadata").is_file()


def test_lora_and_a_peft_adapter(clone):
    walk(clone, "LoRA and a PEFT adapter")
    assert (clone / "exported_merged" / "text" / "config.json").is_file()
    assert (clone / "exported_adapter" / "adapter" / "adapter_config.json").is_file()


def test_the_python_api(clone):
    (script,) = walk(clone, "the Python API")
    assert (clone / "exp/demo_api/checkpoint/step-20/.metadata").is_file()
    assert "validate step 20 [asr_dev]" in script.text()


def test_dpo(clone):
    sample, prepare, train = walk(clone, "DPO")
    assert re.search(r"torchtitan eval: tts:train sample 4/4: \d+/\d+ items", sample.text())
    rows = [json.loads(line) for line in open(clone / "outputs/speechlm_dpo/metrics.jsonl")]
    pref = [r for r in rows if "train/preference_loss" in r]
    assert pref[0]["step"] == 1
    assert pref[0]["train/preference_loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert "preference_loss: 0.6931" in train.text() and "rewards/accuracies: " in train.text()
    assert (clone / "outputs/speechlm_dpo/checkpoint/step-100/.metadata").is_file()
