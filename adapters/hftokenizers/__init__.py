"""The model's tokenizer from its ``tokenizer.json`` (Hugging Face ``tokenizers``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from ports.tokenizer import TokenizerError

__all__ = ["HFTokenizer"]


class HFTokenizer:
    """A ``ports.tokenizer.Tokenizer`` over a ``tokenizer.json`` file (a path or a
    ConfigMap mount). ``from_file`` raises ``TokenizerError`` naming the path."""

    def __init__(self, tokenizer: _HFTokenizer, path: str = "") -> None:
        self._tokenizer = tokenizer
        self.path = path

    @classmethod
    def from_file(cls, path: str | Path) -> HFTokenizer:
        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        try:
            tokenizer = _HFTokenizer.from_file(str(file))
        except Exception as exc:  # the library raises bare Exceptions for I/O and parse errors
            raise TokenizerError(f"cannot load the tokenizer {str(file)!r}: {exc}") from None
        return cls(tokenizer, str(file))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> Sequence[int]:
        try:
            return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        except Exception as exc:
            raise TokenizerError(f"cannot tokenize the prompt: {exc}") from None
