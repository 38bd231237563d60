"""Loading a large vocabulary and encoding long unbroken text, measured side by side in one run.

The vocabulary is ``execute.synth.vocabulary`` at ``--vocab`` entries (151,936 by default, Qwen's
size; one merge per entry), written as GGUF metadata with one small tensor into a temporary folder.
Measured:

- loading: gguf-py's ``GGUFReader`` opening the file (what reading the tokenizer cost before
  ``gguf_io.read_tokenizer`` parsed the metadata itself) vs ``gguf_io.read_tokenizer``, and building
  ``Tokenizer`` from its result; best of ``--repeats``;
- encoding: random CJK ideographs in one run with no break, which the ``qwen2`` pre-tokenizer keeps
  as one word, at 1k, 4k and 16k characters (cache cleared before each); microseconds per character
  and the ratio of the longest run's per-character time to the shortest's (about 1 for linear
  cost; a merge loop that rescans the word is quadratic and shows the ratio growing with length).

    python experiments/tokenizer_speed.py [--vocab 151936] [--repeats 3] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from execute import gguf_io, synth  # noqa: E402
from execute.tokenizer import Tokenizer  # noqa: E402

LENGTHS = (1000, 4000, 16000)


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151936, help="vocabulary entries (default 151936)")
    ap.add_argument("--repeats", type=int, default=3, help="repetitions, best kept (default 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="also write the figures and the arguments to this JSON file")
    a = ap.parse_args(argv)
    if a.vocab < synth.min_vocab("qwen3moe") or a.repeats < 1:
        ap.error(f"--vocab >= {synth.min_vocab('qwen3moe')} and --repeats >= 1 expected")
    import gguf

    cfg = synth.SynthConfig(vocab=a.vocab)
    one = gguf_io.TensorSpec("x", (32,), gguf_io.qtype_value("F32"), lambda: np.zeros(32, np.float32))
    res = {"args": vars(a)}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "vocab.gguf"
        gguf_io.write_gguf(path, "qwen3moe", synth._tokenizer_metadata(cfg), [one])
        res["gguf_reader_s"] = _best(lambda: gguf.GGUFReader(path), 1)
        res["read_tokenizer_s"] = _best(lambda: gguf_io.read_tokenizer(path), a.repeats)
        meta = gguf_io.read_tokenizer(path)
        res["build_s"] = _best(lambda: Tokenizer(meta, str(path)), a.repeats)
    print(f"vocabulary of {a.vocab}: GGUFReader {res['gguf_reader_s']:.2f} s, read_tokenizer "
          f"{res['read_tokenizer_s']:.3f} s ({res['gguf_reader_s'] / res['read_tokenizer_s']:.0f}x less), "
          f"Tokenizer build {res['build_s']:.3f} s; load total {res['read_tokenizer_s'] + res['build_s']:.3f} s")
    tok = Tokenizer(meta)
    rng = random.Random(a.seed)
    per_char = {}
    for n in LENGTHS:
        text = "".join(chr(rng.randrange(0x4E00, 0x9FA5)) for _ in range(n))

        def encode():
            tok._cache.clear()
            tok.encode(text)

        per_char[n] = _best(encode, a.repeats) / n
        print(f"encode {n:6d} CJK characters: {per_char[n] * n:.3f} s, {per_char[n] * 1e6:.1f} us/char")
    ratio = per_char[LENGTHS[-1]] / per_char[LENGTHS[0]]
    print(f"per-character time at {LENGTHS[-1]} vs {LENGTHS[0]}: {ratio:.2f}x")
    res.update(encode_us_per_char={str(n): v * 1e6 for n, v in per_char.items()}, per_char_ratio=ratio)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
