"""execute.tokenizer: round trips on the synthetic vocabularies, merges, special tokens, chat
shapes, streaming; llama.cpp's pre-tokenizer rules on vocabularies built so that each rule decides
the ids; execute.sampling."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from execute.sampling import Sampler
from execute.synth import config_from_preset, synth_model
from execute.tokenizer import PRE_TOKENIZERS, Tokenizer, TokenizerError, _merge, byte_alphabet, pre_split

TEXTS = ["Hello world", " leading space and  two", "naïve café — 日本語 😀", "line1\nline2\n\n  x\t",
         "it's 12345 dollars!", "under_score __init__", ""]


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab")
    return {arch: Tokenizer.from_gguf(synth_model(root / f"{arch}.gguf", config_from_preset("tiny", arch=arch, quant="Q8_0")))
            for arch in ("qwen3moe", "llama", "gpt-oss")}


@pytest.mark.parametrize("arch", ("qwen3moe", "llama", "gpt-oss"))
@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(arch, text, toks):
    tok = toks[arch]
    ids = tok.encode(text)
    assert all(0 <= i < len(tok.tokens) for i in ids)
    assert tok.decode(ids) == text


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=40))
def test_round_trip_any_text(text, toks):
    for arch in ("qwen3moe", "llama"):
        assert toks[arch].decode(toks[arch].encode(text)) == text


def test_sentencepiece_merges_by_score_and_falls_back_to_bytes(toks):
    tok = toks["llama"]
    ids = tok.encode("tea", add_bos=False)
    assert [tok.tokens[i] for i in ids] == ["\u2581t", "ea"]  # "▁t" outranks "te" and "ea"; then "ea"
    assert tok.encode("the")[0] == tok.bos  # the file asks for BOS
    ids = tok.encode("日", add_bos=False)
    assert [tok.tokens[i] for i in ids] == ["\u2581", "<0xE6>", "<0x97>", "<0xA5>"]


def test_bpe_applies_merges_in_rank_order():
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    meta = {"model": "gpt2", "tokens": tokens, "token_type": [1] * 6, "merges": ["b c", "a b", "a bc"], "pre": "gpt-2"}
    tok = Tokenizer(meta)
    assert [tokens[i] for i in tok.encode("abc")] == ["abc"]  # b+c first (rank 0), then a+bc
    assert [tokens[i] for i in tok.encode("ab")] == ["ab"]
    assert tok.decode(tok.encode("cab")) == "cab"


def test_special_tokens_only_when_asked(toks):
    tok = toks["qwen3moe"]
    text = "<|im_start|>user"
    assert tok.encode(text, special=True)[0] == tok.ids["<|im_start|>"]
    assert tok.ids["<|im_start|>"] not in tok.encode(text)  # plain text stays text
    assert tok.decode(tok.encode(text, special=True)) == "user"  # control tokens are not printed
    assert tok.ids["<|im_end|>"] in tok.stop_ids


@pytest.mark.parametrize("arch, start", [("qwen3moe", "<|im_start|>user\nhi<|im_end|>"), ("llama", "[INST] hi [/INST]"),
                                         ("gpt-oss", "<|start|>user<|message|>hi<|end|>")])
def test_chat_shapes(arch, start, toks):
    assert toks[arch].chat_prompt("hi").startswith(start)


def test_unknown_template_and_bad_vocab():
    meta = {"model": "gpt2", "tokens": ["a"], "token_type": [1], "merges": [], "chat_template": "{{ weird }}"}
    assert Tokenizer(meta).chat_prompt("x") is None
    with pytest.raises(TokenizerError, match="supported: gpt2"):
        Tokenizer({**meta, "model": "bert"}, "f.gguf")
    with pytest.raises(TokenizerError, match=r"merges\[0\]"):
        Tokenizer({**meta, "merges": ["ab"]}, "f.gguf")


def test_stream_decoder_waits_for_split_characters(toks):
    tok = toks["qwen3moe"]
    ids = tok.encode("é😀")  # byte tokens: a character spans several ids
    d = tok.stream()
    parts = [d.add(i) for i in ids]
    assert "".join(parts) + d.flush() == "é😀" and parts[0] == ""


def test_sampler_greedy_and_seeded():
    logits = np.array([0.1, 2.0, 2.0, -1.0])
    assert Sampler()(logits) == 1
    draws = [Sampler(1.0, seed=4)(logits) for _ in range(2)]
    assert draws[0] == draws[1]
    s = Sampler(1.0, seed=0)
    counts = np.bincount([s(logits) for _ in range(2000)], minlength=4) / 2000
    p = np.exp(logits) / np.exp(logits).sum()
    np.testing.assert_allclose(counts, p, atol=0.04)
    top2 = Sampler(5.0, seed=1, top_k=2)
    assert set(top2(logits) for _ in range(50)) == {1, 2}
    with pytest.raises(ValueError, match="temp"):
        Sampler(-1.0)


# llama.cpp's pre-tokenizer rules --------------------------------------------------------------------
BYTES = byte_alphabet()


def _b(text: str) -> str:
    """``text`` in GPT-2's byte alphabet (how BPE vocabularies spell tokens)."""
    return "".join(BYTES[b] for b in text.encode("utf-8"))


def chain_vocab(words, pre: str, extra=(), user=()) -> Tokenizer:
    """A byte-level BPE vocabulary in which each of ``words`` is one token, reached by merges:
    first every character's bytes join, then each word grows from the left one character at a
    time, earlier words at lower ranks; ``extra`` tokens are in the vocabulary without merges,
    ``user`` tokens are user-defined."""
    tokens, merges = list(BYTES), []

    def add(left: str, right: str) -> None:
        if f"{left} {right}" not in merges:
            merges.append(f"{left} {right}")
        if left + right not in tokens:
            tokens.append(left + right)

    for w in words:
        for ch in w:
            chars = [BYTES[b] for b in ch.encode("utf-8")]
            for k in range(1, len(chars)):
                add("".join(chars[:k]), chars[k])
    for w in words:
        chars = [_b(ch) for ch in w]
        for k in range(1, len(chars)):
            add("".join(chars[:k]), chars[k])
    tokens += [_b(t) for t in extra if _b(t) not in tokens]
    types = [1] * len(tokens) + [4] * len(user)
    return Tokenizer({"model": "gpt2", "pre": pre, "tokens": tokens + list(user), "token_type": types, "merges": merges})


def spelled(tok: Tokenizer, text: str, **kw) -> list[str]:
    """Encoded ``text`` as token texts, in plain characters."""
    return [tok.decode([i]) if tok.types[i] != 4 else tok.tokens[i] for i in tok.encode(text, **kw)]


@pytest.mark.parametrize("pre, expected", [
    ("qwen2", ["1", "2", "3", "4", "5"]),  # every digit alone
    ("qwen35", ["1", "2", "3", "4", "5"]),
    ("refact", ["1", "2", "3", "4", "5"]),  # digits split before anything else
    ("llama-bpe", ["123", "45"]),  # runs of up to three
    ("deepseek-v3", ["123", "45"]),
    ("gpt-4o", ["123", "45"]),
    ("kimi-k2", ["123", "45"]),
    ("gpt-2", ["12345"]),  # one number
])
def test_digits_follow_each_pre_tokenizer(pre, expected):
    tok = chain_vocab(["12345", "123", "45"], pre)
    assert spelled(tok, "12345") == expected


def test_llama3_family_emits_a_vocabulary_word_whole():
    """ignore_merges: "Hello" is in the vocabulary but no merge reaches it."""
    tokens = BYTES + ["He", "ll", "llo", "Hello", _b(" world")]
    meta = {"model": "gpt2", "tokens": tokens, "token_type": [1] * len(tokens), "merges": ["H e", "l l", "ll o"]}
    for pre in ("llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral"):
        assert spelled(Tokenizer({**meta, "pre": pre}), "Hello world") == ["Hello", " world"], pre
    ids = Tokenizer({**meta, "pre": "qwen2"}).encode("Hello world")
    assert [tokens[i] for i in ids] == ["He", "llo", _b(" "), "w", "o", "r", "l", "d"]  # merges only
    assert Tokenizer({**meta, "pre": "llama-bpe"}).add_bos and not Tokenizer({**meta, "pre": "qwen2"}).add_bos


@pytest.mark.parametrize("pre, expected", [
    ("qwen35", ["नमस्ते", " दुनिया"]),  # marks belong to the word
    ("deepseek-v3", ["नमस्ते", " दुनिया"]),
    ("qwen2", ["नमस", "्त", "े", " द", "ुन", "िय", "ा"]),  # a mark is not a letter: the word breaks
    ("llama-bpe", ["नमस", "्त", "े", " द", "ुन", "िय", "ा"]),
])
def test_combining_marks(pre, expected):
    tok = chain_vocab(["नमस्ते", " दुनिया", "नमस", "्त", "े", " द", "ुन", "िय", "ा"], pre)
    assert pre_split("नमस्ते दुनिया", pre) == expected
    assert spelled(tok, "नमस्ते दुनिया") == expected


@pytest.mark.parametrize("pre, expected", [
    ("deepseek-v3", ["x", "   ", "123"]),  # digits first: the spaces end their piece
    ("llama-bpe", ["x", "  ", " ", "123"]),  # the last space waits for what follows
    ("gpt-2", ["x", "  ", " 123"]),
])
def test_whitespace_before_digits(pre, expected):
    tok = chain_vocab(["   ", "  ", " 123", "123"], pre, extra=["x"])
    assert spelled(tok, "x   123") == expected


def test_pre_tokenizer_patterns_apply_in_turn():
    assert pre_split("Hello, world!", "default") == ["Hello", ",", " world", "!"]  # punctuation first
    assert pre_split("it's 1234567", "default") == ["it", "'", "s", " ", "123", "456", "7"]
    assert pre_split("HelloWorld ok", "gpt-4o") == ["Hello", "World", " ok"]
    assert pre_split("a\nb  ", "deepseek-llm") == ["a", "\n", "b", "  "]
    assert pre_split("日本語のテキストabc", "deepseek-v3") == ["日本語のテキスト", "abc"]
    assert pre_split("你好世界hello World", "kimi-k2") == ["你好世界", "hello", " World"]  # Han apart
    assert pre_split("你好世界hello World", "qwen2") == ["你好世界hello", " World"]


def test_user_defined_tokens_stay_whole_control_tokens_only_when_asked():
    tok = chain_vocab(["ab"], "qwen2", extra=["<", ">", "think"], user=["<think>"])
    tok.types[tok.ids[_b(">")]] = 1
    assert spelled(tok, "ab<think>ab") == ["ab", "<think>", "ab"]
    assert tok.decode(tok.encode("ab<think>ab")) == "ab<think>ab"
    ctl = Tokenizer({"model": "gpt2", "pre": "qwen2", "tokens": BYTES + ["<c>"], "token_type": [1] * 256 + [3], "merges": []})
    assert ctl.encode("a<c>")[-1] != 256 and ctl.encode("a<c>", special=True)[-1] == 256


def test_longer_special_token_goes_first_over_the_whole_text():
    tok = chain_vocab(["a", "d"], "qwen2", user=["ab", "bcd"])
    assert spelled(tok, "abcd") == ["a", "bcd"]  # "bcd" is cut first, though "ab" starts earlier


def test_unknown_pre_tokenizer_is_refused():
    meta = {"model": "gpt2", "tokens": BYTES, "token_type": [1] * 256, "merges": []}
    for name in ("youtu", "my-own", "gpt2"):
        with pytest.raises(TokenizerError, match=f"f.gguf: tokenizer.ggml.pre = '{name}' is not a pre-tokenizer"):
            Tokenizer({**meta, "pre": name}, "f.gguf")
    assert Tokenizer({**meta, "pre": None}).pre == "default"  # llama.cpp: a file without the key
    assert {"qwen2", "qwen35", "llama-bpe", "deepseek-v3", "deepseek-llm", "gpt-4o", "olmo", "refact", "kimi-k2"} <= set(PRE_TOKENIZERS)


def test_merging_is_linear_in_the_word():
    """A word of n symbols: n - 1 pairs to start with, two new pairs per merge: at most 3n
    priority lookups, whatever the merge order."""
    for n in (10, 100, 1000):
        calls = []

        def priority(a, b):
            calls.append(1)
            return len(a) + len(b)  # merges everything, shortest pairs first

        assert _merge(list("x" * n), priority) == ["x" * n]
        assert len(calls) <= 3 * n


def test_sentencepiece_space_prefix_after_a_special_token(toks):
    tok = toks["llama"]
    assert tok.encode("</s>tea", add_bos=False, special=True) == [2] + tok.encode("tea", add_bos=False)
