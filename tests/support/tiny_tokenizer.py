"""A small, deterministic Hugging Face tokenizer for tests, built offline with the ``tokenizers`` library.

    tok = build_tokenizer()                  # in memory
    tok = build_tokenizer(tmp_path / "tok")  # also saved: AutoTokenizer.from_pretrained(tmp_path / "tok") works

Byte-level BPE (GPT-2 style pre-tokenization, so every string round-trips) whose merges are learned here, by a
fixed rule, from a few fixed sentences: the same vocabulary on every machine and in every process. Special tokens
``<pad>`` (0), ``<bos>`` (1), ``<eos>`` (2) and the chat markers ``<|system|>``, ``<|user|>``, ``<|assistant|>``,
``<|end|>``. Like Llama's tokenizer it adds ``<bos>`` in front of every encoded text (``add_special_tokens=True``)
and no ``<eos>``. Its chat template renders each message as ``<|role|>\\n{content}<|end|>\\n`` after one
``<bos>``, and ``add_generation_prompt=True`` appends ``<|assistant|>\\n``; roles other than system, user and
assistant raise an error.

Others reuse :func:`build_tokenizer` for model-directory fixtures and CLI tests: keep its signature.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
NUM_MERGES = 64

# The text the merges are learned from: fixed, so the vocabulary is too.
SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello there! How are you today? I am fine, thank you.",
    "def train(model, data): return model.fit(data)",
    "The answer is 42, and the question is what the answer is.",
    "Streaming the weights through the GPU, block by block, then the optimizer on the CPU.",
)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def _learn_merges(texts: tuple[str, ...], n: int) -> list[tuple[str, str]]:
    """Plain BPE: repeatedly merge the most frequent adjacent pair; ties go to the smallest pair (deterministic)."""
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words = Counter(w for t in texts for w, _ in pre.pre_tokenize_str(t))
    seqs = {w: list(w) for w in words}
    merges: list[tuple[str, str]] = []
    for _ in range(n):
        pairs: Counter[tuple[str, str]] = Counter()
        for w, count in words.items():
            s = seqs[w]
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] += count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        for w, s in seqs.items():
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and (s[i], s[i + 1]) == best:
                    out.append(s[i] + s[i + 1])
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    return merges


def _build(add_bos: bool = True) -> PreTrainedTokenizerFast:
    merges = _learn_merges(SENTENCES, NUM_MERGES)
    vocab: dict[str, int] = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", vocab["<bos>"])]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20,
    )


def build_tokenizer(save_dir: Path | None = None) -> PreTrainedTokenizerFast:
    """The test tokenizer; saved with ``save_pretrained(save_dir)`` when ``save_dir`` is given."""
    tok = _build(add_bos=True)
    if save_dir is not None:
        tok.save_pretrained(save_dir)
    return tok


def build_tokenizer_without_bos() -> PreTrainedTokenizerFast:
    """The same vocabulary, but encoding adds no ``<bos>`` (like GPT-2's or Qwen's tokenizers)."""
    return _build(add_bos=False)
