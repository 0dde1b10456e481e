"""The model's chat template (Jinja2, sandboxed): chat messages to the server's prompt text."""

from adapters.chattemplate.template import JinjaChatTemplate

__all__ = ["JinjaChatTemplate"]
