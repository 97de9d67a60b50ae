"""Incremental detokenization: split multi-byte characters, stop strings across tokens, held-back tails."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from gracelm.engine.detokenizer import IncrementalDetokenizer

TEXT = "héllo wörld, 世界 says 🎉🎉 to the naïve café. STOP here and the end."


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    # A byte-level BPE with few merges: most non-ASCII characters stay split into several byte tokens.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, the end. says to the cafe here and"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def _stream(tokenizer, text: str, stop: list[str] | None = None) -> tuple[IncrementalDetokenizer, list[str]]:
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt: "), stop=stop)
    deltas = []
    for token_id in tokenizer.encode(text):
        if detok.add_token(token_id) is not None:
            break
        deltas.append(detok.stream_delta())
    detok.finish()
    deltas.append(detok.stream_delta())
    return detok, deltas


def test_multibyte_characters_split_across_tokens_are_never_emitted_partially(tokenizer):
    ids = tokenizer.encode("🎉")
    assert len(ids) > 1, "the test tokenizer must split the emoji into byte tokens"
    detok, deltas = _stream(tokenizer, TEXT)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == TEXT == detok.text
    # Some steps must have emitted nothing (waiting for the rest of a character).
    assert "" in deltas[:-1]


def test_stop_string_spanning_tokens_ends_text_before_it(tokenizer):
    stop_ids = tokenizer.encode(" STOP")
    assert len(stop_ids) > 1, "the stop string must span several tokens"
    detok, deltas = _stream(tokenizer, TEXT, stop=["STOP"])
    assert detok.stop_string == "STOP"
    assert detok.text == TEXT[:TEXT.index("STOP")]
    assert "".join(deltas) == detok.text
    assert all("S" not in d for d in deltas)  # no part of the stop string was ever streamed


def test_streamed_text_holds_back_a_possible_stop_prefix_and_releases_it(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], stop=["the cat"])
    streamed = ""
    for token_id in tokenizer.encode("I saw the"):
        detok.add_token(token_id)
        streamed += detok.stream_delta()
    assert streamed == "I saw "  # "the" may still become "the cat"
    for token_id in tokenizer.encode(" dog"):
        detok.add_token(token_id)
        streamed += detok.stream_delta()
    assert streamed == "I saw the dog"
    detok.finish()
    assert streamed + detok.stream_delta() == "I saw the dog"


def test_earliest_of_several_stop_strings_wins(tokenizer):
    detok, _ = _stream(tokenizer, "alpha beta gamma", stop=["gamma", "beta"])
    assert detok.stop_string == "beta" and detok.text == "alpha "


def test_hidden_stop_token_adds_no_text_and_finishes(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [])
    for token_id in tokenizer.encode("hello"):
        detok.add_token(token_id)
    detok.add_token(tokenizer.eos_token_id, hidden=True)
    assert detok.finished and detok.text == "hello"
    with pytest.raises(RuntimeError):
        detok.add_token(5)


def test_unfinished_character_is_flushed_at_the_end(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [])
    first_byte = tokenizer.encode("🎉")[0]
    detok.add_token(first_byte)
    assert detok.stream_delta() == ""
    detok.finish()
    assert detok.stream_delta() == "\ufffd"
