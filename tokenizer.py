"""The run's tokenizer: a `tiktoken.Encoding` with its stop ids and chat template, read from a Hugging
Face checkpoint or trained in place for the laptop demo.

`Tokenizer` is what a run uses: encode/decode, `prompt_ids` (the question in the chat template, or the
demo's plain layout), stop and pad ids, and `save`, which writes the Hugging Face tokenizer files.
`load_hf_tokenizer` reads a checkpoint's (byte-level BPE: Qwen2/3, GLM-4.5), whose chat template
chat_template.py renders as transformers' apply_chat_template does; `train_tokenizer` learns the demo's
BPE from the run's own training text (nothing is downloaded) and `demo_tokenizer` wraps it. The BPE is
Sennrich et al. (arXiv 1508.07909); with zero merges the demo's is a plain byte-level tokenizer.

Notable choices:
1. Demo id layout: ids 0..255 are the raw bytes; then up to `num_merges` learned merges; then the
   special tokens <|bos|>, <|eos|>, <|pad|>; then reserved specials up to the model's
   vocabulary size, so that every id a model can sample decodes to something.
2. The demo's pre-tokenisation follows GPT-2's pattern except that every digit is its own pre-token
   (as in LLaMA), so numbers are always spelled digit by digit: arithmetic stays learnable
   and no merge ever spans two digits.
3. The demo's chat layout is deliberately minimal: `<|bos|> question "\\n"` is the prompt and the
   policy's completion (here `<answer>...</answer>`) ends with <|eos|>.
4. tiktoken and HF's BPE merge differently: tiktoken joins the adjacent pair whose concatenation has
   the lowest id (leftmost on ties), HF the pair listed first in tokenizer.json's merges. Call a token's
   *own merge* the two parts its bytes reduce to when tiktoken's BPE runs with only lower ids (minbpe
   recovers GPT-4's merges from tiktoken's ranks the same way). When every token has one, the only
   pairs tiktoken ever sees joinable are own merges (`_check_merges`), so HF encodes exactly as
   tiktoken if its list holds every own merge in id order: `save` writes those, one per token, and
   `hf_encoding` checks a checkpoint's list for them.
5. `encode` treats special-token strings as data, so no text can end or restart a sequence, and reads
   the strings of added tokens that are not special (Qwen3's <think>) as those tokens: tokenizers'
   encode with encode_special_tokens=True (transformers' split_special_tokens=True). `prompt_ids`
   tokenizes the rendered template as transformers does, where every added token's string (the
   template's own <|im_start|>, or one inside the question) is that token.
6. Added tokens are found as tokenizers finds them: leftmost-longest, first those with normalized=false
   in the raw text, then those with normalized=true in the NFC'd text between. A tokenizer.json added
   token that tokenizers would treat otherwise is refused at load, by name (`_added_tokens`): lstrip,
   rstrip, single_word, an empty string (tokenizers ignores it), one listed twice, two normalized ones
   that normalize alike, and one whose id in the file is not the id tokenizers gives it (tokenizers
   ignores the file's ids: a string in the vocabulary gets its vocabulary id, any other the next id
   after the vocabulary and the added tokens before it, so one that reuses a BPE token's id would be a
   second id for that BPE token's bytes); and (`hf_encoding`) one spelled in GPT-2's byte alphabet
   ("Ġx", or "é" NFC'd from a normalized "e\\u0301"), which tokenizers decodes as the bytes it spells.
7. Tool turns are the chat template's append-only delta, rendered as text by chat_template.py (its choice 1)
   and appended to a row's token stream: `tool_stop_id` is the stop token that ends an assistant turn calling
   tools, `tool_turn_ids` the ids after it; inside a tool result a special token's string is data, as in `encode`.
8. The tool-calling demo (`demo_tokenizer(enc, tools=True)`) renames the first reserved specials to
   ChatML's and Qwen3's tool tokens, so every id (and the plain demo's every output) stays; its template is
   chat_template.DEMO_CHAT_TEMPLATE, Qwen3's layout without thinking, so the demo runs the code a Qwen3
   checkpoint runs.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections import Counter
from dataclasses import dataclass

import regex
import tiktoken
import tokenizers

from chat_template import DEMO_CHAT_TEMPLATE, render_chat, template_label, tool_turn, tool_turn_text

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
# The specials' ids follow the byte and merge ranks in this order, so BOS, EOS and PAD move only
# when the number of merges does; reserved specials come after them.
SPECIALS = (BOS, EOS, PAD)
NUM_BYTES = 256  # ids 0..255 are the bytes themselves: any text encodes, with no unknown token
# GPT-2's split with ` ?\p{N}` where GPT-2 has ` ?\p{N}+`: one digit (with an optional leading space)
# per pre-token, as LLaMA splits them. BPE never merges across pre-tokens, so no token holds two
# digits and every number is spelled digit by digit, the same way in every position. The
# Encoding keeps this pattern, so training and encoding split text alike.
PAT_STR = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# The tool-calling demo's turn and tool tokens (demo_tokenizer(enc, tools=True)), Qwen3's strings. The last
# four are written by the model and by tool turns as text, so (as in Qwen3's tokenizer.json) they are not special.
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
DEMO_TOOL_TOKENS = (IM_START, IM_END, "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")


def train_bpe(texts: list[str], num_merges: int) -> dict[bytes, int]:
    """Byte ranks plus up to num_merges merges, most frequent adjacent pair first.

    Ties between equally frequent pairs go to the larger pair (bytewise), so training is
    deterministic. Stops early when no pair occurs twice.
    """
    # Merges never cross pre-tokens, so the text reduces to its distinct pre-tokens ("words") and
    # their counts: each round re-merges every distinct word once, however often it occurs.
    word_counts = Counter(w.encode() for t in texts for w in regex.findall(PAT_STR, t))
    words = {w: [bytes([b]) for b in w] for w in word_counts}  # each word as its current parts
    ranks = {bytes([b]): b for b in range(NUM_BYTES)}
    while len(ranks) < NUM_BYTES + num_merges:  # one pair merged per round, at most one new rank
        pairs = Counter()
        for w, parts in words.items():
            for a, b in zip(parts, parts[1:]):
                pairs[a, b] += word_counts[w]  # a pair inside a word counts once per occurrence of the word
        # A pair seen once would spend a vocabulary slot to save one token in all the text: stop, and
        # leave the unused slots to reserved specials.
        if not pairs or max(pairs.values()) < 2:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))  # ties: the bytewise larger pair
        # The same bytes may already be a token reached by another split ("ab"+"c" and "a"+"bc"); tiktoken
        # ranks bytes, not pairs, so that token keeps its first rank and this round adds none.
        ranks.setdefault(a + b, len(ranks))
        for w, parts in words.items():
            # Left to right without overlap, as BPE applies a merge: (a, a) turns "aaa" into "aa", "a".
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and parts[i] == a and parts[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            words[w] = merged
    return ranks


def build_tokenizer(vocab_size: int, ranks: dict[bytes, int] | None = None) -> tiktoken.Encoding:
    """Encoding of the given ranks (default: the 256 bytes) plus specials up to vocab_size.

    Raises ValueError if vocab_size cannot hold the ranks and the three specials.
    """
    ranks = ranks or {bytes([b]): b for b in range(NUM_BYTES)}
    # Too small a vocabulary would leave no id for a special: refuse it with the minimum.
    if vocab_size < len(ranks) + len(SPECIALS):
        raise ValueError(f"vocab_size={vocab_size} is too small: need at least {len(ranks) + len(SPECIALS)} "
                         f"({len(ranks)} byte/merge tokens + {len(SPECIALS)} specials)")
    # Reserved specials fill every id up to vocab_size, so an id the model's output layer can produce
    # but training never taught still decodes (to its reserved name) instead of failing.
    specials = list(SPECIALS) + [f"<|reserved_{i}|>" for i in range(vocab_size - len(ranks) - len(SPECIALS))]
    return tiktoken.Encoding(
        name=f"everyprompt_bpe_{vocab_size}",
        pat_str=PAT_STR,
        mergeable_ranks=ranks,
        special_tokens={s: len(ranks) + i for i, s in enumerate(specials)},  # ids right after the last rank
        # makes tiktoken check that ranks and specials fill ids 0..vocab_size - 1 exactly, with no gap
        explicit_n_vocab=vocab_size,
    )


def train_tokenizer(texts: list[str], *, vocab_size: int, num_merges: int) -> tiktoken.Encoding:
    """BPE with up to num_merges merges learned from texts, padded with specials to vocab_size."""
    # Checked before training, which can be long, rather than by build_tokenizer after it.
    if num_merges > vocab_size - NUM_BYTES - len(SPECIALS):
        raise ValueError(f"num_merges={num_merges} does not fit vocab_size={vocab_size}: at most "
                         f"{vocab_size - NUM_BYTES - len(SPECIALS)}")
    return build_tokenizer(vocab_size, train_bpe(texts, num_merges))


# --- Hugging Face byte-level BPE ---------------------------------------------------------------

# GPT-2's byte-to-unicode alphabet (Radford et al. 2019, encoder.py's bytes_to_unicode), in which
# tokenizer.json spells tokens: printable Latin-1 bytes stand for themselves, the other 68 for chr(256),
# chr(257), ... in byte order.
_PRINTABLE = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
_EXTRA = iter(range(NUM_BYTES, 2 * NUM_BYTES))
BYTE_CHARS = [chr(b) if b in _PRINTABLE else chr(next(_EXTRA)) for b in range(NUM_BYTES)]  # byte -> character
CHAR_BYTES = {c: b for b, c in enumerate(BYTE_CHARS)}
# The tokenizers library's own NFC, not unicodedata's: Python's Unicode tables (14.0 in 3.11) predate
# marks newer versions assign, which NFC then orders differently (U+0897 .. U+089F).
NFC = tokenizers.normalizers.NFC()


def _hf_str(token: bytes) -> str:
    return "".join(BYTE_CHARS[b] for b in token)


def _is_byte_level(s: str) -> bool:
    return all(c in CHAR_BYTES for c in s)


def _hf_bytes(s: str) -> bytes:
    if not _is_byte_level(s):
        raise ValueError(f"vocabulary entry {s!r} is not in GPT-2's byte-level alphabet: not a byte-level BPE")
    return bytes(CHAR_BYTES[c] for c in s)


def _ranks(enc: tiktoken.Encoding) -> dict[bytes, int]:
    return enc._mergeable_ranks  # tiktoken keeps its ranks, specials and pattern with no public getter


def _specials(enc: tiktoken.Encoding) -> dict[str, int]:
    return enc._special_tokens


def _own_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """The two parts a multi-byte token's bytes reduce to under tiktoken's BPE (join the adjacent pair
    whose concatenation has the lowest rank, leftmost on ties) with only lower ranks; None if they stop
    at three or more parts."""
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, at = ranks[token], -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best:
                best, at = r, i
        if at < 0:
            return None
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    return parts[0], parts[1]


def bpe_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """HF merges that encode exactly as tiktoken's `ranks`: each multi-byte token's own merge, in rank
    order (choice 4). Linear in the vocabulary, seconds at 151k tokens. Raises ValueError naming a
    token whose bytes do not reduce to two parts under lower ranks (no merge list in id order gives it)."""
    merges = []
    for token, r in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1:
            merge = _own_merge(token, ranks)
            if merge is None:
                raise ValueError(f"token {token!r} (id {r}) is not built by BPE from lower ids: no merge list "
                                 f"in id order reproduces it")
            merges.append(merge)
    return merges


def _check_merges(merges: list[tuple[bytes, bytes]], ranks: dict[bytes, int]):
    """Raise ValueError, naming the first offending merge or token, unless HF's BPE with these merges
    encodes exactly as tiktoken's with these ranks: every multi-byte token has its own merge in the list,
    and the own merges come in increasing id order.

    That suffices, whatever else the list holds (transformers' tiktoken converter writes every split of a
    token into two tokens, as in GLM-4.5's tokenizer.json): in tiktoken's BPE, two adjacent parts whose
    concatenation t is a token are always t's own merge (the bytes of their span have evolved exactly as
    t's own bytes do alone, and that run's only two-part state is the own merge), so no other merge
    ever applies in HF either, and the own merges' order is the ids' order.
    """
    last, owned, owns = -1, set(), {}
    for i, (a, b) in enumerate(merges):
        t = a + b
        if t in owned or t not in ranks:
            continue
        if t not in owns:
            owns[t] = _own_merge(t, ranks)
        if owns[t] != (a, b):
            continue  # a merge that never applies
        if ranks[t] < last:
            raise ValueError(f"merge #{i} ({_hf_str(a)!r} {_hf_str(b)!r}) makes id {ranks[t]} after a merge made "
                             f"id {last}: tiktoken ranks a pair by its result's id, so merges must be in id order")
        last = ranks[t]
        owned.add(t)
    for t, r in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(t) > 1 and t not in owned:
            own = _own_merge(t, ranks)
            raise ValueError(f"token {_hf_str(t)!r} (id {r}) lacks its own merge {tuple(map(_hf_str, own))}"
                             if own else f"token {_hf_str(t)!r} (id {r}) is not built by BPE from lower ids")


def _uses_nfc(tj: dict) -> bool:
    """Whether tokenizer.json normalizes text (NFC, as Qwen's does); ValueError for another normalizer."""
    norm = tj.get("normalizer")
    if norm is not None and norm.get("type") != "NFC":
        raise ValueError(f"tokenizer.json normalizer {norm.get('type')!r}: only none or NFC is supported")
    return norm is not None


def _split_pattern(pre: dict | None) -> str:
    """The regex of a Sequence[Split(Regex, Isolated), ByteLevel(use_regex=false)] pre-tokenizer (Qwen2/3,
    GLM-4.5, Llama 3); ValueError naming anything else. tiktoken's pattern must match every character
    (HF keeps unmatched text as pieces, tiktoken drops it), as these models' patterns do."""
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") if s else None for s in steps]
    if kinds != ["Split", "ByteLevel"]:
        raise ValueError(f"tokenizer.json pre_tokenizer {kinds}: only [Split, ByteLevel] is supported")
    split, byte_level = steps
    if split.get("behavior") != "Isolated" or split.get("invert") or "Regex" not in split.get("pattern", {}):
        raise ValueError(f"tokenizer.json Split pre-tokenizer {split}: only an Isolated, non-inverted Regex")
    if byte_level.get("use_regex", True) or byte_level.get("add_prefix_space"):
        raise ValueError(f"tokenizer.json ByteLevel pre-tokenizer {byte_level}: only use_regex=false and "
                         f"add_prefix_space=false are supported")
    return split["pattern"]["Regex"]


def _tokenizers_id(content: str, vocab: dict[str, int], top: int | None) -> int:
    """The id the tokenizers library gives an added token, whatever id tokenizer.json declares (it only
    warns): its vocabulary id if the vocabulary holds the string, else one past `top` (the largest id given
    to the added tokens before it, None: none), or the vocabulary's size if top is below it
    (AddedVocabulary::add_tokens)."""
    if content in vocab:
        return vocab[content]
    return len(vocab) if top is None or (top < len(vocab) and vocab) else top + 1


def _added_tokens(tj: dict) -> list[dict]:
    """tokenizer.json's added tokens, refused (ValueError naming the token's string and id, and why) where
    the tokenizers library would find or number one otherwise than `Tokenizer` does (choice 6)."""
    vocab = tj.get("model", {}).get("vocab", {})
    vocab_names = {i: s for s, i in vocab.items()}
    nfc = _uses_nfc(tj)
    given, declared, matched = {}, {}, {}  # string -> tokenizers' id, the file's id; normalized match -> string
    top = None  # the largest id tokenizers has given an added token so far
    for added in tj.get("added_tokens", []):
        content, i = added["content"], added["id"]
        name = f"tokenizer.json added token {content!r} (id {i})"
        for key in ("lstrip", "rstrip", "single_word"):
            if added.get(key):  # each widens or drops matches by the text around them: not implemented
                raise ValueError(f"{name} has {key}=true: not supported")
        if not content:
            raise ValueError(f"{name} is empty: tokenizers ignores it, so no text would encode to id {i}")
        if content in declared:
            raise ValueError(f"{name} is listed twice (ids {declared[content]} and {i})")
        if added.get("normalized"):
            # tokenizers matches a normalized token by its normalized string: two that normalize alike
            # would be one pattern with two ids
            key = NFC.normalize_str(content) if nfc else content
            if key in matched:
                raise ValueError(f"{name} has normalized=true and normalizes to the same text as added token "
                                 f"{matched[key]!r}")
            matched[key] = content
        hf_id = _tokenizers_id(content, vocab, top)
        if hf_id != i:
            added_names = {j: s for s, j in given.items()}
            if content in vocab:
                why = "the vocabulary holds its string"
            elif i in vocab_names:  # a BPE token's id: that token's bytes would encode to it here
                why = f"id {i} belongs to vocabulary token {vocab_names[i]!r}"
            elif i in added_names:
                why = f"id {i} belongs to added token {added_names[i]!r}"
            else:
                why = f"new added tokens are numbered in file order after the vocabulary's {len(vocab)} tokens"
            raise ValueError(f"{name}: tokenizers ignores that id and gives it id {hf_id} ({why})")
        given[content], declared[content] = hf_id, i
        top = hf_id if top is None else max(top, hf_id)
    return tj.get("added_tokens", [])


def hf_encoding(tokenizer_json: dict | str | os.PathLike) -> tiktoken.Encoding:
    """A byte-level BPE tokenizer.json (a path or its parsed dict) as a tiktoken Encoding: the vocabulary
    as ranks (tokenizer.json ids), every added token as a special, the Split pre-tokenizer's regex.

    Encodes exactly as the `tokenizers` library (choice 4); NFC, if the file has it, and finding added
    tokens in text (their special and normalized flags) are the caller's (`Tokenizer`, choice 6). The
    post-processor is not applied: it only adds tokens when transformers encodes with
    add_special_tokens=True, which apply_chat_template does not. Raises ValueError naming what is not
    supported (another model type, normalizer, pre-tokenizer or decoder; byte_fallback, dropout, subword
    affixes), an added token tokenizers would treat otherwise (`_added_tokens`), or the first merge that
    tiktoken's ranking would not reproduce.
    """
    tj = tokenizer_json if isinstance(tokenizer_json, dict) else _read_json(tokenizer_json)
    model = tj.get("model", {})
    if model.get("type") != "BPE":
        raise ValueError(f"tokenizer.json model type {model.get('type')!r}: only byte-level 'BPE' is supported")
    for key in ("byte_fallback", "dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            raise ValueError(f"tokenizer.json BPE {key}={model[key]!r} is not supported")
    _uses_nfc(tj)
    pattern = _split_pattern(tj.get("pre_tokenizer"))
    if (tj.get("decoder") or {}).get("type") != "ByteLevel":
        raise ValueError(f"tokenizer.json decoder {tj.get('decoder')}: only ByteLevel is supported")
    specials = {added["content"]: added["id"] for added in _added_tokens(tj)}
    # tokenizers writes a merge as [a, b]; older files as "a b" (byte-level tokens hold no space)
    pairs = [m.split(" ") if isinstance(m, str) else m for m in model.get("merges", [])]
    merges = [(_hf_bytes(a), _hf_bytes(b)) for a, b in pairs]
    # Some files list added tokens in the vocabulary too (_added_tokens has checked the ids agree). One
    # that BPE builds (a byte, or a merge's result) stays a rank too: tokenizers' BPE still makes it from
    # text where the added token is data. One no merge builds (GPT-2's <|endoftext|>) is only a special.
    built = {a + b for a, b in merges} | {bytes([b]) for b in range(NUM_BYTES)}
    ranks = {_hf_bytes(s): i for s, i in model["vocab"].items()
             if specials.get(s) != i or (_is_byte_level(s) and _hf_bytes(s) in built)}
    if missing := [b for b in range(NUM_BYTES) if bytes([b]) not in ranks]:
        raise ValueError(f"tokenizer.json vocabulary lacks the single bytes {missing[:8]}...: not a byte-level BPE")
    nfc = _uses_nfc(tj)
    for added in tj.get("added_tokens", []):
        s, i = added["content"], added["id"]
        # tokenizers decodes an added token's string (NFC'd if normalized) through the ByteLevel decoder,
        # which reads a string wholly in GPT-2's alphabet as the bytes it spells there; tiktoken decodes
        # a special to its UTF-8, or to the rank's bytes where the id is a rank's too
        shown = NFC.normalize_str(s) if nfc and added.get("normalized") else s
        theirs = _hf_bytes(shown) if _is_byte_level(shown) else shown.encode()
        ours = _hf_bytes(s) if _is_byte_level(s) and ranks.get(_hf_bytes(s)) == i else s.encode()
        if theirs != ours:
            raise ValueError(f"tokenizer.json added token {s!r} (id {i}) decodes to {theirs!r} in tokenizers (its "
                             f"ByteLevel decoder reads GPT-2's byte alphabet), to {ours!r} here")
    _check_merges(merges, ranks)
    return tiktoken.Encoding(name=f"hf_bpe_{len(ranks)}", pat_str=pattern, mergeable_ranks=ranks,
                             special_tokens=specials)


# --- the run's tokenizer ------------------------------------------------------------------------


def _token_name(enc: tiktoken.Encoding, token_id: int) -> str:
    """A token's string as tokenizer_config.json names it: a special's text, else its byte-level form."""
    names = {i: s for s, i in _specials(enc).items()}
    return names.get(token_id) or _hf_str(enc.decode_single_token_bytes(token_id))


def _token_id(enc: tiktoken.Encoding, name: str) -> int:
    if name in _specials(enc):
        return _specials(enc)[name]
    token = _hf_bytes(name)
    if token not in _ranks(enc):
        raise ValueError(f"token {name!r} named in tokenizer_config.json is not in tokenizer.json")
    return _ranks(enc)[token]


@dataclass(frozen=True)
class Tokenizer:
    """What a run tokenizes with: text <-> ids (Python ints in 0..enc.n_vocab - 1) and a prompt's layout."""

    enc: tiktoken.Encoding
    """The BPE and its specials (the demo's, or every added token of a checkpoint's tokenizer.json)."""
    stop_ids: tuple[int, ...]
    """Ids that end a completion; the first is the end of a turn (generation_config's first eos id)."""
    pad_id: int
    """Id that fills batch rows past their end."""
    bos_id: int | None = None
    """Id that starts a prompt without a chat template (a template writes its own); None: nothing."""
    chat_template: str | None = None
    """Jinja chat template (transformers' format); None: the demo's layout, `[bos] question "\\n"`."""
    normalize: bool = False
    """Unicode NFC on text before it is encoded, as Qwen's tokenizer.json normalizer does."""
    eos_token: str | None = None
    """tokenizer_config.json's eos_token, which templates may read; None: stop_ids[0]'s token."""
    non_special_tokens: frozenset[str] = frozenset()
    """enc's specials that tokenizer.json marks special=false (Qwen3's <think>): `encode` reads their
    strings as these tokens, where it reads a special's string as data."""
    normalized_tokens: frozenset[str] = frozenset()
    """enc's specials that tokenizer.json marks normalized=true: found by their NFC'd strings (if
    `normalize`) in the NFC'd text that the others leave, as tokenizers finds them (choice 6)."""

    def encode(self, text: str) -> list[int]:
        """text's ids (NFC first if `normalize`). Special-token strings in text are data, encoded as their
        bytes, so no text can end or restart a sequence; the strings of `non_special_tokens` are those
        tokens, as in tokenizers' encode with encode_special_tokens=True."""
        if not self.non_special_tokens:  # every added token's string is data: plain BPE
            return self.enc.encode_ordinary(NFC.normalize_str(text) if self.normalize else text)
        return self._encode_added(text, specials_are_text=True)

    def decode(self, ids: list[int]) -> str:
        """Text of ids, specials as their strings; bytes that are not UTF-8 (a completion cut inside a
        character) decode to U+FFFD, as transformers' decode does. An id past the table (a padded row of the
        embedding: SGLang samples over every row, the native engine never does) decodes to nothing, as the
        tokenizers library's decode does; SGLangEngine counts them (engine/ids_past_tokenizer)."""
        return self.enc.decode([i for i in ids if 0 <= i < self.enc.n_vocab])

    def prompt_ids(self, question: str, system: str = "", tools: list[dict] | None = None) -> list[int]:
        """A question's prompt ids. With a chat template: the template rendered with messages
        [system (if given), user: question], `tools` (JSON schemas in OpenAI's function format, put where
        the template puts them; None: no tools) and a generation prompt, tokenized as transformers'
        apply_chat_template(..., tools=tools, add_generation_prompt=True, tokenize=True) does (an added
        token's string anywhere in the rendered text, the question included, is that token). Without:
        `[bos_id] + encode(question + "\\n")`, the demo's layout. Raises ValueError for a system prompt or
        tools without a template, and jinja2's TemplateError for what the template refuses."""
        if self.chat_template is None:
            if system or tools:
                raise ValueError(f"a {'system prompt' if system else 'tool list'} needs a chat template to go in; "
                                 f"this tokenizer has none (demo_tokenizer(enc, tools=True) has one)")
            return ([] if self.bos_id is None else [self.bos_id]) + self.encode(question + "\n")
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": question})
        return self._encode_added(self.render(messages, tools, add_generation_prompt=True), specials_are_text=False)

    def render(self, messages: list[dict], tools: list[dict] | None, *, add_generation_prompt: bool) -> str:
        """The chat template's text for messages (chat_template.render_chat), with the names transformers passes
        (bos/eos/pad_token): a `chat_template.Render`."""
        names = {"bos_token": self.bos_id, "eos_token": self.stop_ids[0], "pad_token": self.pad_id}
        names = {k: _token_name(self.enc, i) for k, i in names.items() if i is not None}
        if self.eos_token is not None:
            names["eos_token"] = self.eos_token
        return render_chat(self.chat_template, messages, tools, add_generation_prompt=add_generation_prompt,
                           names=names)

    @functools.cached_property
    def tool_stop_id(self) -> int:
        """The stop id that ends an assistant turn calling tools, after which `tool_turn_ids` appends: the
        one the template writes after the calls (Qwen3's <|im_end|>), or the one it opens the tool results
        with (GLM-4.5's <|observation|>). Raises ValueError as `tool_turn_ids` does."""
        stops = self._tool_stops()
        stop, _, _ = tool_turn(self.render, 1, stops=tuple(stops), label=template_label(self.chat_template))
        return stops[stop]

    def tool_turn_ids(self, results: list[str]) -> list[int]:
        """The ids that follow an assistant turn which called len(results) tools and ended with
        `tool_stop_id`: the tool results as the chat template renders them, then the generation prompt of
        the next assistant turn (chat_template.py's choice 1). Appended to the row's token stream, never
        re-rendered from text, they give the ids apply_chat_template(..., add_generation_prompt=True,
        tokenize=True) gives for the whole conversation (assistant message with tool_calls, one tool message
        per result) when the assistant's text is canonical. A special token's string inside a result is data,
        as in `encode`: no tool output can end or open a turn. Raises ValueError for a tokenizer without a
        template, and as chat_template.tool_turn_text does (no results; a template that is not append-only
        for tool turns, naming it and where it differs)."""
        stops = self._tool_stops()
        text, data = tool_turn_text(self.render, results, stops=tuple(stops), label=template_label(self.chat_template))
        return self._encode_added(text, specials_are_text=False, data_spans=data)

    def _tool_stops(self) -> dict[str, int]:
        """The stop tokens' strings -> their ids, in stop_ids' order; ValueError without a chat template."""
        if self.chat_template is None:
            raise ValueError("tool turns need a chat template; this tokenizer has none "
                             "(demo_tokenizer(enc, tools=True) has one)")
        return {_token_name(self.enc, i): i for i in self.stop_ids}

    @functools.cached_property
    def _added_passes(self) -> tuple[tuple[re.Pattern, dict[str, tuple[int, bool]]] | None, ...]:
        """The two passes in which tokenizers finds added tokens (choice 6): those with normalized=false,
        then those with normalized=true by their NFC'd strings (if `normalize`). Each a pattern and its
        matches' (id, whether special); None where the pass has no token."""
        passes = []
        for normalized in (False, True):
            found = {(NFC.normalize_str(s) if normalized and self.normalize else s):
                     (i, s not in self.non_special_tokens)
                     for s, i in _specials(self.enc).items() if (s in self.normalized_tokens) == normalized}
            # Longest first: tokenizers matches leftmost-longest (Aho-Corasick), a regex alternation
            # leftmost-first, so at each position the longest string that matches there wins.
            names = sorted(found, key=len, reverse=True)
            passes.append((re.compile("|".join(map(re.escape, names))), found) if names else None)
        return tuple(passes)

    @staticmethod
    def _split_added(text: str, added: tuple[re.Pattern, dict[str, tuple[int, bool]]] | None,
                     is_data) -> list[tuple[str | int, int]]:
        """text cut at the added tokens that `added` (an `_added_passes` pass) finds: text pieces and ids,
        each with its offset in text. A special's match for which is_data(start, end) is true stays text,
        and still hides the tokens overlapping it, as tokenizers' encode_special_tokens skips a match only
        after finding it."""
        if added is None:
            return [(text, 0)]
        pattern, found = added
        parts, start = [], 0
        for m in pattern.finditer(text):
            token_id, special = found[m.group()]
            if not (special and is_data(m.start(), m.end())):
                parts += [(text[start:m.start()], start), (token_id, m.start())]
                start = m.end()
        return parts + [(text[start:], start)]

    def _encode_added(self, text: str, *, specials_are_text: bool,
                      data_spans: tuple[tuple[int, int], ...] = ()) -> list[int]:
        """text's ids, every added token's string read as that token, except a special's where
        specials_are_text, or where its match overlaps one of data_spans ((start, end) offsets in text)."""
        # As tokenizers' AddedVocabulary::extract_and_normalize: the normalized=false tokens are split out
        # of the raw text, each piece between is normalized on its own (NFC never joins a special's ">" to a
        # mark), the normalized=true tokens are split out of those, and BPE encodes what is left.
        def is_data(start: int, end: int) -> bool:
            return specials_are_text or any(a < end and start < b for a, b in data_spans)

        raw, normalized = self._added_passes
        ids = []
        for part, at in self._split_added(text, raw, is_data):
            if isinstance(part, int):
                ids.append(part)
                continue
            # NFC moves offsets: a normalized special in a piece that holds any data is data (the safe side)
            piece_is_data = is_data(at, at + len(part))
            part = NFC.normalize_str(part) if self.normalize else part
            for piece, _ in self._split_added(part, normalized, lambda start, end: piece_is_data):
                ids += [piece] if isinstance(piece, int) else self.enc.encode_ordinary(piece)
        return ids

    def save(self, path: str):
        """Write the Hugging Face tokenizer files into folder path, which transformers' AutoTokenizer,
        tokenizers.Tokenizer.from_file and load_hf_tokenizer load to the same ids: tokenizer.json
        (the ranks as a byte-level BPE vocabulary with their own merges in id order (`bpe_merges`), the
        pattern as a Split pre-tokenizer, the specials as added tokens with their special and normalized
        flags, NFC if `normalize`),
        tokenizer_config.json (bos/eos/pad names, the template), chat_template.jinja, and
        generation_config.json's eos_token_id (the stop ids), pad_token_id and bos_token_id (other keys
        of an existing file are kept). Raises ValueError (bpe_merges') for ranks no merge list gives."""
        os.makedirs(path, exist_ok=True)
        ranks = _ranks(self.enc)
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
        tokenizer = {
            "version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": s in self.normalized_tokens, "special": s not in self.non_special_tokens}
                             for s, i in sorted(_specials(self.enc).items(), key=lambda kv: kv[1])],
            "normalizer": {"type": "NFC"} if self.normalize else None,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": self.enc._pat_str}, "behavior": "Isolated", "invert": False},
                byte_level]},
            "post_processor": None,
            "decoder": byte_level,
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": {_hf_str(t): r for t, r in sorted(ranks.items(), key=lambda kv: kv[1])},
                      "merges": [[_hf_str(a), _hf_str(b)] for a, b in bpe_merges(ranks)]},
        }
        names = {"eos_token": self.eos_token or _token_name(self.enc, self.stop_ids[0]),
                 "pad_token": _token_name(self.enc, self.pad_id)}
        if self.bos_id is not None:
            names["bos_token"] = _token_name(self.enc, self.bos_id)
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **names}
        jinja_path = os.path.join(path, "chat_template.jinja")
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
            with open(jinja_path, "w", encoding="utf-8") as f:
                f.write(self.chat_template)
        elif os.path.exists(jinja_path):
            os.remove(jinja_path)  # an earlier template there would win over none when loaded
        generation = _read_json(os.path.join(path, "generation_config.json"), {})
        generation.update(eos_token_id=list(self.stop_ids), pad_token_id=self.pad_id)
        if self.bos_id is not None:
            generation["bos_token_id"] = self.bos_id
        for name, obj in (("tokenizer.json", tokenizer), ("tokenizer_config.json", config),
                          ("generation_config.json", generation)):
            with open(os.path.join(path, name), "w", encoding="utf-8") as f:
                json.dump(obj, f, ensure_ascii=False, indent=None if name == "tokenizer.json" else 2)


def _read_json(path: str, default: dict | None = None) -> dict:
    """The JSON of file `path`, or default when it is absent (None: required). Raises ValueError naming the file."""
    if default is not None and not os.path.exists(path):
        return default
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{os.path.basename(path)} is not JSON ({e})") from None


def _chat_template(path: str, config: dict) -> str | None:
    """chat_template.jinja if present, else tokenizer_config's chat_template (a string, or a list of
    named templates, of which "default")."""
    jinja_path = os.path.join(path, "chat_template.jinja")
    if os.path.exists(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        if "default" not in named:
            raise ValueError(f"{path}: tokenizer_config.json has chat templates {sorted(named)} but none named "
                             f"'default'")
        template = named["default"]
    return template


def load_hf_tokenizer(path: str) -> Tokenizer:
    """The tokenizer of a Hugging Face checkpoint folder: tokenizer.json (`hf_encoding`; NFC if it has
    it), tokenizer_config.json (bos/eos/pad token names, as strings or {"content": ...}; the chat
    template), chat_template.jinja (wins over tokenizer_config's) and generation_config.json
    (eos_token_id, an int or a list). stop_ids: generation_config's eos ids, then the tokenizer's eos if
    not among them; pad: pad_token, else the first stop id. Raises ValueError when tokenizer.json is
    missing, a file is not JSON, for what hf_encoding refuses, and when no eos is named anywhere."""
    tokenizer_path = os.path.join(path, "tokenizer.json")
    if not os.path.exists(tokenizer_path):
        raise ValueError(f"{path} holds no tokenizer.json: a checkpoint's tokenizer is read from a Hugging Face "
                         f"fast tokenizer's tokenizer.json (byte-level BPE), with tokenizer_config.json and "
                         f"generation_config.json beside it")
    tj = _read_json(tokenizer_path)
    enc = hf_encoding(tj)
    added = tj.get("added_tokens", [])  # hf_encoding has checked them
    # a file without the flags reads as before they were honoured: special, not normalized
    non_special = frozenset(a["content"] for a in added if not a.get("special", True))
    normalized = frozenset(a["content"] for a in added if a.get("normalized", False))
    config = _read_json(os.path.join(path, "tokenizer_config.json"), {})
    names = {k: v["content"] if isinstance(v, dict) else v
             for k in ("bos_token", "eos_token", "pad_token") if (v := config.get(k)) is not None}
    ids = {k: _token_id(enc, v) for k, v in names.items()}
    eos = _read_json(os.path.join(path, "generation_config.json"), {}).get("eos_token_id")
    stops = [eos] if isinstance(eos, int) else list(eos or [])
    stops += [ids["eos_token"]] if "eos_token" in ids and ids["eos_token"] not in stops else []
    if not stops:
        raise ValueError(f"{path}: no eos_token in tokenizer_config.json and no eos_token_id in "
                         f"generation_config.json: nothing would end a completion")
    return Tokenizer(enc=enc, stop_ids=tuple(stops), pad_id=ids.get("pad_token", stops[0]), bos_id=ids.get("bos_token"),
                     chat_template=_chat_template(path, config), normalize=_uses_nfc(tj),
                     eos_token=names.get("eos_token"), non_special_tokens=non_special, normalized_tokens=normalized)


def demo_tokenizer(enc: tiktoken.Encoding, *, tools: bool = False) -> Tokenizer:
    """The demo's BPE (train_tokenizer / build_tokenizer) as a Tokenizer: <|bos|> starts a prompt,
    <|eos|> ends a completion, <|pad|> pads; no template, so prompt_ids are `[bos] question "\\n"`.

    tools: the layout of a tool-calling run instead (choice 8): the first reserved specials become
    `DEMO_TOOL_TOKENS` (every id stays), DEMO_CHAT_TEMPLATE renders prompts and tool turns as Qwen3's
    does, and <|im_end|> ends a turn. Raises ValueError when enc has too few reserved specials."""
    bos, eos, pad = (enc.encode_single_token(s) for s in SPECIALS)
    if not tools:
        return Tokenizer(enc=enc, stop_ids=(eos,), pad_id=pad, bos_id=bos)
    reserved = sorted((i, s) for s, i in _specials(enc).items() if s not in SPECIALS)
    if len(reserved) < len(DEMO_TOOL_TOKENS):
        raise ValueError(f"{enc.name} has {len(reserved)} reserved specials; the tool tokens need "
                         f"{len(DEMO_TOOL_TOKENS)}: raise model.vocab_size by {len(DEMO_TOOL_TOKENS) - len(reserved)}")
    specials = {s: i for s, i in _specials(enc).items() if s in SPECIALS}
    specials |= {s: i for s, (i, _) in zip(DEMO_TOOL_TOKENS, reserved)}
    specials |= {s: i for i, s in reserved[len(DEMO_TOOL_TOKENS):]}
    tool_enc = tiktoken.Encoding(name=f"{enc.name}_tools", pat_str=enc._pat_str, mergeable_ranks=_ranks(enc),
                                 special_tokens=specials, explicit_n_vocab=enc.n_vocab)
    return Tokenizer(enc=tool_enc, stop_ids=(specials[IM_END], eos), pad_id=pad, bos_id=bos,
                     chat_template=DEMO_CHAT_TEMPLATE, eos_token=IM_END,
                     non_special_tokens=frozenset(DEMO_TOOL_TOKENS[2:]))
