"""Text in and out from a GGUF file's vocabulary: byte-level BPE ("gpt2") and SentencePiece
("llama"), and the common chat-template shapes.

- **BPE** (``tokenizer.ggml.model = "gpt2"``): the text is split by the pre-tokenizer pattern
  named by ``tokenizer.ggml.pre`` (GPT-2's, or the llama3/qwen2-style pattern for the newer
  names), each piece is mapped to GPT-2's byte alphabet and merged by merge rank. The patterns use
  Python's ``re``: a letter is ``[^\\W\\d_]`` and a number ``\\d`` (Unicode-aware, but not exactly
  the ``\\p{L}``/``\\p{N}`` classes of the original patterns), so rare scripts may split
  differently from llama.cpp; decoding is exact either way.
- **SentencePiece** (``"llama"``): spaces become U+2581 (with a leading one when
  ``add_space_prefix``), then the adjacent pair whose concatenation is a piece with the highest
  score is merged (ties: leftmost) until none is left; symbols not in the vocabulary fall back to
  ``<0xXX>`` byte tokens (or ``<unk>``).
- Control and user-defined tokens are matched in the text only when ``special=True`` (chat
  prompts), and are left out of decoded text.
- **Chat templates**: no Jinja engine; :meth:`Tokenizer.chat_prompt` recognises the template by
  its markers and writes the one-user-turn prompt of that shape: ChatML (``<|im_start|>``),
  Mistral/Llama-2 (``[INST]``), gpt-oss harmony (``<|start|>...<|message|>``) and Granite
  (``<|start_of_role|>``). Any other template is reported as unrecognised.
"""
from __future__ import annotations

import codecs
import os
import re

__all__ = ["Tokenizer", "TokenizerError", "StreamDecoder", "byte_alphabet", "CHAT_SHAPES"]

_CONTROL, _USER_DEFINED, _BYTE = 3, 4, 6
_SPACE = "\u2581"
_L, _N, _NOT_LNS = r"[^\W\d_]", r"\d", r"(?:[^\s\w]|_)"
_GPT2 = rf"'s|'t|'re|'ve|'m|'ll|'d| ?{_L}+| ?{_N}+| ?{_NOT_LNS}+|\s+(?!\S)|\s+"
_LLAMA3 = (rf"(?i:'s|'t|'re|'ve|'m|'ll|'d)|(?:[^\r\n\w]|_)?{_L}+|{_N}{{1,3}}| ?{_NOT_LNS}+[\r\n]*"
           rf"|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE = {"gpt2": _GPT2, "default": _GPT2}  # every other pre name: the llama3/qwen2-style pattern

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
        self.types = list(meta["token_type"] or [1] * n)
        if len(self.types) != n:
            raise TokenizerError(f"{source}: tokenizer.ggml.token_type has {len(self.types)} entries, tokens {n}")
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.bos, self.eos, self.unk = meta.get("bos"), meta.get("eos"), meta.get("unk")
        self.add_bos = bool(meta["add_bos"]) if meta.get("add_bos") is not None else self.kind == "llama"
        self.add_space_prefix = bool(meta["add_space_prefix"]) if meta.get("add_space_prefix") is not None else True
        self.chat_template = meta.get("chat_template")
        self.special = {t: i for i, t in enumerate(self.tokens) if self.types[i] in (_CONTROL, _USER_DEFINED)}
        self._special_re = re.compile("|".join(re.escape(t) for t in sorted(self.special, key=len, reverse=True))) \
            if self.special else None
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
        self.ranks = {}
        for i, m in enumerate(merges):
            a, sep, b = m.partition(" ")
            if not sep:
                raise TokenizerError(f"{self.source}: tokenizer.ggml.merges[{i}] = {m!r}, expected 'left right'")
            self.ranks.setdefault((a, b), i)
        self.byte_char = byte_alphabet()
        self.char_byte = {c: b for b, c in enumerate(self.byte_char)}
        self.pattern = re.compile(_PRE.get(meta.get("pre") or "default", _LLAMA3))
        self._cache: dict[str, list[int]] = {}

    def _bpe(self, piece: str) -> list[int]:
        hit = self._cache.get(piece)
        if hit is not None:
            return hit
        word = [self.byte_char[b] for b in piece.encode("utf-8")]
        while len(word) > 1:
            ranked = [(self.ranks.get((word[i], word[i + 1]), -1), i) for i in range(len(word) - 1)]
            ranked = [r for r in ranked if r[0] >= 0]
            if not ranked:
                break
            best = min(ranked)[0]
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and self.ranks.get((word[i], word[i + 1])) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            word = out
        ids = []
        for w in word:
            if w in self.ids:
                ids.append(self.ids[w])
            else:  # a merge result missing from the vocabulary: its bytes one by one
                ids.extend(self._byte_id(c) for c in w)
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

    def _spm(self, text: str) -> list[int]:
        sym = list(text)
        while len(sym) > 1:
            best, at = None, -1
            for i in range(len(sym) - 1):
                j = self.ids.get(sym[i] + sym[i + 1])
                if j is not None and self.types[j] not in (_CONTROL, _BYTE) and (best is None or self.scores[j] > best):
                    best, at = self.scores[j], i
            if at < 0:
                break
            sym[at:at + 2] = [sym[at] + sym[at + 1]]
        ids = []
        for s in sym:
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
    def _encode_plain(self, text: str, first: bool) -> list[int]:
        if not text:
            return []
        if self.kind == "llama":
            if first and self.add_space_prefix:
                text = " " + text
            return self._spm(text.replace(" ", _SPACE))
        return [i for piece in self.pattern.findall(text) for i in self._bpe(piece)]

    def encode(self, text: str, add_bos: bool | None = None, special: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_bos`` (default: the file's ``add_bos_token``) prepends BOS;
        ``special`` matches control tokens written in the text."""
        ids = [self.bos] if (self.add_bos if add_bos is None else add_bos) and self.bos is not None else []
        parts = [text]
        if special and self._special_re is not None:
            parts = self._special_re.split(text)
            found = self._special_re.findall(text)
        for k, part in enumerate(parts):
            ids.extend(self._encode_plain(part, first=k == 0))
            if special and self._special_re is not None and k < len(found):
                ids.append(self.special[found[k]])
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
