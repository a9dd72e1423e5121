"""The front end through the official ``openai`` client: every supported parameter, streaming, errors, load.

The instances are no-op engines (see test_http.py): the last stage's logits are 30 for
token ``3 + (position + step) % 250`` and 0 elsewhere, and they go through the real
sampler, so ``logit_bias`` can make several tokens tie and the seed then decides.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator

import openai
import pytest

from coral.runtime.serving.app import ServerOptions

from .api_server import Api, noop_tokens, start_api, stop_api

pytest.importorskip("openai")

TIE = {str(t): 30.0 for t in range(65, 71)}  # with the no-op token: 7 tokens at logit 30 (+30 bias on 6 of them)


@pytest.fixture(scope="module")
def api() -> Iterator[Api]:
    a = start_api(ServerOptions(api_key="sekret", token_timeout_s=20))
    yield a
    stop_api(a)


@pytest.fixture(scope="module")
def client(api: Api) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=api.url + "/v1", api_key="sekret", max_retries=0, timeout=30)
    yield c
    c.close()


def _ids(choice: object) -> list[int]:
    return list(getattr(choice, "token_ids", None) or choice.model_extra["token_ids"])  # type: ignore[attr-defined]


def test_models_and_model_card(client: openai.OpenAI) -> None:
    assert ["a", "b", "long"] == [m.id for m in client.models.list()][:3]
    card = client.models.retrieve("long")
    assert "long" == card.id and 100_000 == card.model_extra["max_model_len"]  # type: ignore[index]


def test_completion_basics_echo_and_prompt_lists(client: openai.OpenAI) -> None:
    r = client.completions.create(model="a", prompt=[5, 6], max_tokens=4, temperature=0)
    assert noop_tokens(2, 4) == _ids(r.choices[0]) and "length" == r.choices[0].finish_reason
    assert (2, 4, 6) == (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens)  # type: ignore[union-attr]
    r = client.completions.create(model="a", prompt="hi", max_tokens=2, echo=True, temperature=0)
    assert r.choices[0].text.startswith("hi") and 4 == len(r.choices[0].text.encode())
    r = client.completions.create(model="a", prompt=["ab", "cde"], max_tokens=2, n=2, temperature=0)
    assert [0, 1, 2, 3] == [c.index for c in r.choices]
    assert 5 == r.usage.prompt_tokens and 8 == r.usage.completion_tokens  # type: ignore[union-attr]
    assert noop_tokens(3, 2) == _ids(r.choices[2])
    r = client.completions.create(model="a", prompt=[[5], [6, 7]], max_tokens=1)
    assert 2 == len(r.choices) and 3 == r.usage.prompt_tokens  # type: ignore[union-attr]


def test_stop_strings_and_stop_token_ids(client: openai.OpenAI) -> None:
    prompt = [7] * 95  # outputs: 3, then c e g i k m ... (3 + (95 + 2k - 1))
    r = client.completions.create(model="long", prompt=prompt, max_tokens=10, temperature=0, stop=["gi", "zz"])
    assert "\x03ce" == r.choices[0].text and "stop" == r.choices[0].finish_reason
    assert "gi" == r.choices[0].model_extra["stop_reason"]  # type: ignore[index]
    r = client.completions.create(model="long", prompt=prompt, max_tokens=10, temperature=0, stop="gi",
                                  extra_body={"include_stop_str_in_output": True})  # fmt: skip
    assert "\x03cegi" == r.choices[0].text
    r = client.completions.create(model="a", prompt=[5, 6], max_tokens=10, temperature=0, extra_body={"stop_token_ids": [6]})
    assert [3, 6] == _ids(r.choices[0]) and "stop" == r.choices[0].finish_reason
    assert 6 == r.choices[0].model_extra["stop_reason"]  # type: ignore[index]
    r = client.completions.create(model="a", prompt=[5, 6], max_tokens=5, temperature=0, extra_body={"stop_token_ids": [6], "min_tokens": 3})
    assert 6 not in _ids(r.choices[0]) and "length" == r.choices[0].finish_reason


def test_stop_string_across_stream_chunks(client: openai.OpenAI) -> None:
    stream = client.completions.create(model="long", prompt=[7] * 95, max_tokens=10, temperature=0, stop=["gik"], stream=True)
    chunks = list(stream)
    assert "\x03ce" == "".join(c.choices[0].text for c in chunks if c.choices)
    assert "stop" == chunks[-1].choices[0].finish_reason


def test_logit_bias_seed_top_k_top_p_min_p(client: openai.OpenAI) -> None:
    r = client.completions.create(model="a", prompt=[5], max_tokens=4, temperature=0, logit_bias={"65": 100})
    assert "AAAA" == r.choices[0].text

    def run(**kw: object) -> list[int]:
        return _ids(client.completions.create(model="a", prompt=[5], max_tokens=8, temperature=1.0, logit_bias=TIE, **kw).choices[0])  # type: ignore[arg-type]

    assert run(seed=1) == run(seed=1)  # same seed, same tokens
    assert run(seed=1) != run(seed=2)  # 7 tied tokens over 8 steps: a collision is (1/7)^8
    assert set(run(seed=3)) - {65, 66, 67, 68, 69, 70} <= set(noop_tokens(1, 8))
    # top_k=1 / a tiny top_p keep one token per step: the seed no longer matters
    assert run(seed=1, extra_body={"top_k": 1}) == run(seed=2, extra_body={"top_k": 1})
    assert run(seed=1, top_p=0.01) == run(seed=2, top_p=0.01)
    assert run(seed=1, extra_body={"min_p": 0.9}) != run(seed=2, extra_body={"min_p": 0.9})  # ties all pass min_p
    r = client.completions.create(model="a", prompt=[5], max_tokens=6, n=3, seed=5, temperature=1.0, logit_bias=TIE)
    assert 3 == len({tuple(_ids(c)) for c in r.choices})  # n choices get their own seeds


def test_penalties(client: openai.OpenAI) -> None:
    # token 65 biased to 31 beats the no-op token (30) until a penalty hits it after its first use
    # (the prompt is not a no-op token, which the repetition penalty would also hit)
    bias = {"65": 31.0}
    plain = client.completions.create(model="a", prompt=[100], max_tokens=3, temperature=0, logit_bias=bias).choices[0]
    assert [65, 65, 65] == _ids(plain)
    for kw in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"extra_body": {"repetition_penalty": 1.1}}):
        got = _ids(client.completions.create(model="a", prompt=[100], max_tokens=3, temperature=0, logit_bias=bias, **kw).choices[0])  # type: ignore[arg-type]
        assert 65 == got[0] and 65 not in got[1:], kw
    for kw in ({"frequency_penalty": 0}, {"presence_penalty": 0}):  # zero penalties are accepted (they were refused)
        assert [65, 65, 65] == _ids(client.completions.create(model="a", prompt=[100], max_tokens=3, temperature=0, logit_bias=bias, **kw).choices[0])  # type: ignore[arg-type]


def test_completion_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model="a", prompt=[5, 6], max_tokens=3, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and 3 == len(lp.tokens or []) and 3 == len(lp.token_logprobs or [])
    assert all(-1e-6 < x <= 0 for x in lp.token_logprobs or [])  # the no-op token holds all the mass
    tops = lp.top_logprobs or []
    assert 3 == len(tops) and all(2 == len(t) for t in tops)
    # the runner-up is one of the 255 tokens at logit 0: log(e^0 / (e^30 + 255)) ≈ -30
    assert all(math.isclose(-30.0, min(t.values()), abs_tol=1e-3) for t in tops)


def test_chat_every_parameter(client: openai.OpenAI) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    r = client.chat.completions.create(
        model="b", messages=msgs, max_completion_tokens=3, temperature=0.5, top_p=0.9, seed=3, n=2,  # type: ignore[arg-type]
        presence_penalty=0.1, frequency_penalty=0.1, logit_bias={"66": 100}, logprobs=True, top_logprobs=2,
        stop=["\n\n"], user="u1", extra_body={"top_k": 5, "min_p": 0.01, "repetition_penalty": 1.0, "ignore_eos": True},
    )  # fmt: skip
    assert 2 == len(r.choices) and all("BBB" == c.message.content for c in r.choices)
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and "B" == content[0].token and 2 == len(content[0].top_logprobs)
    assert [66] == content[0].bytes
    assert 6 == r.usage.completion_tokens  # type: ignore[union-attr]
    r = client.chat.completions.create(model="b", messages=msgs, max_tokens=2, temperature=0)  # type: ignore[arg-type]
    assert 2 == r.usage.completion_tokens and r.choices[0].logprobs is None  # type: ignore[union-attr]


def test_chat_streaming_with_include_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="a", messages=[{"role": "user", "content": "x"}], max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert "assistant" == chunks[0].choices[0].delta.role
    assert "length" == [c for c in chunks if c.choices][-1].choices[0].finish_reason
    assert [] == chunks[-1].choices and 4 == chunks[-1].usage.completion_tokens  # type: ignore[union-attr]
    assert chunks[-1].usage.prompt_tokens == len("<|user|>\nx\n<|assistant|>\n")  # type: ignore[union-attr]
    no_usage = list(client.chat.completions.create(model="a", messages=[{"role": "user", "content": "x"}], max_tokens=2, stream=True))
    assert all(c.usage is None for c in no_usage)


def test_errors_map_to_sdk_exceptions(api: Api, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    bad = openai.OpenAI(base_url=api.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="API key"):
        bad.completions.create(model="a", prompt="x")
    bad.close()
    with pytest.raises(openai.BadRequestError, match="context") as e:
        client.completions.create(model="a", prompt=[1] * 60, max_tokens=10)
    assert "max_tokens" == e.value.param
    with pytest.raises(openai.BadRequestError, match="best_of") as e:
        client.completions.create(model="a", prompt="x", best_of=3)
    assert "best_of" == e.value.param
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="a", prompt="x", temperature=5)
    assert "temperature" == e.value.param
    with pytest.raises(openai.InternalServerError, match="no instance"):  # 503: a served model with no instance
        client.completions.create(model='we"ird\\name', prompt="x")
    # the connection is still good after every error
    assert 1 == client.completions.create(model="a", prompt="x", max_tokens=1).usage.completion_tokens  # type: ignore[union-attr]


def test_256_concurrent_streams(api: Api) -> None:
    async def main() -> list[int]:
        import httpx

        limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
        async with openai.AsyncOpenAI(base_url=api.url + "/v1", api_key="sekret", max_retries=0, timeout=60,
                                      http_client=openai.DefaultAsyncHttpxClient(limits=limits)) as c:  # fmt: skip

            async def one(i: int) -> int:
                s = await c.completions.create(model="b", prompt=[3 + i % 200], max_tokens=8, temperature=0, stream=True,
                                               stream_options={"include_usage": True})  # fmt: skip
                n = 0
                async for chunk in s:
                    if chunk.usage is not None:
                        n = chunk.usage.completion_tokens
                return n

            return list(await asyncio.gather(*(one(i) for i in range(256))))

    assert [8] * 256 == asyncio.run(main())
