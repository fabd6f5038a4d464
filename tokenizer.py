"""A small byte-pair-encoding tokenizer, trained in place and served as a `tiktoken.Encoding`.

Nothing is downloaded. Ids 0..255 are the raw bytes; then up to `num_merges` BPE merges
(Sennrich et al., arXiv 1508.07909) learned from the run's own training text; then the
special tokens <|bos|>, <|eos|>, <|pad|>; then reserved specials up to the model's
vocabulary size, so that every id a model can sample decodes to something. With zero
merges it is a plain byte-level tokenizer.

Pre-tokenisation follows GPT-2's pattern except that every digit is its own pre-token
(as in LLaMA), so numbers are always spelled digit by digit: arithmetic stays learnable
and no merge ever spans two digits.

The chat layout is deliberately minimal: `<|bos|> question "\\n"` is the prompt and the
policy's completion (here `<answer>...</answer>`) ends with <|eos|>.
"""

from __future__ import annotations

import base64
from collections import Counter

import regex
import tiktoken

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIALS = (BOS, EOS, PAD)
NUM_BYTES = 256
PAT_STR = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def train_bpe(texts: list[str], num_merges: int) -> dict[bytes, int]:
    """Byte ranks plus up to num_merges merges, most frequent adjacent pair first.

    Ties between equally frequent pairs go to the larger pair (bytewise), so training is
    deterministic. Stops early when no pair occurs twice.
    """
    word_counts = Counter(w.encode() for t in texts for w in regex.findall(PAT_STR, t))
    words = {w: [bytes([b]) for b in w] for w in word_counts}
    ranks = {bytes([b]): b for b in range(NUM_BYTES)}
    while len(ranks) < NUM_BYTES + num_merges:
        pairs = Counter()
        for w, parts in words.items():
            for a, b in zip(parts, parts[1:]):
                pairs[a, b] += word_counts[w]
        if not pairs or max(pairs.values()) < 2:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks.setdefault(a + b, len(ranks))
        for w, parts in words.items():
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
    if vocab_size < len(ranks) + len(SPECIALS):
        raise ValueError(f"vocab_size={vocab_size} is too small: need at least {len(ranks) + len(SPECIALS)} "
                         f"({len(ranks)} byte/merge tokens + {len(SPECIALS)} specials)")
    specials = list(SPECIALS) + [f"<|reserved_{i}|>" for i in range(vocab_size - len(ranks) - len(SPECIALS))]
    return tiktoken.Encoding(
        name=f"everyprompt_bpe_{vocab_size}",
        pat_str=PAT_STR,
        mergeable_ranks=ranks,
        special_tokens={s: len(ranks) + i for i, s in enumerate(specials)},
        explicit_n_vocab=vocab_size,
    )


def train_tokenizer(texts: list[str], *, vocab_size: int, num_merges: int) -> tiktoken.Encoding:
    """BPE with up to num_merges merges learned from texts, padded with specials to vocab_size."""
    if num_merges > vocab_size - NUM_BYTES - len(SPECIALS):
        raise ValueError(f"num_merges={num_merges} does not fit vocab_size={vocab_size}: at most "
                         f"{vocab_size - NUM_BYTES - len(SPECIALS)}")
    return build_tokenizer(vocab_size, train_bpe(texts, num_merges))


def save_tokenizer(tok: tiktoken.Encoding, path: str):
    """The mergeable ranks in tiktoken's own file format (base64 token, rank per line)."""
    ranks = {t: r for t, r in ((tok.decode_single_token_bytes(i), i) for i in range(tok.n_vocab))
             if r not in tok._special_tokens.values()}
    with open(path, "w") as f:
        f.writelines(f"{base64.b64encode(t).decode()} {r}\n" for t, r in sorted(ranks.items(), key=lambda kv: kv[1]))


def load_tokenizer(path: str, vocab_size: int) -> tiktoken.Encoding:
    """The tokenizer `save_tokenizer` wrote, with specials up to vocab_size."""
    with open(path) as f:
        ranks = {base64.b64decode(t): int(r) for t, r in (line.split() for line in f if line.strip())}
    return build_tokenizer(vocab_size, ranks)


def encode_prompt(tok: tiktoken.Encoding, question: str) -> list[int]:
    """<|bos|> question \\n, as ids. The question's own text is never parsed for specials."""
    return [tok.encode_single_token(BOS)] + tok.encode_ordinary(question + "\n")
