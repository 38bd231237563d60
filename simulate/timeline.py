"""Chrome-trace JSON (opens in Perfetto / chrome://tracing) from a recorded simulation."""
from __future__ import annotations

import json
import os

from scheduler.files import atomic_open

__all__ = ["write_chrome_trace", "LANES"]

# lane -> (thread id, name shown)
LANES = {"token": (0, "tokens"), "gpu": (1, "GPU compute stream"), "copy": (2, "copy stream (H2D)"),
         "cpu": (3, "CPU pool")}


def write_chrome_trace(events, path: str | os.PathLike, title: str = "moelab simulate") -> int:
    """Write ``events`` ((lane, name, start_s, dur_s) tuples) as complete ('X') events in
    microseconds, one thread per lane, atomically. Returns the number of events written."""
    out = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": title}}]
    for tid, name in LANES.values():
        out.append({"ph": "M", "pid": 1, "tid": tid, "name": "thread_name", "args": {"name": name}})
        out.append({"ph": "M", "pid": 1, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
    for lane, name, start, dur in events:
        out.append({"ph": "X", "pid": 1, "tid": LANES[lane][0], "name": name, "ts": round(start * 1e6, 3),
                    "dur": round(dur * 1e6, 3)})
    with atomic_open(path, "w") as f:
        json.dump({"traceEvents": out, "displayTimeUnit": "ms"}, f)
    return len(events)
