"""A small tokenizer.json made by the tests themselves (no download): byte-level BPE with a
BOS token, like a Llama-style tokenizer, trained on a fixed corpus."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

_CORPUS = [
    "You are a helpful assistant. Answer the question below in one short paragraph.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "def route(request): return min(endpoints, key=lambda e: e.queue_depth)",
    "Summarize the following document about prefix caching and KV-cache events.",
    "Routing decisions depend on which server already holds the prompt's blocks.",
] * 20


def write_tokenizer_json(
    path: Path, vocab_size: int = 400, corpus: Sequence[str] | None = None
) -> Path:
    """Train and save the tokenizer (on ``corpus``, default a fixed one); returns ``path``."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS if corpus is None else corpus, trainer=trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)]
    )
    tokenizer.save(str(path))
    return path
