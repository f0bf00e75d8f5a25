"""Chat prompts: a conversation rendered through the model's Jinja chat template, then tokenized, as
transformers' `apply_chat_template(messages, add_generation_prompt=True)` does (pure; no I/O).

Templates come with the model, so they run in jinja2's immutable sandbox with transformers' additions
(`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII, the `{% generation %}` tag). The rendered
text already holds the template's special tokens, so it is tokenized without adding any.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from control_plane.errors import invalid

ROLES = ("system", "user", "assistant")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's text for training masks: here it renders
    its body unchanged."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 reads it from the class)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@cache
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A model's chat template, compiled once, with the special token strings it may refer to.

    `end_of_turn_ids`: token ids that end the assistant's turn beyond the model's eos ids (the template's
    eos_token when generation_config does not list it); a chat generation stops at them too.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str], end_of_turn_ids: Iterable[int] = ()) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens)
        self.end_of_turn_ids = tuple(end_of_turn_ids)
        self.error = ""
        self._template: jinja2.Template | None = None
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as e:
            self.error = f"the model's chat template does not compile: {e}"

    @classmethod
    def for_model(
        cls, source: str, special_tokens: Mapping[str, str], tokenizer: Tokenizer, eos_ids: Iterable[int]
    ) -> ChatTemplate | None:
        """None when the model has no template."""
        if not source:
            return None
        eos = special_tokens.get("eos_token")
        eot = tokenizer.token_to_id(eos) if eos else None
        return cls(source, special_tokens, [eot] if eot is not None and eot not in set(eos_ids) else [])

    def render(self, messages: Sequence[tuple[str, str]]) -> str:
        """The prompt text with the assistant's turn opened; raises jinja2.TemplateError (e.g. the template's
        own raise_exception for a conversation it rejects)."""
        if self._template is None:
            raise jinja2.TemplateError(self.error)
        return self._template.render(
            messages=[{"role": role, "content": content} for role, content in messages],
            tools=None,
            documents=None,
            add_generation_prompt=True,
            **self.special_tokens,
        )

    def prompt_ids(self, messages: Sequence[tuple[str, str]], tokenizer: Tokenizer, field: str) -> list[int]:
        """Rendered and tokenized; raises INVALID_ARGUMENT on `field` when the template rejects the conversation."""
        try:
            text = self.render(messages)
        except jinja2.TemplateError as e:
            raise invalid(field, f"the chat template rejected the conversation: {e}") from None
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        if not ids:
            raise invalid(field, "renders to no tokens")
        return ids


def message_violations(
    messages: Sequence[tuple[str, str]], template: ChatTemplate | None, field: str
) -> list[tuple[str, str]]:
    """What is wrong with a conversation before rendering: (field path, description) pairs."""
    if template is None:
        return [(field, "the served model has no chat template; send text or token_ids")]
    if not messages:
        return [(field + ".messages", "must not be empty")]
    return [
        (f"{field}.messages[{i}].role", f"unknown role {role!r} (known: {', '.join(ROLES)})")
        for i, (role, _) in enumerate(messages)
        if role not in ROLES
    ]
