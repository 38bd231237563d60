"""scheduler/ stays pure: no simpy, cupy, numba or gguf, and no clock."""
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_import_loads_no_backend_module():
    code = ("import sys, scheduler, moelab.cli, moelab.profile_cli; "
            "print(sorted(m for m in ('simpy', 'cupy', 'numba', 'gguf', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_no_clock_reads_in_scheduler():
    clock = re.compile(r"\b(time\.(time|perf_counter|monotonic|process_time)|datetime\.now|import time\b)")
    hits = [f"{p.name}:{i}" for p in (ROOT / "scheduler").glob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if clock.search(line)]
    assert hits == []
