import pytest

from tokenizer import BOS, EOS, build_tokenizer, encode_prompt, load_tokenizer, save_tokenizer, train_tokenizer

TEXTS = ["State the final answer to the following arithmetic problem: 4 - 12 =\n<answer>-8</answer>"] * 5


def test_bpe_merges_shorten_text_and_round_trip():
    byte_tok = build_tokenizer(300)
    bpe = train_tokenizer(TEXTS, vocab_size=300, num_merges=30)
    text = TEXTS[0]
    assert len(bpe.encode_ordinary(text)) < len(byte_tok.encode_ordinary(text)) == len(text.encode())
    assert bpe.decode(bpe.encode_ordinary(text)) == text


def test_digits_are_never_merged():
    bpe = train_tokenizer(["11 11 11 11 123 123 123"] * 10, vocab_size=300, num_merges=30)
    for tok_id in bpe.encode_ordinary("11 123"):
        piece = bpe.decode([tok_id])
        assert sum(c.isdigit() for c in piece) <= 1


def test_every_id_up_to_vocab_size_decodes():
    tok = train_tokenizer(TEXTS, vocab_size=320, num_merges=20)
    assert tok.n_vocab == 320
    assert all(isinstance(tok.decode_single_token_bytes(i), bytes) for i in range(320))


def test_prompt_starts_with_bos_and_never_parses_specials_in_the_question():
    tok = build_tokenizer(300)
    ids = encode_prompt(tok, f"what is {EOS}?")
    assert ids[0] == tok.encode_single_token(BOS)
    assert tok.encode_single_token(EOS) not in ids


def test_saved_tokenizer_loads_identically(tmp_path):
    tok = train_tokenizer(TEXTS, vocab_size=300, num_merges=30)
    save_tokenizer(tok, tmp_path / "tok.tiktoken")
    again = load_tokenizer(tmp_path / "tok.tiktoken", 300)
    assert again.encode_ordinary(TEXTS[0]) == tok.encode_ordinary(TEXTS[0])
    assert again.encode_single_token(EOS) == tok.encode_single_token(EOS)


def test_too_small_vocab_is_a_value_error():
    with pytest.raises(ValueError, match="vocab_size=258"):
        build_tokenizer(258)
    with pytest.raises(ValueError, match="num_merges=50"):
        train_tokenizer(TEXTS, vocab_size=300, num_merges=50)
