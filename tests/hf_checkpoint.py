"""Small random HF checkpoints in the hub layout, as a user's would look, for tests and benches.

`build_checkpoint(dir, family)` writes what `init_hf=` reads: a random Qwen3-MoE or GLM-4.5
model saved by transformers (config.json, model.safetensors), a real byte-level BPE
vocabulary (Qwen's 151,643 ranks, which PyPI's dashscope wheel ships as
resources/qwen.tiktoken) with Qwen's special tokens and pre-tokenizer pattern, a ChatML chat
template in Qwen's shape, and generation_config.json with Qwen's two stop tokens. The
tokenizer.json is built by the `tokenizers` library, so what this project reads is what HF
wrote (tests/test_tokenizer.py checks the two agree).

    python tests/hf_checkpoint.py /tmp/hf_tiny [--family glm4_moe]
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Qwen2's pre-tokenizer split (its tokenizer.json's Split regex): letters with one leading non-letter,
# digits one by one, punctuation runs with their newlines, whitespace runs
QWEN_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
# Qwen's added tokens in Qwen's order: ids 151643, 151644, ...
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                 "<tool_call>", "</tool_call>", "<think>", "</think>"]
ENDOFTEXT, IM_START, IM_END = 151643, 151644, 151645
QWEN_VOCAB = 151936  # Qwen3's embedding rows: the ranks and specials, padded to a multiple of 128
# ChatML in Qwen's shape: <|im_start|>role\ncontent<|im_end|>\n per message, then the assistant's turn opened
CHATML = ("{%- for message in messages %}"
          "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
          "{%- endfor %}"
          "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
FAMILIES = ("qwen3_moe", "glm4_moe")


def qwen_ranks_path() -> str | None:
    """Path of dashscope's qwen.tiktoken (base64 token and rank per line), None if dashscope is not installed."""
    spec = importlib.util.find_spec("dashscope")  # finds the package without importing it (and its deps)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "resources", "qwen.tiktoken")
    return path if os.path.exists(path) else None


def qwen_ranks() -> dict[bytes, int]:
    """Qwen's 151,643 byte-level BPE ranks. Raises RuntimeError without dashscope's file."""
    path = qwen_ranks_path()
    if path is None:
        raise RuntimeError("needs dashscope==2.0.2's resources/qwen.tiktoken (pip install -r requirements-dev.txt)")
    with open(path) as f:
        return {base64.b64decode(t): int(r) for t, r in (line.split() for line in f if line.strip())}


def write_tokenizer_json(path: str, ranks: dict[bytes, int], merges: list[tuple[bytes, bytes]], specials: list[str],
                         non_special: frozenset[str] = frozenset()):
    """A Qwen-style tokenizer.json in folder path, built by the `tokenizers` library (not by this project): NFC,
    Qwen's split, byte-level BPE of ranks and merges, then specials as added tokens after the ranks (those in
    non_special with special=false, as Qwen3's <tool_call> and <think>)."""
    import tokenizers
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

    from tokenizer import BYTE_CHARS

    def hf_str(token: bytes) -> str:  # the byte-level alphabet tokenizer.json spells tokens in
        return "".join(BYTE_CHARS[b] for b in token)
    bpe = models.BPE(vocab={hf_str(t): r for t, r in ranks.items()}, merges=[(hf_str(a), hf_str(b)) for a, b in merges])
    tk = tokenizers.Tokenizer(bpe)
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated"),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(s, special=s not in non_special, normalized=False) for s in specials])
    os.makedirs(path, exist_ok=True)
    tk.save(os.path.join(path, "tokenizer.json"))


def write_qwen_tokenizer(path: str, merges: list[tuple[bytes, bytes]] | None = None, *, num_ranks: int | None = None,
                         specials: list[str] = QWEN_SPECIALS) -> str:
    """A Qwen-style checkpoint's tokenizer files in path, tokenizer.json built by the `tokenizers` library
    (not by this project): NFC, Qwen's split, byte-level BPE, Qwen's added tokens; tokenizer_config.json
    with the ChatML template; generation_config.json stopping at <|im_end|> and <|endoftext|>. merges:
    default one per token in id order, as Qwen's tokenizer.json has them. num_ranks: keep only Qwen's
    first ranks (a small vocabulary); the specials (which must hold ChatML's three) follow the ranks."""
    from tokenizer import bpe_merges
    ranks = {t: r for t, r in qwen_ranks().items() if num_ranks is None or r < num_ranks}
    merges = bpe_merges(ranks) if merges is None else merges
    endoftext, im_end = (len(ranks) + specials.index(s) for s in ("<|endoftext|>", "<|im_end|>"))
    write_tokenizer_json(path, ranks, merges, specials)
    config = {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "chat_template": CHATML}
    generation = {"eos_token_id": [im_end, endoftext], "pad_token_id": endoftext}
    for name, obj in (("tokenizer_config.json", config), ("generation_config.json", generation)):
        with open(os.path.join(path, name), "w") as f:
            json.dump(obj, f)
    return str(path)


def model_config(family: str, **overrides):
    """A transformers config of the family: 2 layers of width 64, 8 experts of 32, top-2, Qwen's vocabulary."""
    import transformers
    common = dict(vocab_size=QWEN_VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
                  bos_token_id=None, eos_token_id=IM_END, pad_token_id=ENDOFTEXT, tie_word_embeddings=False)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**{**common, "num_experts": 8, **overrides})
    if family == "glm4_moe":  # a dense first block, one shared expert, q/k/v bias, half-rotary, as GLM-4.5-Air
        return transformers.Glm4MoeConfig(**{**common, "n_routed_experts": 8, "n_shared_experts": 1,
                                             "first_k_dense_replace": 1, "attention_bias": True,
                                             "partial_rotary_factor": 0.5, **overrides})
    raise ValueError(f"family={family!r}; valid: {FAMILIES}")


def scorer_config_folder(path, architecture: str, *, context: int = 4096, vocab_size: int = 1000) -> str:
    """A folder holding only the config.json of a small Qwen3-MoE (2 layers, width 64): a one-label sequence
    classifier (a reward model) or a causal LM (a judge), `context` tokens long. What the dry run and
    train.prepare read of a scorer; no weights."""
    config = {"model_type": "qwen3_moe", "architectures": [architecture], "vocab_size": vocab_size, "hidden_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "intermediate_size": 128,
              "max_position_embeddings": context}
    if architecture.endswith("ForSequenceClassification"):
        config.update(id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


def build_checkpoint(path: str, family: str = "qwen3_moe", *, seed: int = 0, num_ranks: int | None = None,
                     specials: list[str] = QWEN_SPECIALS, classifier: bool = False, **overrides) -> str:
    """Write a random `family` checkpoint with Qwen's tokenizer and chat template to path; returns path.
    num_ranks, specials: a vocabulary of Qwen's first num_ranks ranks and these specials (write_qwen_tokenizer),
    the embedding sized to them; default all of Qwen's, padded to QWEN_VOCAB rows. classifier: a one-label
    ...ForSequenceClassification (a reward model: reward.model=<path>) instead of a causal LM."""
    import transformers
    torch.manual_seed(seed)
    if num_ranks is not None:  # the specials follow the ranks
        overrides = dict(vocab_size=num_ranks + len(specials), eos_token_id=num_ranks + specials.index("<|im_end|>"),
                         pad_token_id=num_ranks + specials.index("<|endoftext|>"), **overrides)
    if classifier:
        overrides = dict(num_labels=1, **overrides)
    auto = transformers.AutoModelForSequenceClassification if classifier else transformers.AutoModelForCausalLM
    model = auto.from_config(model_config(family, **overrides), dtype=torch.float32)
    model.save_pretrained(path)
    # after save_pretrained: its generation_config.json is replaced
    return write_qwen_tokenizer(path, num_ranks=num_ranks, specials=specials)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="write a small random HF checkpoint with Qwen's tokenizer")
    ap.add_argument("path")
    ap.add_argument("--family", default="qwen3_moe", choices=FAMILIES)
    ap.add_argument("--classifier", action="store_true", help="a one-label sequence classifier: a reward model")
    args = ap.parse_args()
    print(build_checkpoint(args.path, args.family, classifier=args.classifier))
