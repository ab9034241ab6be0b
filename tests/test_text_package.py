"""servefleet.text on its own: no torch, message content -> text, a model source's text side."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from servefleet.text.messages import MessageContent, content_text, template_messages


def test_the_text_package_works_without_torch() -> None:
    """The gateway's image has no torch: every module imports, and the built-in model's
    tokenizer and template load, with `import torch` failing."""
    script = textwrap.dedent(
        """
        import importlib, pkgutil, sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        import servefleet.text
        for module in pkgutil.iter_modules(servefleet.text.__path__):
            importlib.import_module(f"servefleet.text.{module.name}")
        from servefleet.text.model_text import load_model_text
        text = load_model_text("smollm2-135m-instruct")
        prompt = text.chat_template.render([{"role": "user", "content": "hi"}])
        assert text.tokenizer.encode(prompt, add_special_tokens=False)
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


class Message(BaseModel):
    content: MessageContent = None


def test_text_content_becomes_the_template_text() -> None:
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    assert content_text(Message(content=parts).content) == "Hello, world"
    assert content_text(Message(content="plain").content) == "plain"
    assert content_text(Message().content) == ""
    messages = [{"role": "user", "content": parts}, {"role": "assistant", "content": None}]
    assert template_messages(messages) == [
        {"role": "user", "content": "Hello, world"},
        {"role": "assistant", "content": ""},
    ]


@pytest.mark.parametrize(
    ("part", "needle"),
    [
        ({"type": "image_url", "image_url": {"url": "https://x/y.png"}}, "type 'image_url'"),
        ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "'input_audio'"),
        ({"text": "no type"}, "type None"),
        ({"type": "text"}, "no string 'text'"),
        ({"type": "text", "text": 7}, "no string 'text'"),
    ],
)
def test_parts_a_text_model_cannot_read_are_refused(part: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValidationError) as caught:
        Message(content=[{"type": "text", "text": "look:"}, part])
    error = caught.value.errors()[0]
    assert error["loc"] == ("content",)
    assert "content part 1" in error["msg"] and needle in error["msg"]
