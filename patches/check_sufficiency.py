"""Prove that the patches/ diffs replace utils/compat.py's workarounds, and that each is needed.

    python patches/check_sufficiency.py [--work DIR] [--keep] [--torchtitan-tests]

1. Copies the installed torchtitan 0.2.2 (checked byte for byte against its wheel's RECORD) to
   scratch copies: stock, every diff applied, and every diff but one (for each diff). Each diff
   must apply on its own and all in order, without fuzz.
2. Runs tests/upstream/test_each_fix.py (one test per behaviour a fix provides; ``FIXES`` there
   names the fixes each test exercises) on each copy, each in a fork of this process (which
   imported torch, datasets and transformers once: ``PRELOAD``), with
   ``TORCHTITAN_SPEECHLM_WORKAROUNDS``:
   - stock, workarounds on:    every test passes (the workarounds do the job);
   - all diffs, workarounds off: every test passes (the diffs are sufficient);
   - stock, workarounds off:   every test fails (the job needs doing);
   - all diffs but N, off:     every test naming fix N fails (diff N is needed).
3. Runs patches/main/check_main.sh (the rebased forms apply to the recorded torchtitan main).
4. With ``--torchtitan-tests`` (650 s for the whole check): torchtitan's own tests/unit_tests
   at v0.2.2 (read from a git repository of torchtitan, ``TORCHTITAN_REPO``) on the stock copy,
   on the patched copy, and on the stock copy with our package imported first; every test's
   outcome must be the same, apart from those listed in ``EXPECTED_CHANGES``.

Exits 1 naming each condition that does not hold. About 70 s on 2 CPU cores (step 4: see
patches/README.md).
"""

from __future__ import annotations

import argparse
import ast
import base64
import csv
import hashlib
import importlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATCHES = sorted((ROOT / "patches").glob("0*.diff"))
TESTS = "tests/upstream/test_each_fix.py"
SWITCH = "TORCHTITAN_SPEECHLM_WORKAROUNDS"
# conditions run at once (PATCHES_JOBS overrides; 2: the CI machine's cores)
JOBS = int(os.environ.get("PATCHES_JOBS", "2"))
DEFAULT_REPO = "/work/.mirror/pytorch+torchtitan/repo"
# torchtitan unit tests whose outcome a diff (and our workaround of the same fix) changes, and why
EXPECTED_CHANGES: dict[str, str] = {
    "tests/unit_tests/test_checkpoint.py::TestCheckpointManager::test_save_and_purge_keeps_last_k_checkpoints": (
        "0008 / fix 8: its mocked dcp.save writes no .metadata, so every step folder looks "
        "half-written and none is purged; the main form of 0008 updates the mock to write "
        ".metadata, as DCP does"
    ),
}


def say(msg: str) -> None:
    print(f"[patches-check] {msg}", flush=True)


def installed_torchtitan() -> Path:
    """The installed package folder, verified against the wheel's RECORD (a pristine 0.2.2)."""
    dist = importlib.metadata.distribution("torchtitan")
    if dist.version != "0.2.2":
        raise SystemExit(f"torchtitan {dist.version} is installed; the diffs are for 0.2.2")
    base = Path(dist.locate_file(""))
    bad = []
    for row in csv.reader((dist.read_text("RECORD") or "").splitlines()):
        path, digest = row[0], row[1] if len(row) > 1 else ""
        if not (path.startswith("torchtitan/") and path.endswith(".py") and digest):
            continue
        algo, _, want = digest.partition("=")
        got = hashlib.new(algo, (base / path).read_bytes()).digest()
        if base64.urlsafe_b64encode(got).rstrip(b"=").decode() != want:
            bad.append(path)
    if bad:
        raise SystemExit(f"the installed torchtitan is not pristine: {bad[:5]} differ from RECORD")
    return base / "torchtitan"


def apply(diffs: list[Path], dest: Path, stock: Path) -> None:
    """dest/torchtitan = stock + diffs (each must apply without fuzz or offset trouble)."""
    shutil.copytree(stock, dest / "torchtitan", ignore=shutil.ignore_patterns("__pycache__"))
    for diff in diffs:
        r = subprocess.run(
            ["patch", "-p1", "--fuzz=0", "--no-backup-if-mismatch", "-i", str(diff)],
            cwd=dest, capture_output=True, text=True,
        )  # fmt: skip
        if r.returncode != 0:
            raise SystemExit(f"{diff.name} does not apply to {dest}:\n{r.stdout}{r.stderr}")


def fix_of(diff: Path) -> int:
    return int(diff.name[:4])


# What each condition's pytest imports before torchtitan (torch and its compiler stack, datasets,
# transformers, pytest): imported once in this process, which then forks one child per condition,
# so that a condition imports only its copy of torchtitan, our package and the tests (about 2 s of
# its 8-24 s was Python, 5 s importing these). None of them imports torchtitan.
PRELOAD = ("torch", "torch._dynamo", "torch._inductor.compile_fx", "torch.distributed.tensor",
           "torch.distributed.checkpoint", "datasets", "transformers.modeling_utils", "pytest")  # fmt: skip


def preload() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # no OpenMP pool to copy into the forks
    for name in PRELOAD:
        importlib.import_module(name)


def fork_tests(copy: Path, workarounds: str, names: list[str], out: Path) -> int:
    """Start the upstream tests on ``copy``'s torchtitan in a fork of this process (its output in
    ``out``.log, its results in ``out``.xml); returns the child's pid."""
    pid = os.fork()
    if pid:
        return pid
    code = 3
    try:
        log = os.open(out.with_suffix(".log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ[SWITCH] = workarounds
        # tests/upstream/conftest.py stops the run (exit status 4) if torchtitan is not this copy's
        os.environ["TORCHTITAN_SPEECHLM_EXPECT_TORCHTITAN"] = str(copy / "torchtitan")
        os.environ["PYTHONPATH"] = os.pathsep.join([str(copy), str(ROOT)])  # for subprocesses
        sys.path[:0] = [str(copy), str(ROOT)]
        os.chdir(ROOT)
        import pytest

        args = ["-q", "-p", "no:cacheprovider", TESTS, "-m", "upstream", "-k", " or ".join(names)]
        code = int(pytest.main([*args, f"--junitxml={out.with_suffix('.xml')}"]))
    except BaseException:
        traceback.print_exc()  # into the log: os._exit below would lose it
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def read_results(status: int, names: list[str], out: Path) -> dict[str, str]:
    """{test name: passed | failed} from a finished child's wait status and its results file."""
    if os.waitstatus_to_exitcode(status) == 4:  # (also pytest's usage error: the log says which)
        raise SystemExit(out.with_suffix(".log").read_text().strip().splitlines()[-1])
    if not out.with_suffix(".xml").is_file():
        raise SystemExit(f"the tests did not run: see {out.with_suffix('.log')}")
    results = {}
    for case in ET.parse(out.with_suffix(".xml")).iter("testcase"):
        failed = case.find("failure") is not None or case.find("error") is not None
        results[case.get("name")] = "failed" if failed else "passed"
    missing = set(names) - set(results)
    if missing:
        raise SystemExit(f"not run: {sorted(missing)} (see {out.with_suffix('.log')})")
    return results


def upstream_tests() -> dict[str, tuple[int, ...]]:
    """The tests' ``FIXES`` table, read from the file (importing it would import torch)."""
    tree = ast.parse((ROOT / TESTS).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "FIXES":
            return ast.literal_eval(node.value)
    raise SystemExit(f"{TESTS} has no FIXES table")


def check_sufficiency(work: Path, stock: Path) -> list[str]:
    fixes = upstream_tests()
    numbers = [fix_of(d) for d in PATCHES]
    problems = []
    copies = {"stock": work / "stock", "all": work / "all"}
    copies["stock"].mkdir()
    shutil.copytree(
        stock, copies["stock"] / "torchtitan", ignore=shutil.ignore_patterns("__pycache__")
    )
    for diff in PATCHES:  # each alone
        solo = work / f"only_{fix_of(diff)}"
        solo.mkdir()
        apply([diff], solo, stock)
        shutil.rmtree(solo)
    copies["all"].mkdir()
    apply(PATCHES, copies["all"], stock)
    say(f"every diff applies alone and all {len(PATCHES)} in order to torchtitan 0.2.2")

    conditions = [
        ("stock torchtitan, workarounds on", "stock", "on", list(fixes), "passed"),
        ("every diff applied, workarounds off", "all", "off", list(fixes), "passed"),
        ("stock torchtitan, workarounds off", "stock", "off", list(fixes), "failed"),
    ]
    for n in numbers:
        name = f"all_but_{n}"
        copies[name] = work / name
        copies[name].mkdir()
        apply([d for d in PATCHES if fix_of(d) != n], copies[name], stock)
        names = [t for t, f in fixes.items() if n in f]
        if not names:
            problems.append(f"no test in {TESTS} exercises fix {n}")
            continue
        conditions.append(
            (f"every diff but {n:04d}, workarounds off", name, "off", names, "failed")
        )

    def judge(condition, t0: float, status: int) -> str | None:
        label, copy, switch, names, want = condition
        got = read_results(status, names, work / f"{copy}_{switch}")
        wrong = sorted(t for t in names if got[t] != want)
        verdict = "as required" if not wrong else f"NOT {want}: {wrong}"
        say(f"{label}: {len(names)} test(s) {want} {verdict} ({time.time() - t0:.0f} s)")
        return f"{label}: {wrong} should have {want}" if wrong else None

    # each condition is its own process on its own copy (a fork of this one, after preload()):
    # JOBS at a time, started in the order given
    preload()
    pending, running = list(conditions), {}
    while pending or running:
        while pending and len(running) < JOBS:
            condition = pending.pop(0)
            _, copy, switch, names, _ = condition
            pid = fork_tests(copies[copy], switch, names, work / f"{copy}_{switch}")
            running[pid] = (condition, time.time())
        pid, status = os.wait()
        if pid in running:
            problem = judge(*running.pop(pid), status)
            if problem:
                problems.append(problem)
    return problems


def check_main_forms() -> list[str]:
    script = ROOT / "patches" / "main" / "check_main.sh"
    if not script.exists():
        return [f"{script} is missing"]
    r = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    for line in (r.stdout + r.stderr).strip().splitlines():
        say(f"main: {line}")
    return [] if r.returncode == 0 else ["the rebased (main) forms do not apply; see above"]


def torchtitan_unit_tests(work: Path, repo: str) -> list[str]:
    """torchtitan's tests/unit_tests at v0.2.2: stock, patched, stock + our package (its test
    requirements tomli_w and expecttest are in our ``dev`` extra)."""
    if not Path(repo).exists():
        say(f"torchtitan's own tests: skipped: no torchtitan repository at {repo}")
        return []
    tree = work / "tt_tests"
    names = subprocess.run(
        ["git", "-C", repo, "ls-tree", "-r", "--name-only", "v0.2.2", "tests", "scripts"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    for name in names:  # the snapshot lacks its largest files: take what is there
        blob = subprocess.run(["git", "-C", repo, "show", f"v0.2.2:{name}"], capture_output=True)
        if blob.returncode == 0:
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            (tree / name).write_bytes(blob.stdout)
    runs, setups = {}, {}
    for label, copy, plugin in (
        ("stock", work / "stock", False),
        ("patched", work / "all", False),
        ("stock + torchtitan_speechlm", work / "stock", True),
    ):
        t0 = time.time()
        setups[label] = (copy, plugin)
        runs[label] = outcome = _torchtitan_pytest(tree, copy, plugin, ["tests/unit_tests"], work)
        counts = {k: list(outcome.values()).count(k) for k in ("passed", "failure", "skipped")}
        say(f"torchtitan v0.2.2 unit tests, {label}: {counts} ({time.time() - t0:.0f} s)")
    problems = []
    base = runs["stock"]
    for label, outcome in list(runs.items())[1:]:
        changed = sorted(
            t for t in set(base) | set(outcome)
            if base.get(t) != outcome.get(t) and t not in EXPECTED_CHANGES
        )  # fmt: skip
        if changed:  # once more, both ways: a test on a fixed port can meet another process
            again = _torchtitan_pytest(tree, *setups[label], changed, work)
            stock = _torchtitan_pytest(tree, *setups["stock"], changed, work)
            changed = [t for t in changed if again.get(t) != stock.get(t)]
        if changed:
            problems.append(f"torchtitan's unit tests, {label} vs stock: {changed[:10]}")
        say(f"torchtitan's unit tests, {label} vs stock: {len(changed)} outcome(s) differ "
            f"(expected: {len(EXPECTED_CHANGES)} listed in EXPECTED_CHANGES)")  # fmt: skip
    return problems


def _torchtitan_pytest(tree: Path, copy: Path, plugin: bool, tests: list[str], work: Path):
    """{node id: passed | failure | skipped} of torchtitan's tests on ``copy``'s package."""
    link = tree / "torchtitan"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(copy / "torchtitan")
    xml = Path(tempfile.mkstemp(suffix=".xml", dir=work)[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(ROOT)]))
    env[SWITCH] = "on"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests]
    cmd += [f"--junitxml={xml}", "--continue-on-collection-errors"]
    if plugin:
        cmd += ["-p", "torchtitan_speechlm"]
    with open(xml.with_suffix(".log"), "w") as log:
        subprocess.run(cmd, env=env, cwd=tree, stdout=log, stderr=subprocess.STDOUT)
    outcome = {}
    for case in ET.parse(xml).iter("testcase"):
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        module, _, cls = case.get("classname").partition(".Test")
        node = module.replace(".", "/") + ".py" + (f"::Test{cls}" if cls else "")
        outcome[f"{node}::{case.get('name')}"] = "failure" if kind == "error" else kind
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", help="scratch folder (default: a new temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    parser.add_argument("--torchtitan-tests", action="store_true",
                        help="also run torchtitan's own v0.2.2 unit tests three ways")  # fmt: skip
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="patches_check_"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    try:
        problems = check_sufficiency(work, installed_torchtitan())
        problems += check_main_forms()
        if args.torchtitan_tests:
            repo = os.environ.get("TORCHTITAN_REPO", DEFAULT_REPO)
            problems += torchtitan_unit_tests(work, repo)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    for p in problems:
        say(f"FAILED: {p}")
    say(f"{'FAILED' if problems else 'passed'} in {time.time() - t0:.0f} s")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
