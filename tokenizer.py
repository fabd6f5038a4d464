"""A small byte-pair-encoding tokenizer, trained in place and served as a `tiktoken.Encoding`.

This file owns the run's tokenizer: train_tokenizer learns it from the run's own training
text (nothing is downloaded), save_tokenizer / load_tokenizer carry it to the output folder
and back, and encode_prompt lays out a prompt. The BPE is Sennrich et al. (arXiv 1508.07909);
with zero merges it is a plain byte-level tokenizer.

Notable choices:
1. Id layout: ids 0..255 are the raw bytes; then up to `num_merges` learned merges; then the
   special tokens <|bos|>, <|eos|>, <|pad|>; then reserved specials up to the model's
   vocabulary size, so that every id a model can sample decodes to something.
2. Pre-tokenisation follows GPT-2's pattern except that every digit is its own pre-token
   (as in LLaMA), so numbers are always spelled digit by digit: arithmetic stays learnable
   and no merge ever spans two digits.
3. The chat layout is deliberately minimal: `<|bos|> question "\\n"` is the prompt and the
   policy's completion (here `<answer>...</answer>`) ends with <|eos|>.
"""

from __future__ import annotations

import base64
from collections import Counter

import regex
import tiktoken

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


def save_tokenizer(tok: tiktoken.Encoding, path: str):
    """The mergeable ranks in tiktoken's own file format (base64 token, rank per line)."""
    # Only the mergeable ranks are saved: load_tokenizer rebuilds the specials from vocab_size. The
    # specials' ids are read from tiktoken's private `_special_tokens`.
    ranks = {t: r for t, r in ((tok.decode_single_token_bytes(i), i) for i in range(tok.n_vocab))
             if r not in tok._special_tokens.values()}
    with open(path, "w") as f:
        f.writelines(f"{base64.b64encode(t).decode()} {r}\n" for t, r in sorted(ranks.items(), key=lambda kv: kv[1]))


def load_tokenizer(path: str, vocab_size: int) -> tiktoken.Encoding:
    """The tokenizer `save_tokenizer` wrote, with specials up to vocab_size."""
    with open(path) as f:
        ranks = {base64.b64decode(t): int(r) for t, r in (line.split() for line in f if line.strip())}
    # The specials get the ids they had, as they follow the ranks in a fixed order.
    return build_tokenizer(vocab_size, ranks)


def encode_prompt(tok: tiktoken.Encoding, question: str) -> list[int]:
    """<|bos|> question \\n, as ids. The question's own text is never parsed for specials."""
    # encode_ordinary: a question that contains "<|eos|>" is data, encoded as its bytes, so no text
    # can end or restart a sequence.
    return [tok.encode_single_token(BOS)] + tok.encode_ordinary(question + "\n")
