"""execute.tokenizer: round trips on the synthetic vocabularies, merges, special tokens, chat
shapes, streaming; execute.sampling."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from execute.sampling import Sampler
from execute.synth import config_from_preset, synth_model
from execute.tokenizer import Tokenizer, TokenizerError

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
    meta = {"model": "gpt2", "tokens": tokens, "token_type": [1] * 6, "merges": ["b c", "a b", "a bc"], "pre": "gpt2"}
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
