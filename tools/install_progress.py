"""Run a ``pip install`` and say what it does, at least every 5 seconds, in a few lines.

    python tools/install_progress.py WHAT -- PYTHON -m pip install ARGS...
    python tools/install_progress.py --apt WHAT -- apt-get install -y PACKAGES...
    python tools/install_progress.py --uv WHAT -- PYTHON -m pip install ARGS...

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
are printed.
``--uv``: the same ``pip install`` done by uv (``uv pip install``, installed into the venv
beside the interpreter by the step before), which unpacks in parallel: the 181 packages of
``.[dev,eval,serve,codecs]`` in about 10 s on 2 cores against pip's 62 s. uv does not read
pip's configuration, so the sources pip is configured with (``pip config list``: index-url,
extra-index-url, find-links, constraint, no-index, cert) are passed to it as flags, with pip's
rule for several indexes (the best version from any of them). Where uv is not there or fails,
the pip command runs as given, after a line saying why.
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
# uv's summary lines ("Resolved 191 packages in 2.73s") and those that say nothing a user needs
UV_SUMMARY = re.compile(r"^(Resolved|Prepared|Installed|Uninstalled|Audited) (\d+) packages? in ")
UV_NOISE = re.compile(r"^\s*([-+~] \S|Using Python|Downloading|Downloaded|Building|Built)")
# pip's options that uv does not take (uv never compiles unless asked, shows no progress bar
# in a pipe and has no version check)
PIP_ONLY = {"--disable-pip-version-check": 0, "--no-compile": 0, "--progress-bar": 1}
# pip's configuration sections, highest precedence first (`pip config list` prints them all)
PIP_SECTIONS = (":env:", "site", "user", "install", "global")


class Install:
    """pip's lines in, a few of ours out (on ``out``), with a heartbeat thread."""

    def __init__(self, what: str, out=None, every: float = EVERY_S, apt: bool = False) -> None:
        self.what, self.out, self.every, self.apt = what, out or sys.stdout, every, apt
        self.start = self.last = time.monotonic()
        self.step = f"starting pip for {what}"
        self.collected, self.installed = 0, False
        self.lock = threading.Lock()

    def say(self, text: str) -> None:
        with self.lock:
            self.last = time.monotonic()
            print(f"[make]   {text}", file=self.out, flush=True)

    def line(self, raw: str) -> None:
        """One line of pip's output."""
        text = raw.rstrip()
        if self.apt:
            if text.startswith(("E:", "W:")):
                self.say(text)
            elif text.startswith(("Setting up", "Unpacking", "Get:", "Hit:", "Reading")):
                self.step = text.split(" (")[0][:100]
            return
        if m := UV_SUMMARY.match(text):
            verb, n = m.groups()
            if verb == "Installed":
                self.installed = True
                self.say(f"installed {n} packages in {time.monotonic() - self.start:.0f}s")
            elif verb in ("Resolved", "Prepared"):
                self.step = f"{verb.lower()} {n} packages"
                self.say(self.step)
        elif UV_NOISE.match(text):
            self.step = text.strip()[:100]
        elif m := re.match(r"^Collecting (\S+)", text):
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
    env: dict[str, str] | None = None,
) -> int:
    """Run ``cmd`` (a pip or uv install, or ``apt``), printing ``Install``'s lines; returns its
    exit status."""
    job = Install(what, out, every, apt)
    verb = "apt-get: " if apt else "installing "
    print(f"[make] {verb}{what}", file=job.out, flush=True)
    env = dict(os.environ, **(env or {}), PYTHONUNBUFFERED="1")  # lines as they come
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
    if code != 0:
        job.say(f"{os.path.basename(cmd[0])} failed (exit {code}): {what}")
    elif apt:
        job.say(f"{what}: done in {took:.0f}s")
    elif not job.installed:
        job.say(f"{what}: already installed ({took:.0f}s)")
    return code


def pip_sources(config_list: str) -> tuple[list[str], dict[str, str]]:
    """uv's flags (and environment) for the package sources pip is configured with, from the
    output of ``pip config list`` (lines ``section.name='value'``; the highest-precedence
    section wins). A find-links or constraint path that does not exist is left out (pip warns
    and goes on; uv would stop)."""
    found: dict[str, tuple[int, str]] = {}
    for line in config_list.splitlines():
        key, sep, raw = line.partition("=")
        section, _, name = key.rpartition(".")
        if not sep or not name:
            continue
        rank = PIP_SECTIONS.index(section) if section in PIP_SECTIONS else len(PIP_SECTIONS)
        value = raw.strip().strip("'\"")
        if name not in found or rank < found[name][0]:
            found[name] = (rank, value)
    conf = {name: value for name, (_, value) in found.items()}
    exists = lambda v: "://" in v or os.path.exists(v)  # noqa: E731
    args = ["--index-strategy", "unsafe-best-match"]  # pip: the best version of any index
    if conf.get("index-url"):
        args += ["--index-url", conf["index-url"]]
    for flag, name in (("--extra-index-url", "extra-index-url"), ("--find-links", "find-links"),
                       ("--constraint", "constraint")):  # fmt: skip
        args += [x for v in conf.get(name, "").split() if exists(v) for x in (flag, v)]
    if conf.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        args.append("--no-index")
    env = {"SSL_CERT_FILE": conf["cert"]} if conf.get("cert") else {}
    return args, env


def uv_command(pip_cmd: list[str]) -> tuple[list[str], dict[str, str]] | None:
    """``PYTHON -m pip install ARGS`` as ``uv pip install --python PYTHON SOURCES ARGS`` (with
    its environment), or None where no uv is installed beside PYTHON."""
    python, rest = pip_cmd[0], pip_cmd[4:]
    uv = os.path.join(os.path.dirname(python), "uv")
    if pip_cmd[1:4] != ["-m", "pip", "install"] or not os.access(uv, os.X_OK):
        return None
    listed = subprocess.run(
        [python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    )
    sources, env = pip_sources(listed.stdout)
    args, skip = [], 0
    for word in rest:
        if skip:
            skip -= 1
        elif word in PIP_ONLY:
            skip = PIP_ONLY[word]
        else:
            args.append(word)
    return [uv, "pip", "install", "--python", python, *sources, *args], env


def run_with_uv(what: str, pip_cmd: list[str], out=None, every: float = EVERY_S) -> int:
    """The ``pip install`` done by uv where uv is there, else (or where uv fails) by pip."""
    out = out or sys.stdout
    uv = uv_command(pip_cmd)
    if uv is None:
        print(f"[make]   (no uv beside {pip_cmd[0]}: pip installs)", file=out, flush=True)
        return run(what, pip_cmd, out, every)
    cmd, env = uv
    code = run(what, cmd, out, every, env=env)
    if code == 0:
        return 0
    print(f"[make]   pip installs {what} instead", file=out, flush=True)
    return run(what, pip_cmd, out, every)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    mode = argv[0] if argv[:1] in (["--apt"], ["--uv"]) else ""
    argv = argv[1:] if mode else argv
    if "--" not in argv or argv.index("--") != 1 or len(argv) < 3:
        print(
            "usage: python tools/install_progress.py [--apt | --uv] WHAT -- COMMAND...",
            file=sys.stderr,
        )
        return 2
    if mode == "--uv":
        return run_with_uv(argv[0], argv[2:])
    return run(argv[0], argv[2:], apt=mode == "--apt")


if __name__ == "__main__":
    sys.exit(main())
