"""A small tokenizer.json made by the tests themselves (no download): byte-level BPE with a
BOS token, like a Llama-style tokenizer, trained on a fixed corpus; beside it a
``tokenizer_config.json`` with a ChatML-style chat template (BOS first, a ``/no_think``
switch from ``chat_template_kwargs``), as a model directory has."""

from __future__ import annotations

import json
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

#: ChatML-like, with the special token and a template variable the request can set.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}/no_think\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tokenizer_json(
    path: Path,
    vocab_size: int = 400,
    corpus: Sequence[str] | None = None,
    chat_template: str | None = CHAT_TEMPLATE,
) -> Path:
    """Train and save the tokenizer (on ``corpus``, default a fixed one) and, unless
    ``chat_template`` is ``None``, a ``tokenizer_config.json`` beside it; returns ``path``."""
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
    if chat_template is not None:
        config = {"bos_token": "<s>", "eos_token": "<s>", "chat_template": chat_template}
        path.with_name("tokenizer_config.json").write_text(json.dumps(config))
    return path
