"""Rebuild the bundled default trace, traces/data/granite-3.0-1b-a400m/, from the original JSON.

Usage: python experiments/traces_bundle_granite.py SRC_DIR
SRC_DIR holds moe_expert_trace.json and LICENSE (onnx-genai @ac9c7dd, scripts/). The converted
trace directory is written atomically; the original JSON, its LICENSE and SOURCE.md go beside it.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

from traces import default_trace_path
from traces.importers import import_granite

SOURCE_MD = """# granite-3.0-1b-a400m routing trace

- Model: ibm-granite/granite-3.0-1b-a400m-instruct, ONNX f16, greedy decoding; 24 MoE layers x 32
  experts, top-8. Three prompts (english_prose, code, math), each with its prefill rows (39/44/29
  positions) and 64 decode steps, in token order; expert ids in router-rank order; no router
  probabilities.
- Source: github.com/justinchuby/onnx-genai at commit ac9c7dd, file scripts/moe_expert_trace.json
  (copied here unchanged as `moe_expert_trace.json`).
- License: MIT, Copyright (c) 2026 Justin Chu; see `LICENSE` beside this file.
- Converted to moelab's trace schema (trace.json + .npy arrays in this directory) with
  `moelab trace import granite moe_expert_trace.json DEST` (this directory was built by
  experiments/traces_bundle_granite.py). Sequence ids 0/1/2 follow the prompts' order; positions
  count from 0 at the first prompt token; decode rows follow their prompt's prefill rows.
"""


def main(argv: list[str]) -> int:
    src = Path(argv[0])
    trace = import_granite(src / "moe_expert_trace.json")
    trace.meta.update({"license": "MIT", "origin": "github.com/justinchuby/onnx-genai@ac9c7dd scripts/moe_expert_trace.json",
                       "model_id": "ibm-granite/granite-3.0-1b-a400m-instruct"})
    dest = default_trace_path()
    trace.save(dest)
    shutil.copyfile(src / "moe_expert_trace.json", dest / "moe_expert_trace.json")
    shutil.copyfile(src / "LICENSE", dest / "LICENSE")
    (dest / "SOURCE.md").write_text(SOURCE_MD)
    print(f"wrote {dest} ({len(trace)} rows)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
