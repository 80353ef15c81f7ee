"""Headless Chromium driven through the DevTools protocol over a pipe (no websocket package),
for the tests that open our HTML reports in a real browser. A module of its own so that test
files share it without importing one another (a test module imported twice registers its judges
twice)."""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import tempfile
import time

import pytest


def chromium_or_skip() -> str:
    """The chromium binary; skips where it is missing, and fails in CI, where the Makefile's
    system-deps installs it."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing in CI (the Makefile's system-deps installs it)")
        pytest.skip("chromium is not installed (`make system-deps` installs it)")
    return chromium


def browse(chromium: str, url: str, timeout: float = 60.0) -> dict:
    """Open ``url`` in headless Chromium; returns its console/JS/network errors, every request's
    URL, each <audio>'s src and duration once its metadata loaded, and each <img>'s width."""
    profile = tempfile.mkdtemp(prefix="chromium-")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
             f"--user-data-dir={profile}", "--no-first-run", "--mute-audio", "about:blank"]  # fmt: skip
    proc = subprocess.Popen(  # the protocol on fds 3 (commands) and 4 (replies)
        ["bash", "-c", 'exec "$@" 3<&0 4>&1 </dev/null >/dev/null', "_", chromium, *flags],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    cdp = _Pipe(proc, time.time() + timeout)
    try:
        target = cdp.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = cdp.call("Target.attachToTarget", {"targetId": target, "flatten": True})
        cdp.session = session["sessionId"]
        for domain in ("Runtime", "Log", "Page", "Network"):
            cdp.call(f"{domain}.enable")
        cdp.call("Page.navigate", {"url": url})
        cdp.wait_for("Page.loadEventFired")
        audio = cdp.call("Runtime.evaluate", {"expression": AUDIO_JS, "awaitPromise": True,
                                              "returnByValue": True})  # fmt: skip
        images = cdp.call("Runtime.evaluate", {"expression": IMAGES_JS, "returnByValue": True})
        errors = [_error(e) for e in cdp.events if _error(e)]
        requests = [
            e["params"]["request"]["url"]
            for e in cdp.events
            if e.get("method") == "Network.requestWillBeSent"
        ]
        return {"errors": errors, "requests": requests, "audio": audio["result"]["value"],
                "images": images["result"]["value"]}  # fmt: skip
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(profile, ignore_errors=True)


AUDIO_JS = """Promise.all([...document.querySelectorAll('audio')].map(a => a.readyState >= 1
  ? {src: a.currentSrc, duration: a.duration}
  : new Promise(done => {
      a.addEventListener('loadedmetadata', () => done({src: a.currentSrc, duration: a.duration}));
      a.addEventListener('error', () => done({src: a.currentSrc, error: String(a.error && a.error.code)}));
    })))"""
IMAGES_JS = "[...document.images].map(i => ({src: i.currentSrc, width: i.naturalWidth}))"


def _error(event: dict) -> str | None:
    method, params = event.get("method"), event.get("params", {})
    if method == "Runtime.exceptionThrown":
        return json.dumps(params["exceptionDetails"])[:500]
    if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
        return json.dumps(params.get("args"))[:500]
    if method == "Log.entryAdded" and params["entry"].get("level") == "error":
        return f"{params['entry'].get('text')} {params['entry'].get('url', '')}"
    return None


class _Pipe:
    """Chrome DevTools Protocol messages: JSON separated by NUL bytes."""

    def __init__(self, proc, deadline: float):
        self.proc, self.deadline, self.buf = proc, deadline, b""
        self.next_id, self.session, self.events = 0, None, []

    def _recv(self) -> dict:
        while b"\0" not in self.buf:
            ready, _, _ = select.select(
                [self.proc.stdout], [], [], max(0.0, self.deadline - time.time())
            )
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16) if ready else b""
            if not chunk:
                raise TimeoutError("chromium did not answer in time (or exited)")
            self.buf += chunk
        msg, self.buf = self.buf.split(b"\0", 1)
        return json.loads(msg)

    def call(self, method: str, params: dict | None = None) -> dict:
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if self.session and not method.startswith("Target."):
            msg["sessionId"] = self.session
        self.proc.stdin.write(json.dumps(msg).encode() + b"\0")
        self.proc.stdin.flush()
        while True:
            reply = self._recv()
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str) -> None:
        while not any(e.get("method") == method for e in self.events):
            self.events.append(self._recv())
