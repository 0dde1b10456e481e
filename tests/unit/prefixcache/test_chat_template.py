"""The model's chat template (``adapters/chattemplate``): loaded as a model directory holds
it, rendered as Hugging Face's ``apply_chat_template`` renders it for vLLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adapters.chattemplate import JinjaChatTemplate
from ports.tokenizer import ChatTemplateError

CHATML = (
    "{{ bos_token }}{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: Loops over a message's content parts (vLLM's "openai" content format).
PARTS = (
    "{% for m in messages %}[{{ m.role }}]"
    "{% for part in m['content'] %}({{ part.text }}){% endfor %}{% endfor %}"
)


def _model_dir(tmp_path: Path, config: dict[str, object]) -> Path:
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path / "tokenizer.json"


def test_it_renders_the_tokenizer_configs_template_with_its_special_tokens(
    tmp_path: Path,
) -> None:
    path = _model_dir(tmp_path, {"bos_token": {"content": "<s>"}, "chat_template": CHATML})
    template = JinjaChatTemplate.load(path)
    assert template is not None
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    text = template.render(messages, add_generation_prompt=True, options={})
    assert text == (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = template.render(messages, add_generation_prompt=False, options={})
    assert no_prompt == text.removesuffix("<|im_start|>assistant\n")


def test_additional_special_tokens_are_template_variables(tmp_path: Path) -> None:
    extra = [{"content": "<tool>"}, "<img>"]
    source = "{{ additional_special_tokens | join(',') }}"
    path = _model_dir(tmp_path, {"additional_special_tokens": extra, "chat_template": source})
    template = JinjaChatTemplate.load(path)
    assert template is not None
    assert template.render([], add_generation_prompt=True, options={}) == "<tool>,<img>"


def test_content_is_given_as_parts_to_a_template_that_loops_over_them() -> None:
    template = JinjaChatTemplate(PARTS)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]
    assert template.parts
    assert template.render(messages, add_generation_prompt=False, options={}) == (
        "[user](hi)[assistant]"
    )
    aliased = "{% for m in messages %}{% set c = m.content %}{% for p in c %}{{ p.text }}"
    assert JinjaChatTemplate(aliased + "{% endfor %}{% endfor %}").parts
    assert not JinjaChatTemplate(CHATML).parts


def test_request_options_are_template_variables_but_cannot_replace_the_messages() -> None:
    template = JinjaChatTemplate("{{ messages | length }}{% if flag %}+{% endif %}{{ x }}")
    messages = [{"role": "user", "content": "hi"}]
    options = {"flag": True, "x": "y", "messages": [1, 2, 3]}
    assert template.render(messages, add_generation_prompt=True, options=options) == "1+y"


def test_tool_call_arguments_are_decoded_and_tojson_keeps_non_ascii() -> None:
    template = JinjaChatTemplate(
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}"
    )
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"q": "é"}'}}
    messages = [{"role": "assistant", "content": None, "tool_calls": [call]}]
    assert template.render(messages, add_generation_prompt=False, options={}) == '{"q": "é"}'


@pytest.mark.parametrize(
    ("source", "messages"),
    [
        (CHATML, [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        (CHATML, [{"content": "no role"}]),
        (CHATML, ["not an object"]),
        ("{{ raise_exception('roles must alternate') }}", [{"role": "user", "content": "x"}]),
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", [{"role": "user", "content": "x"}]),
        ("{% set _ = messages.append(1) %}", [{"role": "user", "content": "x"}]),
    ],
)
def test_what_it_cannot_render_is_a_chat_template_error(
    source: str, messages: list[object]
) -> None:
    with pytest.raises(ChatTemplateError):
        JinjaChatTemplate(source).render(messages, add_generation_prompt=True, options={})


def test_an_assistants_reasoning_is_given_under_both_names() -> None:
    template = JinjaChatTemplate(
        "{% for m in messages %}{{ m.reasoning_content }}|{{ m.reasoning }}{% endfor %}"
    )
    messages = [{"role": "assistant", "content": "a", "reasoning": "because"}]
    assert template.render(messages, add_generation_prompt=False, options={}) == "because|because"


def test_generation_blocks_pass_their_body_through() -> None:
    template = JinjaChatTemplate(
        "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    )
    assert (
        template.render(
            [{"role": "assistant", "content": "ok"}], add_generation_prompt=False, options={}
        )
        == "ok"
    )


def test_where_the_template_comes_from(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    path = _model_dir(tmp_path, {"chat_template": named})
    loaded = JinjaChatTemplate.load(path)
    assert loaded is not None
    assert loaded.render([], add_generation_prompt=False, options={}) == "D"
    (tmp_path / "chat_template.jinja").write_text("J")
    loaded = JinjaChatTemplate.load(tmp_path)  # the directory works as well
    assert loaded is not None
    assert loaded.render([], add_generation_prompt=False, options={}) == "J"
    own = tmp_path / "own.jinja"
    own.write_text("O{{ bos_token }}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<b>"}))
    loaded = JinjaChatTemplate.load(path, str(own))
    assert loaded is not None
    assert loaded.render([], add_generation_prompt=False, options={}) == "O<b>"


def test_no_template_is_none_and_a_broken_one_names_its_file(tmp_path: Path) -> None:
    path = _model_dir(tmp_path, {"bos_token": "<s>"})
    assert JinjaChatTemplate.load(path) is None
    missing = tmp_path / "missing.jinja"
    with pytest.raises(ChatTemplateError, match=str(missing)):
        JinjaChatTemplate.load(path, str(missing))
    broken = tmp_path / "chat_template.jinja"
    broken.write_text("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match=str(broken)):
        JinjaChatTemplate.load(path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ChatTemplateError, match=r"tokenizer_config\.json"):
        JinjaChatTemplate.load(path)
