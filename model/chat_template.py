"""A checkpoint's chat template (Jinja, as Hugging Face tokenizers render it): messages -> prompt text.

The template comes from `chat_template.jinja` or `tokenizer_config.json` (`chat_template`: one string,
or a list of named templates, of which `default` is used). It is rendered in Jinja's sandbox with the
globals HF templates rely on (`raise_exception`, `strftime_now`, `bos_token`, `eos_token`).
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The model has no chat template, or the messages cannot be rendered with it (says why)."""


def _raise(message: str):
    raise ChatTemplateError(message)


class ChatTemplate:
    def __init__(self, source: str, special: dict[str, str] | None = None):
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda value, indent=None: json.dumps(
            value, ensure_ascii=False, indent=indent
        )
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateError as err:
            raise ChatTemplateError(f"the model's chat template does not compile: {err}") from None
        self.special = special or {}
        self.source = source

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The template of a checkpoint directory, or None when it has none."""
        model_dir = Path(model_dir)
        config = {}
        config_path = model_dir / "tokenizer_config.json"
        if config_path.is_file():
            config = json.loads(config_path.read_text())
        special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token")}
        jinja_file = model_dir / "chat_template.jinja"
        if jinja_file.is_file():
            return cls(jinja_file.read_text(), special)
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": "default", "template": "..."}, ...]
            source = {t.get("name"): t.get("template") for t in source}.get("default")
        return cls(source, special) if isinstance(source, str) and source else None

    @classmethod
    def load(cls, model_dir: str | Path, override: str | None = None) -> ChatTemplate | None:
        """--chat-template (a Jinja file, or the template text itself) when given, else the model's."""
        if override is None:
            return cls.from_dir(model_dir)
        model = cls.from_dir(model_dir)
        special = model.special if model is not None else {}
        path = Path(override).expanduser()
        if path.is_file():
            return cls(path.read_text(), special)
        if "{" not in override:  # a path that is not there, not a template
            raise ChatTemplateError(f"--chat-template {override}: no such file")
        return cls(override, special)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text for `messages` ([{role, content}], content a string)."""
        try:
            return self.template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special, **kwargs
            )
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as err:
            raise ChatTemplateError(f"the chat template cannot render these messages: {err}") from None


def _token_text(token) -> str:
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else ""


# ChatML, the format of Qwen models' chat templates (without tools): the built-in models carry it
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
