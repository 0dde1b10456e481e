"""``ChatTemplate`` on Jinja2: the model's chat template, rendered as the model server does.

Where the template comes from (the first that exists): the ``chatTemplatePath`` file;
``chat_template.jinja`` beside the ``tokenizer.json``; the ``chat_template`` of the
``tokenizer_config.json`` beside it (a string, or a list of named templates: ``default``).
The special tokens (``bos_token``, ``eos_token``, ..., ``additional_special_tokens``) come
from that ``tokenizer_config.json``.

Rendering follows Hugging Face's ``apply_chat_template`` as vLLM calls it for
``/v1/chat/completions``: a sandboxed, immutable Jinja2 environment with ``trim_blocks`` and
``lstrip_blocks``, the loop controls, a ``{% generation %}`` block that only passes its body
through, a ``tojson`` that does not escape HTML (``ensure_ascii=False``), and the globals
``raise_exception`` and ``strftime_now``. The variables: the special tokens, the request's
``chat_template_kwargs``, ``messages``, ``add_generation_prompt``, ``tools`` and
``documents`` (``None``).

The messages are first brought into the shape vLLM gives the template. Text content
becomes a string (parts joined by newlines) for a template that prints ``content``, or a
list of ``{"type": "text", "text": ...}`` parts for one that loops over it (vLLM's
``--chat-template-content-format auto``, decided here the same way, from the template's
syntax tree); an assistant's ``tool_calls`` get their JSON ``arguments`` decoded and its
``reasoning`` is given as ``reasoning`` and ``reasoning_content``; ``name`` and a tool
message's ``tool_call_id`` are kept. A part that is not text (an image, audio)
cannot be rendered here: ``ChatTemplateError``.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ports.tokenizer import ChatTemplateError

__all__ = ["JinjaChatTemplate"]

_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
)
#: Variables the renderer sets itself; ``chat_template_kwargs`` cannot replace them.
_RESERVED = frozenset({"messages", "add_generation_prompt", "tools", "documents"})


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant-token masks): the body only."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        body: list[jinja2.nodes.Node] = parser.parse_statements(
            ("name:endgeneration",), drop_needle=True
        )
        return body


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class JinjaChatTemplate:
    """A ``ports.tokenizer.ChatTemplate``. Thread-safe (a compiled template renders into a
    fresh context each time)."""

    def __init__(
        self, source: str, *, special_tokens: Mapping[str, Any] | None = None, path: str = ""
    ) -> None:
        env = _environment()
        where = f" {path!r}" if path else ""
        try:
            tree = env.parse(source)
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(
                f"the chat template{where} is not valid Jinja (line {exc.lineno}): {exc.message}"
            ) from None
        self.path = path
        self.parts = _loops_over_content(tree)
        """``True``: content is given as a list of parts (vLLM's ``openai`` format)."""
        self._special = dict(special_tokens or {})

    @classmethod
    def load(
        cls, tokenizer_path: str | Path, chat_template_path: str = ""
    ) -> JinjaChatTemplate | None:
        """The template for the tokenizer at ``tokenizer_path`` (a ``tokenizer.json`` or its
        directory), or the one in ``chat_template_path``; ``None`` when there is none.
        ``ChatTemplateError`` (naming the file) when a file cannot be read or parsed."""
        directory = Path(tokenizer_path)
        if not directory.is_dir():
            directory = directory.parent
        config_file = directory / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if config_file.is_file():
            try:
                loaded = json.loads(config_file.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, ValueError) as exc:
                raise ChatTemplateError(f"cannot read {str(config_file)!r}: {exc}") from None
            if isinstance(loaded, dict):
                config = loaded
        special = _special_tokens(config)
        jinja_file = directory / "chat_template.jinja"
        if chat_template_path:
            file = Path(chat_template_path)
            return cls(_read(file), special_tokens=special, path=str(file))
        if jinja_file.is_file():
            return cls(_read(jinja_file), special_tokens=special, path=str(jinja_file))
        source = _named_template(config.get("chat_template"))
        if source is None:
            return None
        return cls(source, special_tokens=special, path=str(config_file))

    def render(
        self,
        messages: Sequence[object],
        *,
        add_generation_prompt: bool,
        options: Mapping[str, object],
    ) -> str:
        conversation = [self._message(message) for message in messages]
        variables: dict[str, Any] = dict(self._special)
        variables.update((k, v) for k, v in options.items() if k not in _RESERVED)
        variables.update(
            messages=conversation,
            add_generation_prompt=add_generation_prompt,
            tools=None,
            documents=None,
        )
        try:
            return self._template.render(variables)
        except Exception as exc:  # anything the template raises (raise_exception, type errors)
            raise ChatTemplateError(f"the chat template failed: {exc}") from None

    def _message(self, message: object) -> dict[str, Any]:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ChatTemplateError("a message is not an object with a string role")
        role: str = message["role"]
        texts = _texts(message.get("content"))
        out: dict[str, Any] = {"role": role}
        if self.parts:
            out["content"] = [{"type": "text", "text": text} for text in texts]
        else:
            out["content"] = "\n".join(texts)
        name = message.get("name")
        if isinstance(name, str):
            out["name"] = name
        if role == "assistant":
            if isinstance(message.get("tool_calls"), list):
                out["tool_calls"] = [_tool_call(call) for call in message["tool_calls"]]
            reasoning = message.get("reasoning")
            if reasoning is not None:  # replayed thinking, under both names
                out["reasoning"] = out["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        return out


def _read(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(f"cannot read the chat template {str(file)!r}: {exc}") from None


def _named_template(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        for entry in value:
            if isinstance(entry, dict) and entry.get("name") == "default":
                template = entry.get("template")
                return template if isinstance(template, str) else None
    return None


def _special_tokens(config: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in _SPECIAL_TOKENS:
        value = config.get(key)
        if isinstance(value, dict):  # a serialized AddedToken
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    extra = config.get("additional_special_tokens")
    if isinstance(extra, list):
        out["additional_special_tokens"] = [
            token.get("content") if isinstance(token, dict) else token for token in extra
        ]
    return out


def _texts(content: object) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise ChatTemplateError("a message's content is neither a string nor a list of parts")
    texts: list[str] = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise ChatTemplateError("a text part has no string text")
            texts.append(text)
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ChatTemplateError(f"content of type {kind!r} is not rendered here")
    return texts


def _tool_call(call: object) -> object:
    """An assistant's tool call with its ``function.arguments`` decoded from JSON (what
    templates expect, and what vLLM gives them)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except ValueError:
            raise ChatTemplateError("a tool call's arguments are not JSON") from None
    return {**call, "function": function}


# --- the content format: does the template loop over a message's content? ---


def _is_name(node: jinja2.nodes.Node, names: set[str]) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name in names


def _unwrap(node: jinja2.nodes.Node) -> jinja2.nodes.Node:
    """``x | filter``, ``x is test`` and ``x[a:b]`` stand for ``x``."""
    while True:
        sliced = isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice)
        wraps = isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test) or sliced
        inner: jinja2.nodes.Node | None = getattr(node, "node", None) if wraps else None
        if inner is None:
            return node
        node = inner


def _key_of(node: jinja2.nodes.Node, names: set[str], key: str) -> bool:
    """``name[key]`` or ``name.key`` for one of ``names``."""
    if isinstance(node, jinja2.nodes.Getitem):
        return (
            _is_name(node.node, names)
            and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == key
        )
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_name(node.node, names) and node.attr == key
    return False


def _targets(node: jinja2.nodes.Node) -> Iterator[str]:
    if isinstance(node, jinja2.nodes.Name):
        yield node.name
    elif isinstance(node, jinja2.nodes.Tuple):
        for item in node.items:
            yield from _targets(item)


def _aliases(tree: jinja2.nodes.Template, seed: set[str], key: str | None) -> set[str]:
    """Names bound (by ``set`` or ``for``) to ``seed`` names, or to their ``key`` item,
    transitively."""
    names = set(seed)
    while True:
        before = len(names)
        for assign in tree.find_all(jinja2.nodes.Assign):
            value = _unwrap(assign.node)
            if _is_name(value, names) or (key is not None and _key_of(value, names, key)):
                names.update(_targets(assign.target))
        if len(names) == before:
            return names


def _loops_over_content(tree: jinja2.nodes.Template) -> bool:
    lists = _aliases(tree, {"messages"}, None)
    items: set[str] = set()
    for loop in tree.find_all(jinja2.nodes.For):
        if _is_name(_unwrap(loop.iter), lists):
            items.update(_targets(loop.target))
    items = _aliases(tree, items, None)
    contents: set[str] = set()
    for assign in tree.find_all(jinja2.nodes.Assign):
        if _key_of(_unwrap(assign.node), items, "content"):
            contents.update(_targets(assign.target))
    contents = _aliases(tree, contents, None)
    for loop in tree.find_all(jinja2.nodes.For):
        iterated = _unwrap(loop.iter)
        if _key_of(iterated, items, "content") or _is_name(iterated, contents):
            return True
    return False
