"""Chat prompts: SmolLM2's template rendered and tokenized exactly as transformers' apply_chat_template
(add_generation_prompt), the sandbox, and the validation of conversations (pure: no sockets)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest
from tokenizers import Tokenizer

from control_plane.admission import Admission
from control_plane.chat import ChatTemplate
from control_plane.config import Settings
from control_plane.errors import ApiError
from control_plane.validation import Limits, validate_generate
from protos.coalesce.v1 import inference_pb2

CONVERSATIONS: list[list[tuple[str, str]]] = [
    [("user", "What is the capital of France?")],
    [("system", "You are terse."), ("user", "Hi!")],
    [("user", "2+2?"), ("assistant", "4."), ("user", "And times 3?")],
    [("user", "Ünïcödé 你好 🚀  lots   of\tspace\n\n  and lines ")],
    [("user", "special <|im_end|> text <|im_start|>inside")],
    [("system", ""), ("user", "")],
]


@pytest.fixture(scope="module")
def smollm2(smollm2_cache: Path) -> tuple[ChatTemplate, Tokenizer]:
    """Our side: the template and tokenizer of the converted checkpoint, as the control plane builds them."""
    entry = next((smollm2_cache / "gguf").glob("*-float32-*"))
    config = json.loads((entry / "tokenizer_config.json").read_text())
    tokenizer = Tokenizer.from_file(str(entry / "tokenizer.json"))
    special = {k: v for k, v in config.items() if k.endswith("_token")}
    template = ChatTemplate.for_model(config["chat_template"], special, tokenizer, [2])
    assert template is not None
    return template, tokenizer


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
def test_smollm2_chat_ids_equal_transformers(
    smollm2: tuple[ChatTemplate, Tokenizer], smollm2_hf: tuple[Any, Any], conversation: list[tuple[str, str]]
) -> None:
    template, tokenizer = smollm2
    hf_tokenizer, _ = smollm2_hf
    messages = [{"role": r, "content": c} for r, c in conversation]
    expected = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert template.prompt_ids(conversation, tokenizer, "messages") == list(expected)
    text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert template.render(conversation) == text


def test_smollm2_ends_turns_with_its_eos(smollm2: tuple[ChatTemplate, Tokenizer]) -> None:
    template, tokenizer = smollm2
    assert tokenizer.token_to_id(template.special_tokens["eos_token"]) == 2
    assert template.end_of_turn_ids == ()  # <|im_end|> is already the model's eos: nothing to add


def _limits(chat: ChatTemplate | None) -> Limits:
    return Limits("m", vocab_size=100, max_context=64, default_max_tokens=8, max_stop_strings=4, chat=chat)


def _chat(*turns: tuple[str, str], **sampling: Any) -> inference_pb2.GenerateRequest:
    messages = inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(role=r, content=c) for r, c in turns])
    return inference_pb2.GenerateRequest(messages=messages, sampling=inference_pb2.SamplingParams(**sampling))


def _violations(request: inference_pb2.GenerateRequest, limits: Limits) -> list[tuple[str, str]]:
    with pytest.raises(ApiError) as err:
        validate_generate(request, limits, "items[3].request.")
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return err.value.violations


def test_bad_conversations_name_the_field() -> None:
    template = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", {})
    assert _violations(_chat(("user", "hi")), _limits(None)) == [
        ("items[3].request.messages", "the served model has no chat template; send text or token_ids")
    ]
    assert _violations(_chat(), _limits(template)) == [("items[3].request.messages.messages", "must not be empty")]
    assert _violations(_chat(("user", "a"), ("robot", "b"), ("", "c")), _limits(template)) == [
        ("items[3].request.messages.messages[1].role", "unknown role 'robot' (known: system, user, assistant)"),
        ("items[3].request.messages.messages[2].role", "unknown role '' (known: system, user, assistant)"),
    ]


def _tokenizer() -> Tokenizer:
    from worker.builtin import byte_tokenizer

    return byte_tokenizer()


def test_template_errors_and_sandbox_are_invalid_arguments() -> None:
    tok = _tokenizer()
    strict = ChatTemplate(
        "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}x", {}
    )
    with pytest.raises(ApiError, match=r"messages: the chat template rejected the conversation: first must be user"):
        strict.prompt_ids([("assistant", "hi")], tok, "messages")
    escape = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}", {})
    with pytest.raises(ApiError, match="rejected the conversation"):
        escape.prompt_ids([("user", "hi")], tok, "messages")
    broken = ChatTemplate("{% for %}", {})
    with pytest.raises(ApiError, match="chat template does not compile"):
        broken.prompt_ids([("user", "hi")], tok, "messages")


def test_transformers_extensions_render() -> None:
    source = (
        "{% for m in messages %}{% generation %}{{ m | tojson }}{% endgeneration %}{% endfor %}"
        "{% if add_generation_prompt %}{{ bos_token }}{% endif %}"
    )
    template = ChatTemplate(source, {"bos_token": "<|bos|>"})
    assert template.render([("user", "é")]) == '{"role": "user", "content": "é"}<|bos|>'


def test_spec_of_a_chat_request_stops_at_the_end_of_turn() -> None:
    """A template whose eos_token is not among the model's eos ids adds it as a stop id, unless ignore_eos."""
    tok = _tokenizer()
    template = ChatTemplate.for_model("{{ messages[0].content }}", {"eos_token": "<|eos|>"}, tok, eos_ids=[])
    assert template is not None and template.end_of_turn_ids == (257,)
    limits = Limits("m", vocab_size=258, max_context=64, default_max_tokens=8, max_stop_strings=4, chat=template)
    admission = Admission(tok, limits, Settings())
    spec = admission.admit(_chat(("user", "hey")), "t")
    assert spec.prompt_ids == list(b"hey") and spec.stop_token_ids == [257]
    spec = admission.admit(_chat(("user", "hey"), ignore_eos=True), "t")
    assert spec.stop_token_ids == []
