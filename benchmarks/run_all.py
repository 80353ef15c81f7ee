"""`make bench`: every benchmark, results in benchmarks/results/ (never run by CI)."""

import subprocess
import sys

BENCHES = [
    ["benchmarks/bench_loader.py"],
    ["benchmarks/bench_vs_llama3.py"],
    ["benchmarks/bench_prepare.py"],
    ["benchmarks/bench_decode.py"],
]

if __name__ == "__main__":
    failed = [b[0] for b in BENCHES if subprocess.call([sys.executable, *b]) != 0]
    if failed:
        print(f"failed: {failed}", file=sys.stderr)
    sys.exit(1 if failed else 0)
