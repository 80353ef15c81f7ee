"""Serving: `torchtitan serve` at 1, 4 and 16 concurrent clients against sequential
`torchtitan generate` CLI calls, requests/s and p50/p95 latency, in the same run.

The model has the shape of `make demo`'s (a Llama backbone, hidden 256, 6 layers, 4 heads,
FFN 768) over the tests' tiny Encodec (4 codebooks, 50 frames/s at 16 kHz), trained --steps
steps on the tiny synthetic corpus and exported (tests/helpers.py ``tiny_export``). Every request
speaks one sentence for exactly --frames frames (``--min-frames`` = ``--max-frames``: the same
work per request, whatever the model would choose), greedy, on the CPU. The CLI baseline runs
--cli-calls `torchtitan generate --task tts` processes one after another (each one starts
Python, imports torch, loads the model, speaks, writes the wav); the server is started once
(not timed), warmed up with 2 requests, then each concurrency level sends --requests requests
from that many client threads in a closed loop (each thread its own keep-alive connection).
The server's /metrics before and after each level gives its batches and mean batch size
(summed over ``--replicas``).
Then, on the same server: ``--slow-clients`` connections send a request's headers and then
nothing for ``--slow-seconds`` (the server's ``--body-timeout``, then answers them 408) while the first level runs again
(its p95 beside the one without them); and a ``--burst`` of 64 clients x 5 requests, each on a
fresh connection with its own text (a 503 retried after Retry-After): every request answered
exactly once, the server's own count equal, and the server's resident memory (its replica
processes included) before, at peak and after. Last, SIGTERM: the exit status of the drain.
Results: benchmarks/results/serve_cpu.json.

``--engines ours,vllm`` (with ``--vllm-python``) compares the engines instead (docs/serving.md,
*--engine vllm*): the model is trained with the ``flatten`` pattern (the one vLLM can serve),
and for each engine in turn a server is started (its start timed: for vLLM the export and
vLLM's own start), warmed up, and the concurrency levels run against it, then SIGTERM; no CLI
baseline, slow clients or burst. Results: benchmarks/results/serve_cpu_vllm.json (each
engine's levels, start and exit status, and vllm / ours per level).

    python benchmarks/bench_serve.py [--frames 50] [--requests 48] [--cli-calls 16] [--concurrency 1,4,16] [--replicas 1]
    python benchmarks/bench_serve.py --engines ours,vllm --vllm-python /tmp/vllm_venv/bin/python --frames 25 --requests 16

Smallest setting (a smoke test of the script): ``--frames 2 --requests 2 --cli-calls 1
--concurrency 1,2 --hidden 32 --layers 1 --slow-clients 1 --slow-seconds 2 --burst 4x2
--work DIR --out FILE``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "She sells fresh bread at the corner market.",
    "Please close the window before you leave.",
    "The train to the city leaves at noon.",
]


def _pythonpath() -> str:
    """The repository first, then the caller's path (a GPU image's wheels under /tmp/site)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frames", type=int, default=50, help="audio frames per request (50 = 1 s)")
    p.add_argument("--requests", type=int, default=48, help="requests per concurrency level")
    p.add_argument("--cli-calls", type=int, default=16, help="sequential `generate` calls")
    p.add_argument("--concurrency", default="1,4,16", help="client threads, one level each")
    p.add_argument("--max-batch", type=int, default=8, help="the server's --max-batch")
    p.add_argument("--batch-wait-ms", type=float, default=10.0, help="the server's window")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--steps", type=int, default=2, help="training steps before the export")
    p.add_argument("--work", help="where the model is made (default: a temporary folder)")
    p.add_argument("--device", default="cpu", help="the server's and the CLI's device (cuda)")
    p.add_argument("--replicas", type=int, default=1, help="the server's --replicas")
    p.add_argument(
        "--slow-clients",
        type=int,
        default=4,
        help="connections that send a request's headers, then nothing (0: skip)",
    )
    p.add_argument("--slow-seconds", type=float, default=60.0, help="their silence")
    p.add_argument(
        "--burst",
        default="64x5",
        help="CLIENTSxREQUESTS each, fresh connections "
        "(503s are retried after Retry-After); '' skips it",
    )
    p.add_argument(
        "--engines",
        default="ours",
        help="ours (the serving benchmark above) or a comparison of engines on one flatten "
        "model, e.g. ours,vllm",
    )
    p.add_argument("--vllm-python", help="with --engines ...vllm: a Python with vLLM")
    p.add_argument(
        "--vllm-arg",
        action="append",
        help="the server's --vllm-arg (e.g. --vllm-arg=--enforce-eager)",
    )
    p.add_argument(
        "--out",
        help="default: benchmarks/results/serve_cpu.json, or serve_cpu_vllm.json with --engines",
    )
    return p


def make_model(a, work: str) -> str:
    sys.path.insert(0, str(ROOT))
    from tests.helpers import tiny_export

    out = tiny_export(
        os.path.join(work, "model"), steps=a.steps, n_items=4, fresh=True, family="llama",
        hidden_size=a.hidden, num_layers=a.layers, num_heads=a.heads, num_kv_heads=a.heads,
        intermediate_size=3 * a.hidden, pattern="delay" if a.engines == "ours" else "flatten",
    )  # fmt: skip
    return out["export"]


def decoding(a) -> list[str]:
    return ["--min-frames", str(a.frames), "--max-frames", str(a.frames), "--device", a.device]


def summary(latencies: list[float], wall: float) -> dict:
    ordered = sorted(latencies)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {
        "requests": len(latencies),
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(latencies) / wall, 3),
        "p50_ms": round(1000 * statistics.median(ordered), 1),
        "p95_ms": round(1000 * pick(0.95), 1),
        "mean_ms": round(1000 * statistics.fmean(ordered), 1),
    }


def cli_calls(a, model: str, work: str) -> dict:
    env = dict(os.environ, PYTHONPATH=_pythonpath())
    latencies = []
    t0 = time.perf_counter()
    for i in range(a.cli_calls):
        cmd = [sys.executable, "-m", "torchtitan_speechlm.cli", "generate", "--model", model,
               "--task", "tts", "--text", SENTENCES[i % len(SENTENCES)],
               "--out", os.path.join(work, f"cli{i}.wav"), *decoding(a)]  # fmt: skip
        t = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
        latencies.append(time.perf_counter() - t)
        if r.returncode != 0:
            raise SystemExit(f"torchtitan generate failed: {r.stderr[-2000:]}")
    return summary(latencies, time.perf_counter() - t0)


class Server:
    def __init__(self, a, model: str, engine: list[str] | None = None,
                 own_session: bool = False):  # fmt: skip
        cmd = [sys.executable, "-m", "torchtitan_speechlm.cli", "serve", "--model", model,
               "--port", "0", "--max-batch", str(a.max_batch),
               "--batch-wait-ms", str(a.batch_wait_ms), "--replicas", str(a.replicas),
               "--body-timeout", str(a.slow_seconds), *decoding(a), *(engine or [])]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=_pythonpath(), PYTHONUNBUFFERED="1")
        t0 = time.perf_counter()
        # own_session: its own session, so its own scheduling group where the kernel groups
        # by session (autogroup): what other processes of this script's session do on other
        # cores (an attacker's threads) does not shrink its share of its own core
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, cwd=ROOT,
                                     start_new_session=own_session)  # fmt: skip
        self.lines: list[str] = []
        for line in self.proc.stdout:
            self.lines.append(line)
            if " on http://" in line and line.startswith("torchtitan serve:"):
                self.start_s = round(time.perf_counter() - t0, 1)
                host_port = line.split(" on http://")[1].split()[0]
                self.host, port = host_port.rsplit(":", 1)
                self.port = int(port)
                break
        else:
            raise SystemExit("torchtitan serve did not start:\n" + "".join(self.lines[-30:]))
        threading.Thread(target=lambda: [self.lines.append(x) for x in self.proc.stdout],
                         daemon=True).start()  # fmt: skip

    def health(self) -> dict:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        conn.request("GET", "/health")
        return json.loads(conn.getresponse().read())

    def counters(self) -> dict:
        """Speech answered and tts batches run, from /metrics: the sums over every replica
        (/health is the answering replica's own)."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        want = {"served": 'speechlm_requests_total{route="/v1/audio/speech",status="200"} ',
                "batches": 'speechlm_batch_size_count{task="tts"} '}  # fmt: skip
        return {k: float(text.split(v)[1].split()[0]) if v in text else 0.0
                for k, v in want.items()}  # fmt: skip

    def rss_mb(self) -> float:
        """Resident memory of the server and every process under it (its replicas; a vLLM
        server and its engine core) (MB)."""
        pids, todo = [], [self.proc.pid]
        while todo:
            pids.append(todo.pop())
            todo += children(pids[-1])
        return round(sum(rss_kb(p) for p in pids) / 1024, 1)

    def close(self) -> int:
        self.proc.terminate()
        return self.proc.wait(120)


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def speak(conn: http.client.HTTPConnection, text: str) -> None:
    body = json.dumps({"model": "m", "input": text, "voice": "alloy", "response_format": "wav"})
    conn.request("POST", "/v1/audio/speech", body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    if r.status != 200 or len(data) <= 44:
        raise RuntimeError(f"speech answered {r.status}: {data[:300]!r}")


def run_threads(threads: list[threading.Thread]) -> float:
    """Start the client threads, wait for all: the wall time."""
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def level(server: Server, clients: int, requests: int) -> dict:
    """``requests`` speech requests from ``clients`` threads, closed loop."""
    before = server.counters()
    latencies: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    issued = [0]

    def client() -> None:
        conn = http.client.HTTPConnection(server.host, server.port, timeout=600)
        while True:
            with lock:
                if issued[0] >= requests:
                    return
                i = issued[0]
                issued[0] += 1
            t = time.perf_counter()
            try:
                speak(conn, SENTENCES[i % len(SENTENCES)])
            except Exception as e:
                errors.append(e)
                return
            with lock:
                latencies.append(time.perf_counter() - t)

    wall = run_threads([threading.Thread(target=client) for _ in range(clients)])
    if errors:
        raise SystemExit(f"{len(errors)} requests failed at {clients} clients: {errors[0]}")
    after = server.counters()
    batches = int(after["batches"] - before["batches"])
    return {
        "clients": clients,
        **summary(latencies, wall),
        "batches": batches,
        "mean_batch_size": round(requests / batches, 2) if batches else 0.0,
    }


def slow_clients(server: Server, n: int, seconds: float) -> list:
    """``n`` connections that send a speech request's headers (Content-Length 100) and then
    nothing for ``seconds``: they must hold up no one else. Returns the threads (joined later)
    and fills each one's outcome."""
    import socket

    outcomes: list = []

    def one() -> None:
        s = socket.create_connection((server.host, server.port), timeout=seconds + 120)
        s.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: 100\r\n\r\n")  # fmt: skip
        t = time.perf_counter()
        try:
            head = s.recv(200).split(b"\r\n", 1)[0].decode(errors="replace")
        except OSError as e:
            head = f"{type(e).__name__}"
        outcomes.append({"answer": head, "after_s": round(time.perf_counter() - t, 1)})
        s.close()

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return [threads, outcomes]


def burst(server: Server, clients: int, each: int) -> dict:
    """``clients`` threads send ``each`` requests, each on a fresh connection with its own
    text; every request must be answered once with speech (a 503 is retried after its
    Retry-After); the server's counters must grow by exactly the requests answered."""
    before = server.counters()
    rss_before = server.rss_mb()
    answered: dict[str, int] = {}
    retried, errors, lock, peak = [0], [], threading.Lock(), [rss_before]

    def client(c: int) -> None:
        for k in range(each):
            text = f"{SENTENCES[(c + k) % len(SENTENCES)]} Request {c} {k}."
            while True:
                conn = http.client.HTTPConnection(server.host, server.port, timeout=600)
                body = json.dumps({"model": "m", "input": text, "response_format": "wav"})
                try:
                    conn.request("POST", "/v1/audio/speech", body,
                                 {"Content-Type": "application/json"})  # fmt: skip
                    r = conn.getresponse()
                    data = r.read()
                except Exception as e:
                    with lock:
                        errors.append(repr(e))
                    return
                finally:
                    conn.close()
                if r.status == 503:
                    with lock:
                        retried[0] += 1
                    time.sleep(float(r.getheader("Retry-After") or 1))
                    continue
                with lock:
                    if r.status == 200 and data[:4] == b"RIFF":
                        answered[text] = answered.get(text, 0) + 1
                    else:
                        errors.append(f"{r.status} {data[:200]!r}")
                break

    def watch(stop: threading.Event) -> None:
        while not stop.wait(0.5):
            peak[0] = max(peak[0], server.rss_mb())

    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=(stop,), daemon=True)
    watcher.start()
    wall = run_threads([threading.Thread(target=client, args=(c,)) for c in range(clients)])
    stop.set()
    served = int(server.counters()["served"] - before["served"])
    return {
        "clients": clients, "requests_each": each, "wall_s": round(wall, 1),
        "answered_once": sum(1 for v in answered.values() if v == 1),
        "answered_twice_or_more": sum(1 for v in answered.values() if v > 1),
        "lost": clients * each - len(answered), "errors": errors[:5],
        "retried_after_503": retried[0], "server_counted": served,
        "rss_mb_before": rss_before, "rss_mb_peak": peak[0], "rss_mb_after": server.rss_mb(),
    }  # fmt: skip


def run_levels(server, levels: list[int], requests: int, name: str) -> dict:
    """A warm-up, then ``requests`` requests at each concurrency level, each printed."""
    level(server, 1, 2)  # warm-up
    out = {}
    for c in levels:
        out[str(c)] = level(server, c, requests)
        print(json.dumps({f"{name}_{c}": out[str(c)]}), flush=True)
    return out


def compare_engines(a, model: str, levels: list[int], result: dict) -> None:
    """Each engine of --engines on the same model in turn: its start, its levels, SIGTERM."""
    result["engines"] = {}
    for name in a.engines.split(","):
        flags = ["--engine", name]
        if name == "vllm":
            if not a.vllm_python:
                raise SystemExit("--engines with vllm needs --vllm-python PATH")
            flags += ["--vllm-python", a.vllm_python]
            flags += [f"--vllm-arg={x}" for x in a.vllm_arg or []]
        server = Server(a, model, flags)
        row: dict = {"start_s": server.start_s,
                     "load_average_at_start": [round(x, 2) for x in os.getloadavg()]}  # fmt: skip
        try:
            row["levels"] = run_levels(server, levels, a.requests, name)
            row["rss_mb"] = server.rss_mb()
        finally:
            row["exit_status_on_sigterm"] = server.close()
        row["startup_lines"] = [x.strip() for x in server.lines if x.startswith(("vllm", "engine"))]
        result["engines"][name] = row
    names = a.engines.split(",")
    if len(names) == 2:
        first, second = (result["engines"][n]["levels"] for n in names)
        result["ratios"] = {
            f"{names[1]}_over_{names[0]}_{c}": {
                "requests_per_s": round(
                    second[str(c)]["requests_per_s"] / first[str(c)]["requests_per_s"], 2
                ),
                "p95": round(second[str(c)]["p95_ms"] / first[str(c)]["p95_ms"], 2),
            }
            for c in levels
        }
        print(json.dumps({"ratios": result["ratios"]}), flush=True)


def main(argv=None) -> None:
    a = build_parser().parse_args(argv)
    name = "serve_cpu.json" if a.engines == "ours" else "serve_cpu_vllm.json"
    a.out = a.out or str(ROOT / "benchmarks" / "results" / name)
    levels = [int(c) for c in a.concurrency.split(",")]
    work = a.work or tempfile.mkdtemp(prefix="bench_serve_")
    os.makedirs(work, exist_ok=True)
    t_make = time.perf_counter()
    model = make_model(a, work)
    print(f"model exported in {time.perf_counter() - t_make:.0f} s: {model}", flush=True)
    import torch

    result = {
        "shape": {"family": "llama", "hidden": a.hidden, "layers": a.layers, "heads": a.heads,
                  "ffn": 3 * a.hidden, "codec": "tiny Encodec, 4 codebooks, 50 frames/s"},
        "frames_per_request": a.frames,
        "requests_per_level": a.requests,
        "server": {"max_batch": a.max_batch, "batch_wait_ms": a.batch_wait_ms,
                   "replicas": a.replicas, "stack": "FastAPI + uvicorn"},
        "device": a.device,
        "machine": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],  # a shared machine
    }  # fmt: skip
    if a.engines != "ours":
        result["pattern"] = "flatten"
        result["engines_compared"] = a.engines
        compare_engines(a, model, levels, result)
        return write(a, result)
    result["cli_sequential"] = cli_calls(a, model, work)
    print(json.dumps({"cli_sequential": result["cli_sequential"]}), flush=True)
    server = Server(a, model)
    try:
        result["serve"] = run_levels(server, levels, a.requests, "serve")
        if a.slow_clients:
            threads, outcomes = slow_clients(server, a.slow_clients, a.slow_seconds)
            time.sleep(1.0)  # they are connected and silent
            with_slow = level(server, levels[0], a.requests)
            result["slow_clients"] = {
                "connections": a.slow_clients, "silence_s": a.slow_seconds,
                f"serve_{levels[0]}_meanwhile": with_slow,
                "p95_ratio_to_without": round(
                    with_slow["p95_ms"] / result["serve"][str(levels[0])]["p95_ms"], 2),
            }  # fmt: skip
            for t in threads:
                t.join(a.slow_seconds + 150)
            result["slow_clients"]["their_answers"] = outcomes
            print(json.dumps({"slow_clients": result["slow_clients"]}), flush=True)
        if a.burst:
            clients, each = (int(x) for x in a.burst.lower().split("x"))
            result["burst"] = burst(server, clients, each)
            print(json.dumps({"burst": result["burst"]}), flush=True)
    finally:
        result["server_exit_status_on_sigterm"] = server.close()
    cli = result["cli_sequential"]
    result["ratios"] = {
        f"serve_{c}_vs_cli_requests_per_s": round(
            result["serve"][str(c)]["requests_per_s"] / cli["requests_per_s"], 2
        )
        for c in levels
    }
    result["ratios"][f"cli_p50_over_serve_{levels[0]}_p50"] = round(
        cli["p50_ms"] / result["serve"][str(levels[0])]["p50_ms"], 2
    )
    print(json.dumps({"ratios": result["ratios"]}), flush=True)
    write(a, result)


def write(a, result: dict) -> None:
    result["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
