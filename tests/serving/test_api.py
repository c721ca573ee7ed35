"""The OpenAI completions protocol as clients see it: which requests are taken, how refusals and answers look."""

from __future__ import annotations

import json
import time

import msgspec
import pytest

from moriio_async.serving.api import (
    ApiError,
    Completion,
    CompletionRequest,
    Usage,
    chunk,
    completion,
    error_response,
    model_card,
    parse_request,
)
from moriio_async.serving.messages import KvTransfer


def body(**fields: object) -> bytes:
    return json.dumps({"model": "m", "prompt": "hi", **fields}).encode()


def refusal(raw: bytes) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_request(raw)
    assert info.value.status == 400
    return info.value


def wire(answer: Completion) -> dict[str, object]:
    decoded: dict[str, object] = json.loads(msgspec.json.encode(answer))
    return decoded


def test_a_plain_request_is_taken_with_openai_defaults() -> None:
    req = parse_request(body())
    assert (req.model, req.text(), req.max_tokens, req.stream, req.stream_options) == ("m", "hi", 16, False, None)


def test_fields_no_one_here_knows_are_ignored() -> None:
    assert parse_request(body(frobnicate=3, stream_options={"include_usage": True, "x": 1})).stream_options is not None


def test_malformed_json_is_a_400_with_code_invalid_json() -> None:
    err = refusal(b'{"model": "m", "prompt": ')
    assert err.code == "invalid_json" and err.param is None
    assert str(err).startswith("the request body is not valid JSON: ")
    assert err.type == "invalid_request_error"


def test_a_wrong_type_names_its_field_in_param_and_message() -> None:
    err = refusal(body(max_tokens="many"))
    assert err.param == "max_tokens" and err.code is None
    assert str(err).startswith("max_tokens: ") and "integer" in str(err)


def test_a_missing_field_names_it() -> None:
    err = refusal(json.dumps({"prompt": "hi"}).encode())
    assert err.param == "model" and str(err).startswith("model: ")


def test_a_nested_field_is_named_by_its_dotted_path() -> None:
    err = refusal(body(stream_options={"include_usage": "perhaps"}))
    assert err.param == "stream_options.include_usage"
    assert str(err).startswith("stream_options.include_usage: ")


def test_a_body_that_is_not_an_object_is_blamed_on_the_body() -> None:
    err = refusal(b"[1, 2]")
    assert err.param is None and err.code is None and str(err).startswith("body: ")


NEUTRAL = {
    "temperature": 0.0,
    "top_p": 1.0,
    "n": 1,
    "best_of": 1,
    "echo": False,
    "stop": [],
    "logprobs": None,
    "suffix": "",
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "logit_bias": {},
}
CHANGES_OUTPUT = {
    "temperature": 0.7,
    "top_p": 0.9,
    "n": 2,
    "best_of": 3,
    "echo": True,
    "stop": "\n",
    "logprobs": 0,
    "suffix": "end",
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "logit_bias": {"50256": -100.0},
}


def test_parameters_at_their_greedy_value_are_taken() -> None:
    req = parse_request(body(**NEUTRAL, max_tokens=1))
    assert req.max_tokens == 1
    parse_request(body(stop="", max_tokens=None))


@pytest.mark.parametrize("param", sorted(CHANGES_OUTPUT))
def test_a_parameter_that_changes_the_output_is_refused_by_name(param: str) -> None:
    value = CHANGES_OUTPUT[param]
    err = refusal(body(**{**NEUTRAL, param: value}))
    assert err.param == param and err.type == "invalid_request_error" and err.code is None
    assert str(err) == f"{param}={value!r} is not supported: this server decodes greedily"


@pytest.mark.parametrize("max_tokens", [0, -3])
def test_max_tokens_below_one_is_refused(max_tokens: int) -> None:
    err = refusal(body(max_tokens=max_tokens))
    assert err.param == "max_tokens" and str(err) == f"max_tokens must be at least 1, not {max_tokens}"


def test_one_prompt_in_a_list_is_taken_and_two_or_none_are_refused() -> None:
    assert parse_request(body(prompt=["only"])).text() == "only"
    for prompts in (["a", "b"], []):
        with pytest.raises(ApiError) as info:
            parse_request(body(prompt=prompts)).text()
        assert (info.value.status, info.value.param) == (400, "prompt")
        assert str(info.value) == "exactly one prompt per request is supported"


def test_an_error_answer_has_openais_shape_and_the_errors_status() -> None:
    resp = error_response(ApiError(503, "no decode instance", type="service_unavailable", code="503"))
    assert resp.status_code == 503 and resp.media_type == "application/json"
    assert json.loads(bytes(resp.body)) == {
        "error": {"message": "no decode instance", "type": "service_unavailable", "param": None, "code": "503"}
    }
    default = json.loads(bytes(error_response(ApiError(400, "bad", param="n")).body))
    assert default == {"error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": None}}


def test_a_model_card_says_who_owns_the_model_and_how_long_its_context_is() -> None:
    assert json.loads(msgspec.json.encode(model_card("tiny", 32, 1700000000))) == {
        "id": "tiny",
        "object": "model",
        "created": 1700000000,
        "owned_by": "moriio_async",
        "max_model_len": 32,
    }


def test_a_streamed_token_is_one_choice_without_usage_or_kv_transfer() -> None:
    assert wire(chunk("cmpl-1", "tiny", 5, "a", None)) == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 5,
        "model": "tiny",
        "choices": [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}],
    }


def test_the_finishing_chunk_has_an_empty_text_and_carries_kv_transfer() -> None:
    got = wire(chunk("c", "tiny", 5, "", "length", kv_transfer=KvTransfer(mode="read")))
    assert got["choices"] == [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}]
    kv = got["kv_transfer"]
    assert isinstance(kv, dict) and kv["mode"] == "read"
    assert "usage" not in got


def test_the_usage_chunk_has_no_choices() -> None:
    got = wire(chunk("c", "tiny", 5, "", None, usage=Usage.of(3, 4)))
    assert got["choices"] == []
    assert got["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def test_a_whole_completion_is_created_now_with_its_usage_and_kv_transfer() -> None:
    before = int(time.time())
    got = wire(completion("c", "tiny", "abc", "stop", Usage.of(2, 3), KvTransfer(attempts=2)))
    after = int(time.time())
    created = got["created"]
    assert isinstance(created, int) and before <= created <= after
    assert got["object"] == "text_completion" and got["model"] == "tiny" and got["id"] == "c"
    assert got["choices"] == [{"index": 0, "text": "abc", "logprobs": None, "finish_reason": "stop"}]
    assert got["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    kv = got["kv_transfer"]
    assert isinstance(kv, dict) and kv["attempts"] == 2


def test_a_request_built_in_code_defaults_to_sixteen_tokens_unstreamed() -> None:
    req = CompletionRequest(model="m", prompt="hi")
    req.check_supported()
    assert (req.max_tokens, req.stream) == (16, False)
