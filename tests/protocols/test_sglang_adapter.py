"""The actor's SGLang response adapter on a recorded-shape response (written from SGLang 0.5.x's OpenAI protocol:
ChatCompletionResponseChoice carries token_ids / prompt_token_ids / meta_info, logprobs.content per token)."""

import pytest

from inflight.actor.response_parsers import ResponseError, get_adapter

RESPONSE = {
    "id": "5f2c", "object": "chat.completion", "created": 1764400000, "model": "default",
    "choices": [
        {"index": 1, "message": {"role": "assistant", "content": "46", "reasoning_content": None, "tool_calls": None},
         "logprobs": {"content": [
             {"token": "4", "bytes": [52], "logprob": -0.25, "top_logprobs": []},
             {"token": "6", "bytes": [54], "logprob": -1.5, "top_logprobs": []},
             {"token": "<|im_end|>", "bytes": [], "logprob": -0.125, "top_logprobs": []}]},
         "finish_reason": "stop", "matched_stop": 7, "prompt_token_ids": [6, 10, 11], "token_ids": [16, 18, 7],
         "meta_info": {"weight_version": "3"}},
        {"index": 0, "message": {"role": "assistant", "content": "4"},
         "logprobs": {"content": [{"token": "4", "bytes": [52], "logprob": -0.5, "top_logprobs": []}]},
         "finish_reason": "length", "matched_stop": None, "prompt_token_ids": [6, 10, 11], "token_ids": [16]},
    ],
    "usage": {"prompt_tokens": 3, "total_tokens": 7, "completion_tokens": 4},
}


def test_sglang_adapter_reads_its_fields():
    out = get_adapter("sglang")(RESPONSE)
    assert [c.text for c in out] == ["4", "46"]  # sorted by index
    assert out[1].token_ids == [16, 18, 7] and out[1].prompt_ids == [6, 10, 11]
    assert out[1].logprobs == [-0.25, -1.5, -0.125] and out[1].versions == [3, 3, 3]
    assert out[1].finish_reason == "stop"
    assert out[0].versions == [-1] and out[0].finish_reason == "length"


def test_sglang_adapter_rejects_missing_token_ids():
    bad = {**RESPONSE, "choices": [{k: v for k, v in RESPONSE["choices"][0].items() if k != "token_ids"}]}
    with pytest.raises(ResponseError, match="token_ids"):
        get_adapter("sglang")(bad)
    short = {**RESPONSE, "choices": [{**RESPONSE["choices"][0], "token_ids": [16, 18]}]}
    with pytest.raises(ResponseError, match="inconsistent"):
        get_adapter("sglang")(short)


@pytest.mark.parametrize("adapter, asks", [("builtin", False), ("vllm", True), ("sglang", True)])
def test_rollout_asks_stock_servers_for_token_ids(adapter, asks):
    """Stock vLLM / SGLang return token ids only with return_token_ids; the built-in server always does."""
    import asyncio

    from inflight.actor.rollout import RolloutClient
    from inflight.config.actor import ActorConfig

    class RecordingPool:  # records the request body; answers with the recorded SGLang response
        payload: dict = {}

        async def chat(self, payload):
            RecordingPool.payload = payload
            return get_adapter("sglang")(RESPONSE)

    client = RolloutClient(RecordingPool(), ActorConfig(adapter=adapter), model="default")
    asyncio.run(client.chat([{"role": "user", "content": "1+2="}], n=2))
    assert RecordingPool.payload.get("return_token_ids", False) is asks
