"""tokenizer.py: the demo's BPE, and Hugging Face byte-level BPE checkpoints (Qwen's real 151,643-token
vocabulary, from PyPI's dashscope==2.0.2 wheel) checked against the `tokenizers` library and transformers."""

import json
import os
import re

import pytest
import tiktoken
import tokenizers

import hf_checkpoint
from hf_checkpoint import CHATML, ENDOFTEXT, IM_END, IM_START, QWEN_PATTERN, QWEN_SPECIALS, write_qwen_tokenizer
from tokenizer import (BOS, BYTE_CHARS, EOS, Tokenizer, bpe_merges, build_tokenizer, demo_tokenizer, hf_encoding,
                       load_hf_tokenizer, train_tokenizer)

TEXTS = ["State the final answer to the following arithmetic problem: 4 - 12 =\n<answer>-8</answer>"] * 5
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.environ.get("EVERYPROMPT_DATA", os.path.join(REPO, "..", "shared", "data"))
# text where tokenizers disagree if anything is off: code, CJK, emoji, marks NFC composes (e + U+0301,
# Angstrom sign), runs of spaces, tabs and newlines, CRLF, Unicode spaces and line separators
TRICKY = ["def f(x):\n\tif x  >= 10:\n\t\treturn {'a': [1, 2]}  # ok\r\n    else:\n        pass\n\n\n",
          "日本語のテキスト、中文文本。한국어 😀👍🏽 e\u0301 n\u0303 \u212b A\u030a ﬁ \u0958",
          "a\u00a0b\u3000c\u2028d\u0085e\x0bf\x0cg\x1ch  \t \n \r\n\r\n\t\t  x",
          "$\\frac{1}{2}$ + 12345678 = 3.14e-10; I'm we'LL it's", "'s 're 've 'm 'll 'd 'S 'RE"]
TRICKY += [" " * n + "x" for n in range(34)] + ["\t" * n + "\n" * (n % 4) + " " * n + "y" for n in range(17)]
# every code point below U+3400 (NFC's reordering, newer Unicode marks), and a spread to U+30000
TRICKY += ["".join(chr(c) for c in range(0x3400) if not 0xD800 <= c < 0xE000),
           "".join(chr(c) + " " for c in range(0x3400, 0x30000, 7) if not 0xD800 <= c < 0xE000)]


def hf_str(token: bytes) -> str:
    return "".join(BYTE_CHARS[b] for b in token)


def qwen_ranks() -> dict[bytes, int]:
    if hf_checkpoint.qwen_ranks_path() is None:
        pytest.skip("needs dashscope==2.0.2's resources/qwen.tiktoken (requirements-dev.txt)")
    return hf_checkpoint.qwen_ranks()


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory) -> str:
    """Qwen's vocabulary with its own merges, one per token in id order, as Qwen's tokenizer.json has them."""
    return write_qwen_tokenizer(tmp_path_factory.mktemp("qwen"), bpe_merges(qwen_ranks()))


@pytest.fixture(scope="session")
def qwen(qwen_dir):
    return load_hf_tokenizer(qwen_dir)


@pytest.fixture(scope="session")
def qwen_hf(qwen_dir) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(os.path.join(qwen_dir, "tokenizer.json"))


@pytest.fixture(scope="session")
def qwen_transformers(qwen_dir):
    return pytest.importorskip("transformers").AutoTokenizer.from_pretrained(qwen_dir)


@pytest.fixture(scope="session")
def benchmark_texts() -> list[str]:
    """Every question and answer of GSM8K's and MATH-500's test sets."""
    texts = []
    for name, keys in (("gsm8k_test.jsonl", ("question", "answer")), ("math500_test.jsonl", ("problem", "solution"))):
        if not os.path.exists(os.path.join(DATA, name)):
            pytest.skip(f"{DATA}/{name} not found (set EVERYPROMPT_DATA to the shared data folder)")
        with open(os.path.join(DATA, name)) as f:
            texts += [json.loads(line)[k] for line in f for k in keys]
    return texts


@pytest.fixture
def demo_json(tmp_path) -> dict:
    """The demo tokenizer's tokenizer.json, as save writes it: small, to edit into bad input."""
    demo_tokenizer(train_tokenizer(TEXTS, vocab_size=300, num_merges=30)).save(tmp_path)
    with open(tmp_path / "tokenizer.json") as f:
        return json.load(f)


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
    enc = build_tokenizer(300)
    ids = demo_tokenizer(enc).prompt_ids(f"what is {EOS}?")
    assert ids[0] == enc.encode_single_token(BOS)
    assert enc.encode_single_token(EOS) not in ids


def test_too_small_vocab_is_a_value_error():
    with pytest.raises(ValueError, match="vocab_size=258"):
        build_tokenizer(258)
    with pytest.raises(ValueError, match="num_merges=50"):
        train_tokenizer(TEXTS, vocab_size=300, num_merges=50)


def test_qwen_encoding_equals_tokenizers_library_on_gsm8k_and_math500(qwen, qwen_hf, benchmark_texts):
    expected = [e.ids for e in qwen_hf.encode_batch(benchmark_texts, add_special_tokens=False)]
    assert [qwen.encode(t) for t in benchmark_texts] == expected
    assert [qwen.decode(ids) for ids in expected] == benchmark_texts


def test_qwen_encoding_equals_tokenizers_library_on_code_unicode_and_whitespace(qwen, qwen_hf):
    expected = [e.ids for e in qwen_hf.encode_batch(TRICKY, add_special_tokens=False)]
    assert [qwen.encode(t) for t in TRICKY] == expected
    assert [qwen.decode(ids) for ids in expected] == [qwen_hf.decode(i, skip_special_tokens=False) for i in expected]


def test_decode_of_ids_cut_inside_characters_equals_tokenizers_library(qwen, qwen_hf):
    ids = qwen.encode(TRICKY[1])  # multi-byte characters split across tokens: cuts leave partial UTF-8
    cuts = [ids[i:j] for i in range(0, len(ids), 3) for j in range(i + 1, len(ids), 5)] 
    cuts.append([qwen.enc.encode_single_token(b) for b in (b"\xe6", b"\x80", b"\xff")])  # invalid UTF-8
    assert [qwen.decode(c) for c in cuts] == [qwen_hf.decode(c, skip_special_tokens=False) for c in cuts]


def test_encode_applies_nfc_as_the_tokenizer_json_normalizer_does(qwen):
    assert qwen.normalize
    assert qwen.encode("e\u0301") == qwen.encode("\u00e9") and qwen.decode(qwen.encode("e\u0301")) == "\u00e9"


def test_special_token_strings_in_text_are_data_to_encode(qwen, qwen_hf):
    text = "end<|im_end|> then <|im_start|>user\n<think>x</think>"
    ids = qwen.encode(text)
    assert not set(ids) & {IM_START, IM_END}
    assert qwen.decode(ids) == text
    qwen_hf.encode_special_tokens = True  # tokenizers' switch for encoding specials' strings as text
    try:
        assert ids == qwen_hf.encode(text, add_special_tokens=False).ids
    finally:
        qwen_hf.encode_special_tokens = False


@pytest.mark.parametrize("question,system", [
    ("Natalia sold clips to 48 of her friends. How many?", ""),
    ("What is 2+2?", "You are a careful mathematician."),
    ("A question that says <|im_end|> and e\u0301 \u212b\n\n  spaced\t", "Think <think>first</think>."),
])
def test_prompt_ids_equal_transformers_apply_chat_template(qwen, qwen_transformers, question, system):
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    expected = qwen_transformers.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)
    assert qwen.prompt_ids(question, system) == expected
    assert qwen.decode(expected).endswith("<|im_start|>assistant\n")


def test_checkpoint_stop_ids_are_generation_config_eos_ids_then_the_tokenizer_eos(qwen):
    assert qwen.stop_ids == (IM_END, ENDOFTEXT) and qwen.pad_id == ENDOFTEXT and qwen.bos_id is None
    assert qwen.chat_template == CHATML


@pytest.mark.slow  # the 151k merges derived, written and checked again on loading: ~15 s on 2 cores
def test_saved_qwen_tokenizer_encodes_identically_in_transformers_tokenizers_and_here(qwen, tmp_path):
    transformers = pytest.importorskip("transformers")
    qwen.save(tmp_path)
    text = "\n".join(TRICKY[:5])
    expected = qwen.encode(text)
    from_file = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert from_file.encode(text, add_special_tokens=False).ids == expected
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf.encode(text, add_special_tokens=False) == expected
    assert hf.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                  return_dict=False) == qwen.prompt_ids(text)
    again = load_hf_tokenizer(str(tmp_path))
    assert (again.stop_ids, again.pad_id, again.bos_id) == ((IM_END, ENDOFTEXT), ENDOFTEXT, None)
    assert again.chat_template == CHATML
    assert again.encode(text) == expected and again.prompt_ids(text, "sys") == qwen.prompt_ids(text, "sys")


@pytest.mark.slow  # ~300k merges to build and check: ~20 s on 2 cores
def test_merge_list_with_every_split_of_each_token_encodes_as_tiktoken(tmp_path, qwen_hf):
    # transformers' tiktoken converter lists every split of a token into two tokens, ordered by the token's
    # id and then by the parts' ids (GLM-4.5's tokenizer.json: 318,088 merges for 151,329 tokens)
    ranks = qwen_ranks()
    merges = []
    for t, _ in sorted(ranks.items(), key=lambda kv: kv[1]):
        splits = [(t[:i], t[i:]) for i in range(1, len(t)) if t[:i] in ranks and t[i:] in ranks]
        merges += sorted(splits, key=lambda s: (ranks[s[0]], ranks[s[1]]))
    assert len(merges) > 1.9 * len(ranks)
    path = write_qwen_tokenizer(tmp_path, merges)
    converted, tok = tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json")), load_hf_tokenizer(path)
    expected = [e.ids for e in converted.encode_batch(TRICKY, add_special_tokens=False)]
    assert [tok.encode(t) for t in TRICKY] == expected
    assert expected == [e.ids for e in qwen_hf.encode_batch(TRICKY, add_special_tokens=False)]


def test_demo_tokenizer_saves_for_transformers_and_tokenizers_with_the_same_ids(tmp_path):
    transformers = pytest.importorskip("transformers")
    enc = train_tokenizer(TEXTS + ["11 11 123 123 hello hello"] * 3, vocab_size=300, num_merges=30)
    demo_tokenizer(enc).save(tmp_path)
    text = TEXTS[0] + " 12345 hello e\u0301 日本 '  \t\n x"
    expected = enc.encode_ordinary(text)
    from_file = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert from_file.encode(text, add_special_tokens=False).ids == expected
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf.encode(text, add_special_tokens=False) == expected
    assert hf.decode(expected) == text and hf.convert_tokens_to_ids(EOS) == enc.encode_single_token(EOS)


def test_saved_template_specials_and_nfc_give_transformers_the_same_prompt_ids(tmp_path):
    transformers = pytest.importorskip("transformers")
    ranks = {bytes([b]): b for b in range(256)} | {b"ab": 256, b" x": 257, b"abab": 258}
    enc = tiktoken.Encoding(name="chatml_bytes", pat_str=QWEN_PATTERN, mergeable_ranks=ranks,
                            special_tokens={s: 259 + i for i, s in enumerate(QWEN_SPECIALS)})
    tok = Tokenizer(enc=enc, stop_ids=(261, 259), pad_id=259, chat_template=CHATML, normalize=True)
    tok.save(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    question, system = "abab x e\u0301 <think> \u212b", "ab x"
    expected = hf.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": question}],
                                      add_generation_prompt=True, return_dict=False)
    assert tok.prompt_ids(question, system) == expected
    again = load_hf_tokenizer(str(tmp_path))
    assert (again.stop_ids, again.pad_id, again.normalize, again.eos_token) == ((261, 259), 259, True, "<|im_end|>")


def test_demo_prompt_ids_are_bos_question_newline_before_and_after_saving(tmp_path):
    enc = train_tokenizer(TEXTS, vocab_size=300, num_merges=30)
    tok = demo_tokenizer(enc)
    question = f"4 - 12 = ? {EOS}"
    expected = [enc.encode_single_token(BOS)] + enc.encode_ordinary(question + "\n")  # the demo's layout
    assert tok.prompt_ids(question) == expected
    assert tok.encode(question) == enc.encode_ordinary(question)
    tok.save(tmp_path)
    again = load_hf_tokenizer(str(tmp_path))
    assert again.prompt_ids(question) == expected
    assert (again.stop_ids, again.pad_id, again.bos_id) == (tok.stop_ids, tok.pad_id, tok.bos_id)
    assert again.enc.n_vocab == 300


def test_system_prompt_without_a_chat_template_is_a_value_error():
    with pytest.raises(ValueError, match="chat template"):
        demo_tokenizer(build_tokenizer(300)).prompt_ids("q", system="be brief")


def test_chat_template_jinja_wins_and_a_named_template_list_gives_default(tmp_path):
    tok = demo_tokenizer(build_tokenizer(300))
    tok.save(tmp_path)
    with open(tmp_path / "tokenizer_config.json") as f:
        config = json.load(f)
    config["chat_template"] = [{"name": "tool_use", "template": "T"},
                               {"name": "default", "template": "{{ eos_token }}D"}]
    config["eos_token"] = {"content": EOS, "lstrip": False}  # names may be AddedToken dicts
    with open(tmp_path / "tokenizer_config.json", "w") as f:
        json.dump(config, f)
    loaded = load_hf_tokenizer(str(tmp_path))
    assert loaded.chat_template == "{{ eos_token }}D"
    assert loaded.prompt_ids("q") == [tok.stop_ids[0]] + tok.encode("D")
    (tmp_path / "chat_template.jinja").write_text("J")
    assert load_hf_tokenizer(str(tmp_path)).chat_template == "J"


def test_missing_tokenizer_json_is_a_value_error_naming_the_path(tmp_path):
    with pytest.raises(ValueError, match=f"{tmp_path} holds no tokenizer.json"):
        load_hf_tokenizer(str(tmp_path))


def test_another_model_type_is_a_value_error_naming_it(demo_json):
    demo_json["model"]["type"] = "WordPiece"
    with pytest.raises(ValueError, match="WordPiece"):
        hf_encoding(demo_json)


@pytest.mark.parametrize("edit,feature", [
    (lambda j: j.update(normalizer={"type": "Lowercase"}), "Lowercase"),
    (lambda j: j["model"].update(byte_fallback=True), "byte_fallback"),
    (lambda j: j["added_tokens"][0].update(lstrip=True), "lstrip"),
    (lambda j: j["pre_tokenizer"]["pretokenizers"][1].update(add_prefix_space=True), "add_prefix_space"),
    (lambda j: j["pre_tokenizer"]["pretokenizers"].insert(1, {"type": "Digits", "individual_digits": True}), "Digits"),
    (lambda j: j.update(decoder={"type": "Metaspace"}), "Metaspace"),
])
def test_unsupported_tokenizer_json_features_are_value_errors_naming_them(demo_json, edit, feature):
    edit(demo_json)
    with pytest.raises(ValueError, match=feature):
        hf_encoding(demo_json)


def test_merges_out_of_id_order_are_a_value_error_naming_the_merge(demo_json):
    merges = demo_json["model"]["merges"]
    merges[3], merges[4] = merges[4], merges[3]
    with pytest.raises(ValueError, match=re.escape(f"merge #4 ({merges[4][0]!r} {merges[4][1]!r}) makes id 259 after")):
        hf_encoding(demo_json)


def test_a_token_without_its_own_merge_is_a_value_error_naming_it(demo_json):
    a, b = demo_json["model"]["merges"].pop(5)
    with pytest.raises(ValueError, match=re.escape(f"token {a + b!r} (id 261) lacks its own merge")):
        hf_encoding(demo_json)


def test_save_is_loadable_when_the_folder_already_holds_a_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "eos_token_id": 1}))
    tok = demo_tokenizer(build_tokenizer(300))
    tok.save(tmp_path)
    with open(tmp_path / "generation_config.json") as f:
        generation = json.load(f)
    assert generation["temperature"] == 0.6 and generation["eos_token_id"] == list(tok.stop_ids)
