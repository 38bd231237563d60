"""Text in and out from a GGUF file's vocabulary, following llama.cpp's tokenizer: byte-level BPE
("gpt2") with its pre-tokenizers, SentencePiece ("llama"), and the common chat-template shapes.

- **Special tokens**: the text is first cut at control, user-defined and unknown tokens written in
  it, longest token first, each over the whole text before the next; control and unknown tokens
  only when ``special=True`` (chat prompts), user-defined ones (``<think>``) always. Control tokens
  are left out of decoded text.
- **BPE** (``tokenizer.ggml.model = "gpt2"``): each text piece is split by the pre-tokenizer that
  ``tokenizer.ggml.pre`` names (:data:`PRE_TOKENIZERS`; a name not there is refused, a missing
  one is ``default``). A pre-tokenizer is a list of patterns applied in turn: each pattern cuts
  every piece into its matches and the text between them, so the first pattern's splits hold
  (the digits-first rules of ``deepseek-v3``, ``refact``). Each word is mapped to GPT-2's byte
  alphabet; under ``ignore_merges`` (the llama-3 family) a word that is a vocabulary entry is
  one token; otherwise the adjacent pair of lowest merge rank is merged (ties: leftmost) until
  none is left, with a heap, so a word of n bytes costs O(n log n).
- **Character classes**, as llama.cpp evaluates them: a pattern that uses ``\\p{..}`` runs on a
  copy of the text where every character above 127 stands for its class (one code point each
  for letters, numbers, punctuation, marks, symbols, other; whitespace becomes ``\\v``), so
  ``\\p{L}`` is ASCII letters plus that letter code point (``\\p{Lu}`` and the other letter
  subclasses are all of ``\\p{L}``, as in llama.cpp); ``[A-Za-z]`` stays ASCII. ``kimi-k2``
  (llama.cpp splits it by hand) gives Han ideographs a class of their own, ``\\p{Han}``.
  Patterns without classes run on the text itself, whitespace above 127 again as ``\\v``.
  ``\\s`` is ASCII whitespace. Classes come from Python's ``unicodedata``, whose Unicode
  version may differ from llama.cpp's tables in rare characters. Where llama.cpp's rewrite of a
  model's pattern differs from the original, moelab follows llama.cpp: ``gpt-4o``'s letter
  classes leave combining marks out (``experiments/pretokenizer_vs_hf.py`` compares the two).
- **SentencePiece** (``"llama"``): spaces become U+2581 (with a leading one when
  ``add_space_prefix``, at the start and after a special token), then the adjacent pair whose
  concatenation is a piece of highest score is merged (ties: leftmost), with a heap; symbols not
  in the vocabulary fall back to ``<0xXX>`` byte tokens (or ``<unk>``).
- **Chat templates**: no Jinja engine; :meth:`Tokenizer.chat_prompt` recognises the template by
  its markers and writes the one-user-turn prompt of that shape: ChatML (``<|im_start|>``),
  Mistral/Llama-2 (``[INST]``), gpt-oss harmony (``<|start|>...<|message|>``) and Granite
  (``<|start_of_role|>``). Any other template is reported as unrecognised.
"""
from __future__ import annotations

import codecs
import functools
import heapq
import os
import re
import unicodedata
from dataclasses import dataclass

__all__ = ["Tokenizer", "TokenizerError", "StreamDecoder", "PreTokenizer", "PRE_TOKENIZERS", "byte_alphabet",
           "CHAT_SHAPES"]

_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _BYTE = 1, 2, 3, 4, 6
_SPACE = "\u2581"
_CACHE_WORDS = 1 << 16  # BPE results kept per tokenizer before the cache is cleared


@dataclass(frozen=True)
class PreTokenizer:
    """Patterns (llama.cpp's syntax, applied in turn) and whether a word in the vocabulary is
    emitted whole (``ignore_merges``); ``add_bos`` is the default when the file does not say."""

    patterns: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_WORDS = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|DIGITS| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_CASED = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+CONTR"
          r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*CONTR|DIGITS| ?[^\s\p{L}\p{N}]+[\r\n/]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_GROUPS = {  # one entry per llama.cpp pre-tokenizer type
    "default": PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
    "gpt2": PreTokenizer((_GPT2,)),
    "starcoder": PreTokenizer((r"\p{N}", _GPT2)),
    "llama3": PreTokenizer((_WORDS.replace("DIGITS", r"\p{N}{1,3}"),), ignore_merges=True, add_bos=True),
    "chatglm4": PreTokenizer((_WORDS.replace("DIGITS", r"\p{N}{1,3}"),)),
    "qwen2": PreTokenizer((_WORDS.replace("DIGITS", r"\p{N}"),)),
    "qwen35": PreTokenizer((_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                            r"|\s*[\r\n]+|\s+(?!\S)|\s+",)),
    "deepseek-llm": PreTokenizer((r"[\r\n]", r"\s?CASED_LETTERS+",
                                  "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", r"\s+$",
                                  _CJK_HANGUL, r"\p{N}+")),
    "deepseek-coder": PreTokenizer((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}")),
    "deepseek-v3": PreTokenizer((r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
                                 r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                                 r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")),
    "gpt-4o": PreTokenizer((_CASED.replace("CONTR", _CONTRACTIONS + "?").replace("DIGITS", r"\p{N}{1,3}"),)),
    "tekken": PreTokenizer((_CASED.replace("CONTR", "").replace("DIGITS", r"\p{N}"),)),
    # llama.cpp's own splitter for Kimi K2: Han runs, then words of other letters (marks not included)
    "kimi-k2": PreTokenizer((r"\p{Han}+|[^\r\n\p{L}\p{Han}\p{N}]?\p{L}+" + _CONTRACTIONS + r"?|\p{N}{1,3}"
                             r"| ?[^\s\p{L}\p{Han}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",)),
}
# pre name (tokenizer.ggml.pre) -> rules: the names llama.cpp knows that models of the supported
# architectures carry, with the aliases llama.cpp gives the same rules
_NAMES = {
    "default": ("default",),
    "gpt2": ("gpt-2", "olmo", "gigachat"),
    "starcoder": ("refact", "starcoder"),
    "llama3": ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"),
    "chatglm4": ("glm4", "chatglm-bpe"),
    "qwen2": ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"),
    "qwen35": ("qwen35",),
    "deepseek-llm": ("deepseek-llm",),
    "deepseek-coder": ("deepseek-coder",),
    "deepseek-v3": ("deepseek-v3", "joyai-llm"),
    "gpt-4o": ("gpt-4o", "kanana2"),
    "tekken": ("tekken",),
    "kimi-k2": ("kimi-k2",),
}
PRE_TOKENIZERS = {name: _GROUPS[group] for group, names in _NAMES.items() for name in names}

# template marker -> one user turn, then the assistant's turn opened
CHAT_SHAPES = {
    "<|im_start|>": "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n",
    "[INST]": "[INST] {prompt} [/INST]",
    "<|message|>": "<|start|>user<|message|>{prompt}<|end|><|start|>assistant",
    "<|start_of_role|>": "<|start_of_role|>user<|end_of_role|>{prompt}<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>",
}
_STOP_TEXTS = ("<|im_end|>", "<|endoftext|>", "<|end|>", "<|return|>", "<|end_of_text|>", "</s>", "<|eot_id|>")


class TokenizerError(ValueError):
    """A vocabulary that cannot be used, or text that cannot be encoded; names file and field."""


def byte_alphabet() -> list[str]:
    """GPT-2's byte -> character map: printable Latin-1 bytes map to themselves, the others to
    code points from 256 up, in byte order."""
    keep = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


# character classes ------------------------------------------------------------------------------
_CLASS_CHAR = {"N": "\xd1", "L": "\xd2", "P": "\xd3", "M": "\xd4", "S": "\xd5", "H": "\xd6"}  # other: \xd0
_CLASS_ASCII = {"N": "0-9", "L": "A-Za-z", "P": r"!-#%-*,-/:;?@\[-\]_\{\}", "M": "", "S": r"\$\+<->\^`\|~", "H": ""}
# \p{Han} (kimi-k2): llama.cpp's ranges of CJK ideographs
_HAN = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2EBEF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


class _Collapse(dict):
    """``str.translate`` table: a character above 127 -> its class code point, whitespace -> \\v;
    with ``han``, Han ideographs get their own code point (and are not in \\p{L})."""

    def __init__(self, han: bool = False):
        super().__init__()
        self.han = han

    def __missing__(self, cp: int) -> int:
        ch = chr(cp)
        if cp < 128:
            out = cp
        elif ch.isspace():
            out = 0x0B
        elif self.han and any(a <= cp <= b for a, b in _HAN):
            out = 0xD6
        else:
            out = ord(_CLASS_CHAR.get(unicodedata.category(ch)[0], "\xd0"))
        self[cp] = out
        return out


class _Widen(dict):
    """``str.translate`` table: whitespace above 127 -> \\v, everything else unchanged."""

    def __missing__(self, cp: int) -> int:
        out = 0x0B if cp >= 128 and chr(cp).isspace() else cp
        self[cp] = out
        return out


_VIEWS = {"classes": _Collapse(), "classes+han": _Collapse(han=True), "text": _Widen()}


@functools.lru_cache(maxsize=None)
def _cased_letters() -> str:
    """A class of the cased letters (Unicode Lu, Ll, Lt) as ranges, for deepseek-llm's pattern."""
    ranges, start, prev = [], None, None
    for cp in range(0x20000):
        if unicodedata.category(chr(cp)) in ("Lu", "Ll", "Lt"):
            if start is None:
                start = cp
            elif cp != prev + 1:
                ranges.append((start, prev))
                start = cp
            prev = cp
    ranges.append((start, prev))
    return "[" + "".join(re.escape(chr(a)) + ("-" + re.escape(chr(b)) if b > a else "") for a, b in ranges) + "]"


def _translate(pattern: str) -> tuple[re.Pattern, str]:
    """A pattern in llama.cpp's syntax -> (Python pattern, the view of the text it runs on:
    "classes", "classes+han" or "text")."""
    view = "classes+han" if "\\p{Han}" in pattern else "classes" if "\\p{" in pattern else "text"
    out, i, inside = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and pattern.startswith("p{", i + 1):
            end = pattern.index("}", i)
            cls = pattern[i + 3:end][0]  # Lu, Ll, ... are all letters here; H: Han
            body = _CLASS_CHAR[cls] + _CLASS_ASCII[cls]
            out.append(body if inside else f"[{body}]")
            i = end + 1
            continue
        if c == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if c == "[" and not inside:
            inside = True
        elif c == "]" and inside:
            inside = False
        elif c == "$" and not inside:
            c = r"\Z"  # ECMAScript's $ is the end of the piece only
        out.append(c)
        i += 1
    text = "".join(out).replace("CASED_LETTERS", _cased_letters() if "CASED_LETTERS" in pattern else "")
    return re.compile(text, re.ASCII), view


@functools.lru_cache(maxsize=None)
def _compiled(name: str) -> tuple[tuple[re.Pattern, str], ...]:
    return tuple(_translate(p) for p in PRE_TOKENIZERS[name].patterns)


def pre_split(text: str, name: str) -> list[str]:
    """``text`` cut into words by pre-tokenizer ``name`` (see the module docstring)."""
    rules = _compiled(name)
    views = {}
    spans = [(0, len(text))] if text else []
    for pattern, view in rules:
        if view not in views:
            views[view] = text.translate(_VIEWS[view])
        src, out = views[view], []
        for a, b in spans:
            at = a
            for m in pattern.finditer(src, a, b):
                if m.end() == m.start():
                    continue
                if m.start() > at:
                    out.append((at, m.start()))
                out.append((m.start(), m.end()))
                at = m.end()
            if at < b:
                out.append((at, b))
        spans = out
    return [text[a:b] for a, b in spans]


# merging ----------------------------------------------------------------------------------------
def _merge(symbols: list[str], priority) -> list[str]:
    """Merge adjacent symbols, best pair first: ``priority(left, right)`` is a sort key (lower
    first) or None when the pair does not merge; ties go to the leftmost pair. A heap of
    candidate pairs, each with the versions of its two sides; a popped pair whose sides have
    changed since it was pushed is skipped."""
    n = len(symbols)
    nxt, prv, ver = list(range(1, n + 1)), list(range(-1, n - 1)), [0] * n
    nxt[-1] = -1

    def pair(i: int):
        j = nxt[i] if i >= 0 else -1
        key = priority(symbols[i], symbols[j]) if j >= 0 else None
        return None if key is None else (key, i, ver[i], j, ver[j])

    heap = [p for p in map(pair, range(n - 1)) if p is not None]
    heapq.heapify(heap)
    while heap:
        _, i, vi, j, vj = heapq.heappop(heap)
        if ver[i] != vi or ver[j] != vj or nxt[i] != j:
            continue
        symbols[i], symbols[j] = symbols[i] + symbols[j], ""
        ver[i] += 1
        ver[j] += 1
        nxt[i] = nxt[j]
        if nxt[j] >= 0:
            prv[nxt[j]] = i
        for p in (pair(prv[i]), pair(i)):
            if p is not None:
                heapq.heappush(heap, p)
    return [s for s in symbols if s]


class Tokenizer:
    """Encoder/decoder of one vocabulary (see the module docstring). Build with :meth:`from_gguf`
    or from the metadata dict of ``gguf_io.read_tokenizer``."""

    def __init__(self, meta: dict, source: str = "<vocabulary>"):
        self.source = source
        self.kind = meta["model"]
        if self.kind not in ("gpt2", "llama"):
            raise TokenizerError(f"{source}: tokenizer.ggml.model = {self.kind!r}; supported: gpt2 (BPE), llama (SentencePiece)")
        self.tokens: list[str] = list(meta["tokens"])
        n = len(self.tokens)
        self.types = list(meta.get("token_type") or [_NORMAL] * n)
        if len(self.types) != n:
            raise TokenizerError(f"{source}: tokenizer.ggml.token_type has {len(self.types)} entries, tokens {n}")
        self.pre = None
        if self.kind == "gpt2":
            self.pre = meta.get("pre") or "default"
            if self.pre not in PRE_TOKENIZERS:
                raise TokenizerError(f"{source}: tokenizer.ggml.pre = {self.pre!r} is not a pre-tokenizer moelab knows; "
                                     f"known: {', '.join(sorted(PRE_TOKENIZERS))}")
        self.ids = dict(zip(self.tokens, range(n)))
        self.bos, self.eos, self.unk = meta.get("bos"), meta.get("eos"), meta.get("unk")
        default_bos = self.kind == "llama" or PRE_TOKENIZERS.get(self.pre, _GROUPS["default"]).add_bos
        self.add_bos = bool(meta["add_bos"]) if meta.get("add_bos") is not None else default_bos
        self.add_space_prefix = bool(meta["add_space_prefix"]) if meta.get("add_space_prefix") is not None else True
        self.chat_template = meta.get("chat_template")
        kinds = (_CONTROL, _USER_DEFINED, _UNKNOWN)
        found = [i for i, t in enumerate(self.types) if t in kinds and self.tokens[i]]
        self.special = {self.tokens[i]: i for i in found}
        # llama.cpp's order: longest first, each over the whole text before the next
        self._specials = sorted(((self.tokens[i], i, self.types[i] == _USER_DEFINED) for i in found),
                                key=lambda s: -len(s[0]))
        stops = {i for i in (self.eos, meta.get("eot")) if i is not None}
        self.stop_ids = frozenset(stops | {self.ids[t] for t in _STOP_TEXTS if t in self.special})
        if self.kind == "gpt2":
            self._init_bpe(meta)
        else:
            self._init_spm(meta)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "Tokenizer":
        """The vocabulary of a GGUF file (``gguf_io.read_tokenizer``)."""
        from .gguf_io import read_tokenizer

        return cls(read_tokenizer(path), str(path))

    # BPE ----------------------------------------------------------------------------------------
    def _init_bpe(self, meta: dict) -> None:
        merges = meta.get("merges")
        if merges is None:
            raise TokenizerError(f"{self.source}: BPE vocabulary without tokenizer.ggml.merges")
        bad = next((i for i, m in enumerate(merges) if " " not in m), None)
        if bad is not None:
            raise TokenizerError(f"{self.source}: tokenizer.ggml.merges[{bad}] = {merges[bad]!r}, expected 'left right'")
        # "left right" -> rank; the first of repeated merges wins (the dict keeps the last assignment)
        self.ranks = dict(zip(reversed(merges), range(len(merges) - 1, -1, -1)))
        self.ignore_merges = PRE_TOKENIZERS[self.pre].ignore_merges
        self.byte_char = byte_alphabet()
        self.char_byte = {c: b for b, c in enumerate(self.byte_char)}
        self._to_bytes = {i: c for i, c in enumerate(self.byte_char)}  # latin-1 code point -> byte char
        self._cache: dict[str, list[int]] = {}

    def _bpe(self, piece: str) -> list[int]:
        hit = self._cache.get(piece)
        if hit is not None:
            return hit
        word = piece.encode("utf-8").decode("latin-1").translate(self._to_bytes)
        whole = self.ids.get(word) if self.ignore_merges else None
        if whole is not None:
            ids = [whole]
        else:
            ids = []
            ranks = self.ranks
            for w in _merge(list(word), lambda a, b: ranks.get(a + " " + b)):
                j = self.ids.get(w)
                if j is not None:
                    ids.append(j)
                else:  # a merge result missing from the vocabulary: its bytes one by one
                    ids.extend(self._byte_id(c) for c in w)
        if len(self._cache) >= _CACHE_WORDS:
            self._cache.clear()
        self._cache[piece] = ids
        return ids

    def _byte_id(self, char: str) -> int:
        if char not in self.ids:
            raise TokenizerError(f"{self.source}: byte token {char!r} missing from tokenizer.ggml.tokens")
        return self.ids[char]

    # SentencePiece -------------------------------------------------------------------------------
    def _init_spm(self, meta: dict) -> None:
        scores = meta.get("scores")
        if scores is None or len(scores) != len(self.tokens):
            raise TokenizerError(f"{self.source}: SentencePiece vocabulary needs tokenizer.ggml.scores, one per token")
        self.scores = [float(s) for s in scores]
        self.byte_ids = {}
        for i, t in enumerate(self.tokens):
            if self.types[i] == _BYTE and len(t) == 6 and t.startswith("<0x"):
                self.byte_ids[int(t[3:5], 16)] = i

    def _spm_priority(self, a: str, b: str):
        j = self.ids.get(a + b)
        if j is None or self.types[j] in (_CONTROL, _BYTE):
            return None
        return -self.scores[j]

    def _spm(self, text: str) -> list[int]:
        ids = []
        for s in _merge(list(text), self._spm_priority):
            j = self.ids.get(s)
            if j is not None and self.types[j] != _CONTROL:
                ids.append(j)
            elif self.byte_ids:
                ids.extend(self.byte_ids[b] for b in s.encode("utf-8"))
            elif self.unk is not None:
                ids.append(self.unk)
            else:
                raise TokenizerError(f"{self.source}: {s!r} is not in the vocabulary, which has no byte or unk tokens")
        return ids

    # text -----------------------------------------------------------------------------------------
    def _partition(self, text: str, special: bool) -> list:
        """``text`` cut at special tokens: a list of text pieces (str) and token ids (int)."""
        parts: list = [text]
        for tok, i, user in self._specials:
            if not (user or special) or tok not in text:
                continue
            out = []
            for p in parts:
                if isinstance(p, int) or tok not in p:
                    out.append(p)
                    continue
                for k, piece in enumerate(p.split(tok)):
                    if k:
                        out.append(i)
                    if piece:
                        out.append(piece)
            parts = out
        return parts

    def _encode_text(self, text: str, after_special: bool) -> list[int]:
        if self.kind == "llama":
            if after_special and self.add_space_prefix:
                text = " " + text
            return self._spm(text.replace(" ", _SPACE))
        return [i for word in pre_split(text, self.pre) for i in self._bpe(word)]

    def encode(self, text: str, add_bos: bool | None = None, special: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_bos`` (default: the file's ``add_bos_token``) prepends BOS;
        ``special`` matches control tokens written in the text (user-defined ones always match)."""
        ids = [self.bos] if (self.add_bos if add_bos is None else add_bos) and self.bos is not None else []
        after_special = True
        for part in self._partition(text, special):
            if isinstance(part, int):
                ids.append(part)
                after_special = True
            else:
                ids.extend(self._encode_text(part, after_special))
                after_special = False
        return ids

    def token_bytes(self, i: int) -> bytes:
        """The bytes token ``i`` stands for in text (b"" for control tokens)."""
        if not 0 <= i < len(self.tokens):
            raise TokenizerError(f"token id {i} out of range 0..{len(self.tokens) - 1}")
        t, kind = self.tokens[i], self.types[i]
        if kind == _CONTROL:
            return b""
        if self.kind == "llama":
            if kind == _BYTE:
                return bytes([int(t[3:5], 16)])
            return t.replace(_SPACE, " ").encode("utf-8")
        if kind == _USER_DEFINED:
            return t.encode("utf-8")
        return b"".join(bytes([self.char_byte[c]]) if c in self.char_byte else c.encode("utf-8") for c in t)

    def decode(self, ids) -> str:
        """Text of token ids (control tokens left out; invalid UTF-8 replaced)."""
        d = self.stream()
        return "".join(d.add(i) for i in ids) + d.flush()

    def stream(self) -> "StreamDecoder":
        """An incremental decoder for generated tokens."""
        return StreamDecoder(self)

    def chat_prompt(self, prompt: str) -> str | None:
        """The prompt as one user turn in the file's chat-template shape, or None when the file has
        no template or one of a shape not recognised (see the module docstring)."""
        if not self.chat_template:
            return None
        for marker, shape in CHAT_SHAPES.items():
            if marker in self.chat_template:
                return shape.format(prompt=prompt)
        return None


class StreamDecoder:
    """Turns token ids into text as they come: bytes of a character split across tokens wait
    for the rest; SentencePiece's leading space of the first piece is dropped."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = tok.kind == "llama" and tok.add_space_prefix

    def add(self, i: int) -> str:
        b = self.tok.token_bytes(i)
        if self._first and b:
            self._first = False
            if b.startswith(b" "):
                b = b[1:]
        return self._utf8.decode(b)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
