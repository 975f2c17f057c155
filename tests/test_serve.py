"""`hf-accel serve`: the OpenAI-compatible server, end to end with the real `openai` client.

A tiny Llama and a byte-level BPE tokenizer are saved to disk and loaded back, by the server (as the CLI does) and
by the stock reference; greedy output over HTTP must be stock `generate()`'s, decoded. Paths a real engine does not
reach on demand (requests held in flight, engine failures, many deltas at once) use `ScriptedModel`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from conftest import kill_process_tree  # noqa: E402
from serve_fixtures import ScriptedModel, free_port, make_tokenizer, save_checkpoint  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from hf_accel import accelerate_model  # noqa: E402
from hf_accel.api import engine_of  # noqa: E402
from hf_accel.serve.app import build_app  # noqa: E402
from hf_accel.serve.detokenize import ChoiceText, IncrementalDetokenizer  # noqa: E402

NAME = "tiny-llama"
PROMPTS = ["The quick brown", "hello world", "Once upon a time", "A café in Zürich", "Привет", "the end of"]


@contextlib.contextmanager
def running(app) -> Iterator[str]:
    """Serve `app` with uvicorn in a thread on a free loopback port; yields the base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, access_log=False,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def stock(ckpt):
    tok = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype="auto").eval()
    return SimpleNamespace(model=model, tok=tok)


@pytest.fixture(scope="module")
def served(ckpt):
    tok = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype="auto").eval()
    accelerate_model(model)
    app = build_app(model, tok, NAME, max_queued_requests=64)
    with running(app) as url:
        yield SimpleNamespace(url=url, model=model, tok=tok, app=app,
                              client=openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0),
                              aclient=lambda: openai.AsyncOpenAI(base_url=url + "/v1", api_key="none",
                                                                 max_retries=0))


@pytest.fixture
def serve_log(caplog):
    caplog.set_level(logging.INFO, logger="hf_accel.serve")
    return caplog


def request_lines(caplog, path: str, prompt_tokens: int | None = None) -> list[str]:
    """The access log lines for `path` (and requests with that many prompt tokens)."""
    lines = [r.getMessage() for r in caplog.records if r.name == "hf_accel.serve"]
    return [m for m in lines if f" {path} " in m and (prompt_tokens is None or f" prompt_tokens={prompt_tokens} " in m)]


def wait_until(cond, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def wait_served(proc: subprocess.Popen, port: int, timeout: float) -> str:
    """Wait until the server process answers /health on `port` (failing at once if it exits); its base URL."""
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert proc.poll() is None, proc.stdout.read()
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(url + "/health", timeout=1).status_code == 200
        return False

    wait_until(healthy, timeout=timeout, what="the server to come up")
    return url


def wait_blocks_free(model) -> None:
    bm = engine_of(model).block_manager
    wait_until(lambda: bm.num_free_blocks == bm.num_usable_blocks, what="every KV block to be free again")


def chat_ids(tok, messages) -> list[int]:
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


@functools.cache
def _reference(model, tok, ids: tuple[int, ...], max_new: int) -> tuple[str, int, str]:
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False)
    new = out[0, len(ids):].tolist()
    if tok.eos_token_id in new:
        new = new[:new.index(tok.eos_token_id) + 1]
        finish = "stop"
    else:
        finish = "length"
    return tok.decode(new, skip_special_tokens=True), len(new), finish


def reference(stock, ids: list[int], max_new: int) -> tuple[str, int, str]:
    """Stock greedy generate() with the checkpoint's EOS: (text, completion tokens incl. EOS, finish reason)."""
    return _reference(stock.model, stock.tok, tuple(ids), max_new)


def prompt_ids(tok, prompt: str) -> list[int]:
    return tok(prompt)["input_ids"]


def stream_text(chunks) -> tuple[dict[int, str], dict[int, str | None], object]:
    """Texts and finish reasons per choice index, and the usage, from a completions or chat stream."""
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    usage = None
    for chunk in chunks:
        usage = chunk.usage or usage
        for c in chunk.choices:
            piece = c.text if hasattr(c, "text") else (c.delta.content or "")
            texts[c.index] = texts.get(c.index, "") + piece
            finish[c.index] = c.finish_reason or finish.get(c.index)
    return texts, finish, usage


# -- the model's output over HTTP is stock generate()'s ----------------------------------------------------------------

def test_completions_match_stock_concurrently(served, stock):
    cases = [(p, max_new, stream) for p, max_new in zip(PROMPTS, [24, 40, 8, 30, 32, 20]) for stream in (False, True)]

    def one(case):
        prompt, max_new, stream = case
        kw = dict(model=NAME, prompt=prompt, max_tokens=max_new, temperature=0)
        if stream:
            texts, finish, usage = stream_text(served.client.completions.create(
                **kw, stream=True, stream_options={"include_usage": True}))
            return texts[0], finish[0], usage
        r = served.client.completions.create(**kw)
        assert r.object == "text_completion" and r.model == NAME and r.id.startswith("cmpl-")
        return r.choices[0].text, r.choices[0].finish_reason, r.usage

    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(one, cases))
    finishes = set()
    for (prompt, max_new, _), (text, finish, usage) in zip(cases, results):
        ids = prompt_ids(stock.tok, prompt)
        ref_text, ref_len, ref_finish = reference(stock, ids, max_new)
        assert (text, finish) == (ref_text, ref_finish), prompt
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
            len(ids), ref_len, len(ids) + ref_len)
        finishes.add(finish)
    assert finishes == {"stop", "length"}  # the checkpoint's outputs cover both ends
    wait_blocks_free(served.model)


def test_async_client_chat_and_completions_together(served, stock):
    conversations = [[{"role": "user", "content": "hello there"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Once upon a time"}],
                     [{"role": "user", "content": "A café"}, {"role": "assistant", "content": "crème brûlée"},
                      {"role": "user", "content": "more"}]]

    async def chat(messages, stream: bool, max_tokens: int | None):
        client = served.aclient()
        kw = dict(model=NAME, messages=messages, temperature=0)
        if max_tokens is not None:
            kw["max_tokens"] = max_tokens
        if stream:
            out = await client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
            chunks = [c async for c in out]
            roles = [c.choices[0].delta.role for c in chunks if c.choices and c.choices[0].delta.role]
            assert roles == ["assistant"] and chunks[0].object == "chat.completion.chunk"
            texts, finish, usage = stream_text(chunks)
            return texts[0], finish[0], usage
        r = await client.chat.completions.create(**kw)
        assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage

    async def completion(prompt: str, stream: bool):
        client = served.aclient()
        if stream:
            out = await client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0,
                                                  stream=True)
            texts, finish, _ = stream_text([c async for c in out])
            return texts[0], finish[0], None
        r = await client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage

    async def main():
        jobs = [chat(m, stream, mt) for m in conversations for stream, mt in ((False, 12), (True, 20))]
        jobs.append(chat(conversations[0], False, None))  # default: as much as the context leaves
        jobs += [completion(p, stream) for p in PROMPTS[:3] for stream in (False, True)]
        return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    expected = []
    for m in conversations:
        ids = chat_ids(stock.tok, m)
        expected += [(ids, 12), (ids, 20)]
    ids = chat_ids(stock.tok, conversations[0])
    expected.append((ids, 256 - len(ids)))
    expected += [(prompt_ids(stock.tok, p), 16) for p in PROMPTS[:3] for _ in range(2)]
    for (ids, max_new), (text, finish, usage) in zip(expected, results):
        ref_text, ref_len, ref_finish = reference(stock, ids, max_new)
        assert (text, finish) == (ref_text, ref_finish)
        if usage is not None:
            assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), ref_len)
    wait_blocks_free(served.model)


def test_prompt_forms_and_greedy_n(served, stock):
    ids = [prompt_ids(stock.tok, p) for p in PROMPTS[:3]]
    refs = [reference(stock, i, 12) for i in ids]
    for prompt in (PROMPTS[:3], ids):
        r = served.client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
        assert [c.index for c in r.choices] == [0, 1, 2]
        assert [(c.text, c.finish_reason) for c in r.choices] == [(t, f) for t, _, f in refs]
        assert r.usage.prompt_tokens == sum(len(i) for i in ids)
        assert r.usage.completion_tokens == sum(n for _, n, _ in refs)
    one = served.client.completions.create(model=NAME, prompt=ids[1], max_tokens=12, temperature=0)
    assert one.choices[0].text == refs[1][0]
    # n > 1 under greedy decoding: n identical choices, choice p * n + k
    r = served.client.completions.create(model=NAME, prompt=PROMPTS[:2], max_tokens=12, temperature=0, n=2)
    assert [(c.index, c.text) for c in r.choices] == [(0, refs[0][0]), (1, refs[0][0]), (2, refs[1][0]),
                                                     (3, refs[1][0])]
    wait_blocks_free(served.model)


def test_sampling_with_seed_is_reproducible(served):
    kw = dict(model=NAME, prompt="Once upon a time", max_tokens=16, temperature=1.0, n=3, seed=1234)
    first = served.client.completions.create(**kw)
    again = served.client.completions.create(**kw)
    texts = [c.text for c in first.choices]
    assert [c.text for c in again.choices] == texts
    assert len(set(texts)) > 1  # n samples, not one sample thrice
    streamed, _, usage = stream_text(served.client.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    assert [streamed[i] for i in range(3)] == texts
    assert usage.completion_tokens == first.usage.completion_tokens
    other = served.client.completions.create(**{**kw, "seed": 4321})
    assert [c.text for c in other.choices] != texts
    chat = dict(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=10, temperature=0.8, top_p=0.9,
                seed=7, n=2)
    a = served.client.chat.completions.create(**chat)
    b = served.client.chat.completions.create(**chat)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    wait_blocks_free(served.model)


def test_stop_strings(served, stock):
    ids = prompt_ids(stock.tok, "hello world")
    ref_text, ref_len, _ = reference(stock, ids, 24)
    stop = ref_text[5:7]  # two characters from the middle of the output
    cut = ref_text.find(stop)
    kw = dict(model=NAME, prompt="hello world", max_tokens=24, temperature=0, stop=["never seen", stop])
    r = served.client.completions.create(**kw)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (ref_text[:cut], "stop")
    assert 0 < r.usage.completion_tokens < ref_len
    texts, finish, usage = stream_text(served.client.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    assert (texts[0], finish[0], usage.completion_tokens) == (ref_text[:cut], "stop", r.usage.completion_tokens)
    # a stop string that never shows changes nothing; one at the very start leaves no text
    r = served.client.completions.create(**{**kw, "stop": "never seen"})
    assert (r.choices[0].text, r.choices[0].finish_reason) == (ref_text, "length")
    r = served.client.completions.create(**{**kw, "stop": ref_text[:2]})
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("", "stop")
    wait_blocks_free(served.model)


# -- cancellation, limits, errors -------------------------------------------------------------------------------------

def test_disconnect_mid_stream_frees_blocks(served, stock, serve_log):
    prompt = "the end of the story is near"
    n = len(prompt_ids(stock.tok, prompt))
    lines = functools.partial(request_lines, serve_log, "/v1/completions", n)
    body = {"model": NAME, "prompt": prompt, "max_tokens": 256 - n, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", served.url + "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        seen = 0
        for line in resp.iter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen == 2:
                    break  # leaving the block closes the connection mid-stream
    wait_until(lines, what="the request's log line")
    wait_blocks_free(served.model)
    (line,) = lines()
    assert " 200 " in line and int(line.split("completion_tokens=")[1].split()[0]) < 256 - n
    # a non-streaming request whose client gives up
    with pytest.raises(httpx.TimeoutException):
        httpx.post(served.url + "/v1/completions", json={**body, "stream": False}, timeout=0.05)
    wait_until(lambda: len(lines()) == 2, what="the second log line")
    assert " 499 " in lines()[1] and int(lines()[1].split("completion_tokens=")[1].split()[0]) < 256 - n
    wait_blocks_free(served.model)
    r = served.client.completions.create(model=NAME, prompt="hello world", max_tokens=8, temperature=0)
    assert r.choices[0].text == reference(stock, prompt_ids(stock.tok, "hello world"), 8)[0]


def test_one_log_line_per_request(served, serve_log):
    httpx.get(served.url + "/health").raise_for_status()
    served.client.models.list()
    served.client.completions.create(model=NAME, prompt="hello", max_tokens=3, temperature=0)
    list(served.client.completions.create(model=NAME, prompt="hello", max_tokens=3, temperature=0, stream=True))
    httpx.post(served.url + "/v1/completions", json={"model": NAME, "prompt": ""})
    wait_until(lambda: len(request_lines(serve_log, "/v1/completions")) == 3, what="log lines")
    lines = [r.getMessage() for r in serve_log.records if r.name == "hf_accel.serve"]
    assert len(lines) == 5
    assert lines[0].startswith("GET /health 200 ") and lines[1].startswith("GET /v1/models 200 ")
    assert "POST /v1/completions 200 prompt_tokens=" in lines[2] and "completion_tokens=3 " in lines[2]
    assert "completion_tokens=3 " in lines[3] and "POST /v1/completions 400 " in lines[4]


def test_models_and_health(served):
    assert httpx.get(served.url + "/health").status_code == 200
    assert [m.id for m in served.client.models.list().data] == [NAME]


BAD_REQUESTS = [
    ("/v1/completions", {"model": NAME, "prompt": "hi " * 300}, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": -5}, "max_tokens"),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 255}, "max_tokens"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, "model"),
    ("/v1/completions", {"prompt": "hi"}, "model"),
    ("/v1/completions", {"model": NAME, "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": []}, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": [[]]}, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": [1, "a"]}, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": [5, 100000]}, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "stop": [""]}, "stop"),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "logprobs": 2}, "logprobs"),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", [1, 2, 3], None),
    ("/v1/chat/completions", {"model": NAME, "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"model": NAME, "messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi " * 300}]}, "messages"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "logprobs": True},
     "logprobs"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
]


@pytest.mark.parametrize("path,body,param", BAD_REQUESTS, ids=[f"{i}" for i in range(len(BAD_REQUESTS))])
def test_bad_requests_get_400(served, path, body, param):
    r = httpx.post(served.url + path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"] and set(err) == {"message", "type", "param",
                                                                                      "code"}
    if param is not None:
        assert (err["param"] or "").split(".")[0] == param, err


def test_malformed_bodies_get_400_and_the_server_stays_up(served):
    for content in (b"{not json", b"", b"null", b'{"model": "tiny-llama", "prompt": "hi"'):
        r = httpx.post(served.url + "/v1/completions", content=content, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"], (content, r.text)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        served.client.completions.create(model=NAME, prompt="hi", max_tokens=0)
    assert served.client.completions.create(model=NAME, prompt="hi", max_tokens=2, temperature=0).choices
    wait_blocks_free(served.model)


def test_lone_surrogates_get_400_and_tiny_temperatures_decode_greedily(served):
    """Valid JSON that is not valid Unicode text ("\\ud800") reached the tokenizer, which raised: a 500. A positive
    temperature so small that logits / T overflows failed the sampler: a 500 too. (A hostile test, 2026-12-01.)"""
    import json

    for path, body in (("/v1/completions", {"model": NAME, "prompt": "hi \ud800"}),
                       ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "a\ud800"}]})):
        r = httpx.post(served.url + path, content=json.dumps(body).encode(),
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and "Unicode" in r.json()["error"]["message"], r.text
    greedy = served.client.completions.create(model=NAME, prompt="hi", max_tokens=6, temperature=0)
    tiny = served.client.completions.create(model=NAME, prompt="hi", max_tokens=6, temperature=5e-324)
    assert tiny.choices[0].text == greedy.choices[0].text
    wait_blocks_free(served.model)


# -- paths a real engine does not reach on demand: a scripted model -------------------------------------------------

@pytest.fixture
def scripted():
    tok = make_tokenizer()
    model = ScriptedModel(tok, text="hello world")
    app = build_app(model, tok, "scripted", max_queued_requests=2)
    with running(app) as url:
        yield SimpleNamespace(url=url, model=model, app=app)
        model.release.set()


def test_queue_full_gets_503(scripted):
    scripted.model.mode = "hold"
    body = {"model": "scripted", "prompt": "hi", "max_tokens": 4}
    with ThreadPoolExecutor(2) as pool:
        held = [pool.submit(httpx.post, scripted.url + "/v1/completions", json=body, timeout=20) for _ in range(2)]
        wait_until(lambda: scripted.app.state.server.in_flight == 2, what="two requests in flight")
        r = httpx.post(scripted.url + "/v1/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_overloaded"
        r = httpx.post(scripted.url + "/v1/completions", json={**body, "stream": True})
        assert r.status_code == 503
        scripted.model.release.set()
        assert [f.result().status_code for f in held] == [200, 200]
    assert scripted.app.state.server.in_flight == 0
    assert httpx.post(scripted.url + "/v1/completions", json=body).json()["choices"][0]["text"] == "hello world"


def test_waiting_deltas_go_out_as_one_chunk_per_choice(scripted):
    body = {"model": "scripted", "prompt": "hi", "max_tokens": 4, "n": 2, "stream": True}
    r = httpx.post(scripted.url + "/v1/completions", json=body)
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [(c["choices"][0]["index"], c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks] \
        == [(0, "hello world", "length"), (1, "hello world", "length")]
    assert len(scripted.model.token_ids) > 1


def test_engine_failures_are_500_and_the_server_keeps_running(scripted):
    body = {"model": "scripted", "prompt": "hi", "max_tokens": 4}
    scripted.model.mode = "raise"
    r = httpx.post(scripted.url + "/v1/completions", json=body)
    assert r.status_code == 500 and "unexpected failure" in r.json()["error"]["message"]
    scripted.model.mode = "fail"
    r = httpx.post(scripted.url + "/v1/completions", json=body)
    assert r.status_code == 500 and "broke down" in r.json()["error"]["message"]
    r = httpx.post(scripted.url + "/v1/completions", json={**body, "stream": True})
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert "broke down" in json.loads(events[0])["error"]["message"] and events[-1] == "[DONE]"
    scripted.model.mode = "burst"
    assert httpx.get(scripted.url + "/health").status_code == 200
    assert httpx.post(scripted.url + "/v1/completions", json=body).status_code == 200
    assert scripted.app.state.server.in_flight == 0


def test_disconnect_and_shutdown_abort_the_streams(scripted):
    scripted.model.mode = "hold"
    body = {"model": "scripted", "prompt": "hi", "max_tokens": 4, "stream": True}
    with httpx.Client(timeout=10) as http, http.stream("POST", scripted.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        wait_until(lambda: scripted.model.streams, what="the stream")
    wait_until(lambda: scripted.model.streams[0].closed, what="the stream closed after the disconnect")
    wait_until(lambda: scripted.app.state.server.in_flight == 0, what="the request's slot given back")
    # shutdown: abort_all ends what is in flight with finish_reason "abort"
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(httpx.post, scripted.url + "/v1/completions", json={**body, "stream": False}, timeout=20)
        wait_until(lambda: scripted.app.state.server.in_flight == 1, what="a request in flight")
        scripted.app.state.server.abort_all()
        r = fut.result()
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "abort"
    assert httpx.post(scripted.url + "/v1/completions", json=body).status_code == 503  # shutting down


# -- incremental detokenization ----------------------------------------------------------------------------------------

def test_incremental_detokenizer_matches_full_decode():
    tok = make_tokenizer()
    text = "A café in Zürich: 你好，世界 🙂🚀 — crème brûlée"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    gen = torch.Generator().manual_seed(0)
    sequences = [ids] + [torch.randint(3, len(tok), (60,), generator=gen).tolist() for _ in range(20)]
    for seq in sequences:
        detok = IncrementalDetokenizer(tok)
        pieces = [detok.add([t]) for t in seq] + [detok.flush()]
        assert "".join(pieces) == tok.decode(seq, skip_special_tokens=True)
        if seq is ids:  # valid text: no piece ever ends in half a character
            assert "\ufffd" not in "".join(pieces)
        detok = IncrementalDetokenizer(tok, context_ids=seq[:5])  # prompt context: its text is not handed out
        assert "".join([detok.add(seq[5:]), detok.flush()]) == tok.decode(seq, skip_special_tokens=True)[
            len(tok.decode(seq[:5], skip_special_tokens=True)):] or tok.decode(seq[:5]).endswith("\ufffd")
    # one character split over tokens (one per byte): nothing comes out until it is whole
    parts = tok.convert_tokens_to_ids(_byte_tokens("🙂"))
    detok = IncrementalDetokenizer(tok)
    assert [detok.add([p]) for p in parts] == ["", "", "", "🙂"]
    detok = IncrementalDetokenizer(tok)
    assert detok.add(parts[:2]) == "" and detok.flush() == "\ufffd"  # at the end, what is there is the text


def _byte_tokens(s: str) -> list[str]:
    """The byte-level BPE symbols of `s`'s bytes, one per byte (GPT-2's byte-to-character map)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    symbol = {b: chr(b) for b in printable} | {b: chr(256 + k) for k, b in enumerate(others)}
    return [symbol[b] for b in s.encode()]


def test_stop_strings_are_held_back_and_cut():
    tok = make_tokenizer()
    ids = tok("hello world, hello there", add_special_tokens=False)["input_ids"]
    choice = ChoiceText(tok, stop=["o th"])
    out = []
    for t in ids:
        if choice.add([t]):
            break
        out.append(choice.take(final=False))
        assert not "".join(out).endswith(("o", "o ", "o t"))  # could be the start of the stop string
    out.append(choice.take(final=True))
    assert "".join(out) == "hello world, hell" and choice.stopped
    assert choice.num_tokens == next(k for k in range(1, len(ids) + 1) if "o th" in tok.decode(ids[:k]))
    plain = ChoiceText(tok)
    plain.add(ids)
    plain.finish()
    assert plain.take(final=True) == "hello world, hello there" and plain.num_tokens == len(ids)


# -- the command line ----------------------------------------------------------------------------------------------

def test_cli_passes_the_optimisation_switches_to_accelerate_model(ckpt, stock):
    """`hf-accel serve --no-fold-norms --chain-residual-norms ...` reaches AccelConfig as `hf-accel bench` does; an
    unset switch keeps the library's default."""
    import argparse

    from hf_accel.config import CLI_SWITCHES, AccelConfig
    from hf_accel.serve import cli as serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    defaults = AccelConfig()
    args = parser.parse_args([str(ckpt), "--device", "cpu", "--no-compile", "--no-fold-norms",
                              "--chain-residual-norms"])
    model, tok = serve_cli.load(args)
    cfg = model._hf_accel_state.config
    assert cfg.fold_norms is False and cfg.chain_residual_norms is True
    assert all(getattr(cfg, n) == getattr(defaults, n) for n in CLI_SWITCHES if n not in ("fold_norms",
                                                                                        "chain_residual_norms"))
    ids = tok("hello world", return_tensors="pt").input_ids
    want = stock.model.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False), want)


def test_cli_serves_and_exits_cleanly_on_sigterm(ckpt, stock):
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "hf_accel.cli", "serve", str(ckpt), "--port", str(port),
                             "--served-model-name", NAME, "--max-num-seqs", "8"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        url = wait_served(proc, port, timeout=45)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r = client.completions.create(model=NAME, prompt="hello world", max_tokens=8, temperature=0)
        assert r.choices[0].text == reference(stock, prompt_ids(stock.tok, "hello world"), 8)[0]
        # SIGTERM while a long stream is in flight: the stream is ended (finish_reason "abort", unless it was done
        # already), and the process exits 0 promptly
        max_new = 256 - len(prompt_ids(stock.tok, "hello world"))
        ref_finish = reference(stock, prompt_ids(stock.tok, "hello world"), max_new)[2]
        stream = client.completions.create(model=NAME, prompt="hello world", max_tokens=max_new, temperature=0,
                                           stream=True)
        first = next(iter(stream))
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rest = list(stream)
        assert (rest or [first])[-1].choices[0].finish_reason in ("abort", ref_finish)
        assert proc.wait(timeout=15) == 0 and time.monotonic() - t0 < 15
        out = proc.stdout.read()
        assert "POST /v1/completions 200" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_serves_a_tensor_parallel_model_under_torchrun(ckpt, stock):
    """`torchrun --nproc-per-node 2 -m hf_accel.cli serve`: rank 0 answers HTTP and drives, rank 1 follows its
    schedule step by step (gloo on CPU). Concurrent requests, a stop string and a stream all give stock's text; on
    SIGTERM rank 0 shuts down and rank 1 returns once told."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    port = free_port()
    proc = _serve_under_torchrun(ckpt, port, "--served-model-name", NAME, "--max-num-seqs", "8")
    try:
        url = wait_served(proc, port, timeout=90)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        prompts = ["hello world", "The quick brown fox", "Once upon a time", "A café in Zürich"]

        def one(prompt: str) -> str:
            return client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0).choices[0].text

        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(one, prompts))
        assert got == [reference(stock, prompt_ids(stock.tok, p), 12)[0] for p in prompts]
        ref_text = reference(stock, prompt_ids(stock.tok, "hello world"), 24)[0]
        stream = client.completions.create(model=NAME, prompt="hello world", max_tokens=24, temperature=0,
                                           stream=True)
        assert "".join(c.choices[0].text for c in stream) == ref_text
        if len(ref_text) > 4:  # a stop string: the server aborts the stream, the abort reaches rank 1's plan
            stop = ref_text[2:4]
            r = client.completions.create(model=NAME, prompt="hello world", max_tokens=24, temperature=0, stop=[stop])
            assert r.choices[0].text == ref_text[: ref_text.index(stop)]
        assert one("hello world") == reference(stock, prompt_ids(stock.tok, "hello world"), 12)[0]
        os.kill(_rank_pid(proc.pid, 0), signal.SIGTERM)  # what stops a server; torchrun then sees both ranks end
        code = proc.wait(timeout=60)
        out = proc.stdout.read()
        assert code == 0, out[-5000:]
        assert "rank 0 stopped serving after" in out, out[-3000:]
        assert "Traceback" not in out, out[-3000:]
    finally:
        if proc.poll() is None:
            kill_process_tree(proc.pid)
            proc.wait()


def _rank_pid(torchrun_pid: int, rank: int) -> int:
    """The pid of torchrun's worker of `rank` (Linux: its children's environments)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == torchrun_pid and f"RANK={rank}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                return int(entry.name)
    raise AssertionError(f"no worker of rank {rank} under torchrun (pid {torchrun_pid})")


def test_cli_refuses_at_startup_a_tensor_parallel_model_it_could_not_drive(tmp_path):
    """A checkpoint whose generation config adds a host-side logits processor (no_repeat_ngram_size) cannot be driven
    to the other ranks: the TP server refuses to start, naming why, rather than failing every request."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    from transformers import GenerationConfig

    path = save_checkpoint(tmp_path / "ngram")
    gc = GenerationConfig.from_pretrained(path)
    gc.no_repeat_ngram_size = 2
    gc.save_pretrained(path)
    proc = _serve_under_torchrun(path, free_port())
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        kill_process_tree(proc.pid)
        raise AssertionError("the TP server neither started nor refused within 120 s") from None
    assert proc.returncode != 0
    assert "cannot serve" in out and "logits processors" in out, out[-3000:]
    assert "rank 0 stopped serving after" in out  # the follower was released, not left waiting


def _serve_under_torchrun(path: Path, port: int, *extra: str) -> subprocess.Popen:
    """`hf-accel serve` on two ranks (gloo on CPU), output merged into stdout; kill with kill_process_tree."""
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "HF_ACCEL_BACKGROUND_BUILDS": "0",
           "PYTHONPATH": root + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                             "-m", "hf_accel.cli", "serve", str(path), "--port", str(port), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                            start_new_session=True)
