"""moelab's pre-tokenizers against Hugging Face ``tokenizers`` running the models' original patterns.

llama.cpp rewrites each model's pre-tokenizer pattern for its regex engine (case-insensitive
groups spelled out, ``\\p{..}`` classes collapsed); moelab follows llama.cpp. This script splits
``--texts`` random strings (words, digits, whitespace runs, six scripts with combining marks, CJK,
emoji, URLs, joined with no separator; seed ``--seed``) with ``execute.tokenizer.pre_split`` and
with ``tokenizers.pre_tokenizers.Split`` (behavior "isolated") over the original patterns from the
models' tokenizer.json, and counts the strings split identically. Where llama.cpp's rewrite
differs from the original (gpt-4o: its letter classes leave combining marks out), moelab is
expected to differ too; the first differences are printed. Then, on the synthetic byte-level
vocabulary of ``--vocab`` entries (``execute.synth.vocabulary``), the token ids of moelab's
``Tokenizer`` and of a ``tokenizers`` BPE model (byte-level, ``ignore_merges`` for llama-bpe) over
the same strings.

``tokenizers`` is not a moelab dependency: install it beside, e.g.
``pip install --target /tmp/hf tokenizers``, then

    PYTHONPATH=/tmp/hf python experiments/pretokenizer_vs_hf.py [--texts 3000] [--seed 1] [--vocab 151936]
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from execute.synth import vocabulary  # noqa: E402
from execute.tokenizer import PRE_TOKENIZERS, Tokenizer, pre_split  # noqa: E402

_C = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_CASED = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _C + "?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _C + "?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
ORIGINAL = {  # pre name -> the model's own patterns (tokenizer.json), applied in turn
    "gpt-2": [r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"],
    "llama-bpe": [_C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "qwen2": [_C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "qwen35": [_C + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "deepseek-v3": [r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
                    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "gpt-4o": [_CASED],
}
POOL = ["Hello", " world", "it's", "IT'S", "don't", "12345", "3.14", " ", "  ", "\n", "\n\n", "\t", "नमस्ते", "দুনিয়া",
        "தமிழ்", "สวัสดี", "مرحبا", "日本語", "のテキスト", "中文", "한국어", "😀", "👍🏽", "café", "naïve", "e\u0301",
        "__init__", "x=1;", "https://a.b/c?d=e", "$100", "½", "²", "Ⅻ", "\u00a0", "\u3000", "CamelCase", "HTTPServer",
        "—", "…", "«", "»", "'", "ǅ"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--texts", type=int, default=3000, help="random strings (default 3000)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=151936, help="synthetic vocabulary size for the ids (default 151936)")
    a = ap.parse_args(argv)
    try:
        from tokenizers import Regex, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:
        print("pretokenizer_vs_hf: the tokenizers package is needed (see the docstring)", file=sys.stderr)
        return 2
    rng = random.Random(a.seed)
    texts = ["".join(rng.choice(POOL) for _ in range(rng.randrange(1, 12))) for _ in range(a.texts)]
    for name, patterns in ORIGINAL.items():
        hf = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns])
        diff = [(t, [w for w, _ in hf.pre_tokenize_str(t)], pre_split(t, name)) for t in texts]
        diff = [d for d in diff if d[1] != d[2]]
        print(f"{name:12s} {len(texts) - len(diff)}/{len(texts)} strings split identically")
        for t, want, got in diff[:2]:
            print(f"    {t!r}\n      original: {want}\n      moelab:   {got}")
    tokens, types, merges = vocabulary(a.vocab)
    ids = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    for name in ("qwen2", "llama-bpe", "deepseek-v3", "qwen35"):
        hf = HFTokenizer(models.BPE(ids, pairs, ignore_merges=PRE_TOKENIZERS[name].ignore_merges))
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in ORIGINAL[name]]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        ours = Tokenizer({"model": "gpt2", "pre": name, "tokens": tokens, "token_type": types, "merges": merges})
        same = sum(hf.encode(t, add_special_tokens=False).ids == ours.encode(t, add_bos=False) for t in texts)
        print(f"{name:12s} {same}/{len(texts)} strings with identical ids ({a.vocab}-entry vocabulary)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
