"""Run a ``pip install`` and say what it does, at least every 5 seconds, in a few lines.

    python tools/install_progress.py WHAT -- PYTHON -m pip install ARGS...
    python tools/install_progress.py --apt WHAT -- apt-get install -y PACKAGES...
    python tools/install_progress.py --compile WHAT -- PYTHON -m compileall -q -j 0 FOLDER

``make`` installs through this (the Makefile's ``$(STAMP)`` rule): ``pip -q`` was silent for
minutes, and pip's own output is hundreds of lines ("Requirement already satisfied", every
download) plus one "WARNING: Location '...' is ignored" per configured ``find-links`` folder
that does not exist on this machine. Here each package pip collects is named on one line, the
install step says how many packages it installs, a heartbeat line repeats the current step
whenever pip was quiet for 5 s (a large wheel unpacks for a minute), and the end says what was
installed and how long it took. pip's other warnings and its errors pass unchanged; the
"Location ... ignored" warnings about absent find-links folders are dropped (they concern the
machine's pip configuration, not this install). Exits with pip's status. Standard library only
(it runs before anything is installed). ``--apt``: an ``apt-get install``, whose lines become the
heartbeat's step ("Setting up chromium ...") and only its errors and warnings (``E:``, ``W:``)
are printed. ``--compile``: the installed packages compiled to bytecode on every core
(``compileall -j 0``; the installs run ``pip --no-compile``, whose own compile is one file after
another: 45-60 s of a fresh install on 2 cores, against about 33 s here). Like pip, it leaves a
file that is not valid Python for this interpreter uncompiled (torch ships a few for newer
Pythons), counted in the last line rather than printed; any other failure keeps its status.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

EVERY_S = 5.0
# pip's lines that say nothing a user needs (each still becomes the heartbeat's step)
NOISE = re.compile(
    r"^\s*(WARNING: Location '.*' is ignored"  # a find-links folder absent on this machine
    r"|Requirement already satisfied|Looking in|Using pip|Using cached|Downloading|Obtaining"
    r"|Preparing|Getting|Building|Checking|Installing build dependencies|Created wheel"
    r"|Stored in directory|Successfully built|Attempting|Found existing|Not removing"
    r"|Uninstalling|Successfully uninstalled)"
)


class Install:
    """pip's lines in, a few of ours out (on ``out``), with a heartbeat thread."""

    def __init__(
        self, what: str, out=None, every: float = EVERY_S, apt: bool = False, bytecode: bool = False
    ) -> None:
        self.what, self.out, self.every, self.apt = what, out or sys.stdout, every, apt
        self.bytecode = bytecode
        self.start = self.last = time.monotonic()
        self.step = f"compiling {what}" if bytecode else f"starting pip for {what}"
        self.collected, self.installed, self.uncompiled = 0, False, 0
        self.lock = threading.Lock()

    def say(self, text: str) -> None:
        with self.lock:
            self.last = time.monotonic()
            print(f"[make]   {text}", file=self.out, flush=True)

    def line(self, raw: str) -> None:
        """One line of pip's output."""
        text = raw.rstrip()
        if self.bytecode:  # compileall -q prints only the files it could not compile
            if text.startswith("*** Error compiling"):
                self.uncompiled += 1
            return
        if self.apt:
            if text.startswith(("E:", "W:")):
                self.say(text)
            elif text.startswith(("Setting up", "Unpacking", "Get:", "Hit:", "Reading")):
                self.step = text.split(" (")[0][:100]
            return
        if m := re.match(r"^Collecting (\S+)", text):
            self.collected += 1
            self.step = f"collecting {m.group(1)} ({self.collected} so far)"
            self.say(self.step)
        elif text.startswith("Installing collected packages:"):
            names = [n.strip() for n in text.split(":", 1)[1].split(",") if n.strip()]
            self.step = f"installing {len(names)} packages ({', '.join(names[:6])}"
            self.step += ", ...)" if len(names) > 6 else ")"
            self.say(self.step)
        elif text.startswith("Successfully installed"):
            self.installed = True
            n = len(text.split()) - 2
            self.say(f"installed {n} packages in {time.monotonic() - self.start:.0f}s")
        elif NOISE.match(text):
            if not text.lstrip().startswith(("WARNING", "Requirement")):
                self.step = text.strip().rstrip(":")
        elif text:
            self.say(text)

    def beat(self, stop: threading.Event) -> None:
        while not stop.wait(0.5):
            if time.monotonic() - self.last >= self.every:
                self.say(f"{self.step} ({time.monotonic() - self.start:.0f}s)")


def run(
    what: str,
    cmd: list[str],
    out=None,
    every: float = EVERY_S,
    apt: bool = False,
    bytecode: bool = False,
) -> int:
    """Run ``cmd`` (a pip install, ``apt`` or a ``bytecode`` compile), printing ``Install``'s
    lines; returns its exit status (a compile whose only failures are files invalid for this
    Python: 0)."""
    job = Install(what, out, every, apt, bytecode)
    verb = "apt-get: " if apt else "compiling " if bytecode else "installing "
    print(f"[make] {verb}{what}", file=job.out, flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # pip's lines as they come, not in blocks
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1
    )
    stop = threading.Event()
    beat = threading.Thread(target=job.beat, args=(stop,), daemon=True)
    beat.start()
    try:
        for raw in proc.stdout:
            job.line(raw)
        code = proc.wait()
    finally:
        stop.set()
        beat.join()
    took = time.monotonic() - job.start
    if bytecode and code == 1 and job.uncompiled:
        code = 0  # compileall's status for "some file did not compile": pip ignores those too
    if bytecode and code == 0:
        n = job.uncompiled
        skipped = f"; {n} file{'s' * (n != 1)} invalid for this Python left as source" * bool(n)
        job.say(f"compiled {what} in {took:.0f}s{skipped}")
    elif code != 0:
        job.say(f"{os.path.basename(cmd[0])} failed (exit {code}): {what}")
    elif apt:
        job.say(f"{what}: done in {took:.0f}s")
    elif not job.installed:
        job.say(f"{what}: already installed ({took:.0f}s)")
    return code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    apt, bytecode = argv[:1] == ["--apt"], argv[:1] == ["--compile"]
    argv = argv[1:] if apt or bytecode else argv
    if "--" not in argv or argv.index("--") != 1 or len(argv) < 3:
        print(
            "usage: python tools/install_progress.py [--apt | --compile] WHAT -- COMMAND...",
            file=sys.stderr,
        )
        return 2
    return run(argv[0], argv[2:], apt=apt, bytecode=bytecode)


if __name__ == "__main__":
    sys.exit(main())
