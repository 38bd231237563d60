"""Opening a GGUF model: gguf-py's ``GGUFReader`` vs ``execute.gguf_io``'s own parser, side by side.

The model is ``moelab model synth``'s tiny qwen3moe with a ``--vocab``-entry vocabulary (151,936 by
default, Qwen's size: tokens, token types and one merge per entry in the metadata), written into a
temporary folder. Measured, best of ``--repeats`` (the GGUFReader once when ``--repeats`` is 1):

- ``gguf_reader_s``: ``gguf.GGUFReader(path)``, what ``read_model_info`` and ``load_model`` spent
  opening a file before they parsed it themselves (the ModelInfo built afterwards is the same code);
- ``read_model_info_s``: ``gguf_io.read_model_info`` (header, metadata, tensor table);
- ``load_model_s``: ``gguf_model.load_model`` (the same, plus the dense weights dequantized);
- ``read_tokenizer_s``: ``gguf_io.read_tokenizer`` (the vocabulary decoded into Python lists).

    python experiments/gguf_open_speed.py [--vocab 151936] [--repeats 3] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from execute import gguf_io, gguf_model, synth  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tokenizer_speed import _best  # noqa: E402  the same best-of-n timer


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151936, help="vocabulary entries (default 151936)")
    ap.add_argument("--repeats", type=int, default=3, help="repetitions, best kept (default 3)")
    ap.add_argument("--out", help="also write the figures and the arguments to this JSON file")
    a = ap.parse_args(argv)
    if a.vocab < synth.min_vocab("qwen3moe") or a.repeats < 1:
        ap.error(f"--vocab >= {synth.min_vocab('qwen3moe')} and --repeats >= 1 expected")
    import gguf

    res = {"args": vars(a)}
    with tempfile.TemporaryDirectory() as tmp:
        path = synth.synth_model(Path(tmp) / "m.gguf", synth.config_from_preset("tiny", vocab=a.vocab))
        res["file_mib"] = path.stat().st_size / 2**20
        res["gguf_reader_s"] = _best(lambda: gguf.GGUFReader(path), 1)
        res["read_model_info_s"] = _best(lambda: gguf_io.read_model_info(path), a.repeats)
        res["load_model_s"] = _best(lambda: gguf_model.load_model(path), a.repeats)
        res["read_tokenizer_s"] = _best(lambda: gguf_io.read_tokenizer(path), a.repeats)
    res["speedup"] = res["gguf_reader_s"] / res["read_model_info_s"]
    print(f"vocabulary of {a.vocab} ({res['file_mib']:.1f} MiB file): GGUFReader {res['gguf_reader_s']:.2f} s; "
          f"read_model_info {res['read_model_info_s'] * 1e3:.1f} ms ({res['speedup']:.0f}x less); "
          f"load_model {res['load_model_s'] * 1e3:.1f} ms; read_tokenizer {res['read_tokenizer_s'] * 1e3:.1f} ms")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
