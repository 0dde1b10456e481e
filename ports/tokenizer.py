"""The model's tokenizer and chat template, for computing the server's block keys from a
request: a completions prompt is tokenized as it is; a chat request's messages are first
rendered into one prompt text by the model's chat template, as the model server does."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

__all__ = ["ChatTemplate", "ChatTemplateError", "Tokenizer", "TokenizerError"]


class TokenizerError(Exception):
    """The tokenizer could not be loaded (the message names the path) or could not encode."""


class ChatTemplateError(Exception):
    """The chat template could not be loaded (the message names the path), or could not
    render a conversation (bad messages, a template error, content it does not handle)."""


class Tokenizer(Protocol):
    """Text to token ids as the model server computes them: with ``add_special_tokens``
    (a completions prompt) special tokens such as BOS are added; without (a rendered chat
    prompt, whose template wrote them) they are not. CPU-bound; thread-safe; raises
    ``TokenizerError`` on text it cannot encode."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> Sequence[int]: ...


class ChatTemplate(Protocol):
    """A chat request's messages to the prompt text the model server renders from them
    (the model's chat template, as vLLM applies it for ``/v1/chat/completions``).

    ``messages`` is the request's ``messages`` as decoded JSON; ``options`` are the
    template variables the request sets besides them (``chat_template_kwargs``).
    CPU-bound; thread-safe; raises ``ChatTemplateError`` for a conversation it cannot
    render, never anything else."""

    def render(
        self,
        messages: Sequence[object],
        *,
        add_generation_prompt: bool,
        options: Mapping[str, object],
    ) -> str: ...
