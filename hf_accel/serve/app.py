"""The FastAPI application: OpenAI-style completions and chat completions over `model.agenerate_stream`.

Each HTTP request becomes one engine stream per prompt; all of them run in the model's one engine, batched with
whatever else is in flight. The server adds what the engine does not know about: text (incremental detokenization,
stop strings, chat templates), OpenAI's request and response shapes, a bound on requests in flight, cancellation
when the client goes away, and one log line per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from hf_accel.serve.detokenize import ChoiceText
from hf_accel.serve.protocol import ChatCompletionRequest, CompletionRequest, RequestError, error_body

logger = logging.getLogger("hf_accel.serve")

MAX_N = 128  # choices per prompt: each one is a sequence in the engine's batch
MAX_CHOICES = 1024  # choices per request (prompts times n)
MAX_STOP = 16  # stop strings per request (each is searched for at every token)
GREEDY_BELOW_TEMPERATURE = 1e-5  # a temperature below this decodes greedily (its limit): logits / T would overflow
_CONTEXT_TOKENS = 4  # prompt tokens the detokenizer decodes before the first generated token (leading spaces)


@dataclass
class _RequestLog:
    """What the access log line reports beyond the status; endpoints fill it in as they go."""

    prompt_tokens: int = 0
    completion_tokens: int = 0


class _AccessLog:
    """ASGI middleware: exactly one log line per HTTP request, written as its response ends (just before the last
    body message goes out; or when the client left, or it failed), so that the token counts are the final ones."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        entry = scope["hf_accel.serve"] = _RequestLog()
        status: list[int] = []
        logged = False

        def write() -> None:
            nonlocal logged
            if not logged:
                logged = True
                logger.info("%s %s %s prompt_tokens=%d completion_tokens=%d %.3fs", scope.get("method"),
                            scope.get("path"), status[-1] if status else 499, entry.prompt_tokens,
                            entry.completion_tokens, time.perf_counter() - t0)

        async def send_and_note(message: dict) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                write()
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except BaseException:
            if not logged:
                status.append(500)
            raise
        finally:
            write()


class _EventStream(Response):
    """A server-sent-events response that notices a client leaving even while no chunk is due, and always closes
    its chunk generator (so the engine streams behind it are aborted and their KV blocks freed) and runs
    `on_close`, however the response ends."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]  # no content-length: the body is chunked
        self._chunks = chunks
        self._on_close = on_close

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        async def stream_out(scope_: anyio.CancelScope) -> None:
            try:
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                async for chunk in self._chunks:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:  # the client is gone
                pass
            scope_.cancel()

        async def watch_disconnect(scope_: anyio.CancelScope) -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            scope_.cancel()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(stream_out, tg.cancel_scope)
                tg.start_soon(watch_disconnect, tg.cancel_scope)
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self._chunks, "aclose", None)
                if aclose is not None:
                    await aclose()
                self._on_close()


class _Generation:
    """One HTTP request's generation: engine streams for its prompts, their deltas merged into one queue.

    Choice `p * n + k` is the `k`-th sequence of prompt `p`. `updates()` hands out, per round, every choice that
    has new text or finished, with all the tokens that arrived for it since the previous round: a slow client gets
    fewer, larger chunks rather than a backlog.
    """

    def __init__(self, server: _Server, prompts: list[list[int]], n: int, generate_kwargs: dict[str, Any],
                 seed: int | None, stop: Sequence[str]) -> None:
        self._server = server
        self._prompts = prompts
        self._n = n
        self._kwargs = generate_kwargs
        self._seed = seed
        self.choices = [ChoiceText(server.tokenizer, stop=stop, context_ids=p[-_CONTEXT_TOKENS:])
                        for p in prompts for _ in range(n)]
        self.finish_reasons: list[str | None] = [None] * len(self.choices)
        self._streams: list[Any] = []
        self._firsts: list[int] = []  # index of the first choice of each stream
        self._pumps: list[asyncio.Task] = []
        self._queue: asyncio.Queue = asyncio.Queue()
        self._cancelled = False

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self._prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    def start(self) -> None:
        """Submit every prompt to the engine. Bad input (ValueError) or what this model cannot serve
        (NotImplementedError) raises here, before anything is generated.

        Sampling asks for `n` sequences in one call (`num_return_sequences`); greedy decoding, which generate()
        refuses to repeat (`num_return_sequences` > 1 needs sampling), makes one call per choice instead.
        """
        device = self._server.device
        per_call = self._n if self._kwargs.get("do_sample") else 1
        try:
            for p, ids in enumerate(self._prompts):
                input_ids = torch.tensor([ids], dtype=torch.long, device=device)
                for first in range(p * self._n, (p + 1) * self._n, per_call):
                    kwargs = {**self._kwargs, "num_return_sequences": per_call}
                    stream = self._server.model.agenerate_stream(input_ids, seed=self._seed, **kwargs)
                    s = len(self._streams)
                    self._streams.append(stream)
                    self._firsts.append(first)
                    self._pumps.append(self._server.keep(asyncio.create_task(self._pump(s, stream))))
        except BaseException:
            self.cancel()
            raise
        self._server.generations.add(self)

    async def _pump(self, s: int, stream: Any) -> None:
        try:
            async for delta in stream:
                self._queue.put_nowait((s, delta))
        except Exception as exc:
            self._queue.put_nowait((s, exc))
        finally:
            try:
                await asyncio.shield(stream.aclose())
            except Exception:
                logger.exception("closing an engine stream failed")
            self._queue.put_nowait((s, None))

    def abort(self) -> None:
        """Stop generating (server shutdown): every choice still running ends with finish_reason "abort"."""
        for stream in self._streams:
            stream.abort()

    def cancel(self) -> None:
        """Drop the request (client gone, or an error): abort its streams; each pump closes its stream."""
        if self._cancelled:
            return
        self._cancelled = True
        self._server.generations.discard(self)
        for stream in self._streams:
            with contextlib.suppress(Exception):
                stream.abort()
        for task in self._pumps:
            task.cancel()

    async def updates(self) -> AsyncIterator[list[tuple[int, str, str | None]]]:
        """Rounds of (choice index, new text, finish reason or None), until every stream has ended."""
        open_streams = len(self._streams)
        reported = [False] * len(self.choices)
        try:
            while open_streams:
                items = [await self._queue.get()]
                while not self._queue.empty():
                    items.append(self._queue.get_nowait())
                touched: dict[int, None] = {}
                for s, item in items:
                    if item is None:
                        open_streams -= 1
                        for c in self._choices_of(s):  # a stream that ended without finishing a choice
                            if self.finish_reasons[c] is None:
                                self.choices[c].finish()
                                self.finish_reasons[c] = "abort"
                                touched[c] = None
                    elif isinstance(item, BaseException):
                        raise item
                    else:
                        self._apply(s, item, touched)
                out = []
                for c in touched:
                    if reported[c]:
                        continue
                    finish = self.finish_reasons[c]
                    text = self.choices[c].take(final=finish is not None)
                    if text or finish is not None:
                        out.append((c, text, finish))
                        reported[c] = finish is not None
                if out:
                    yield out
        finally:
            self._server.generations.discard(self)
            if open_streams:
                self.cancel()

    def _choices_of(self, s: int) -> range:
        end = self._firsts[s + 1] if s + 1 < len(self._firsts) else len(self.choices)
        return range(self._firsts[s], end)

    def _apply(self, s: int, delta: Any, touched: dict[int, None]) -> None:
        c = self._firsts[s] + delta.sequence
        if self.finish_reasons[c] is not None:
            return  # e.g. the "abort" that follows our own abort at a stop string
        choice = self.choices[c]
        if choice.add(delta.token_ids):
            self.finish_reasons[c] = "stop"
            self._streams[s].abort(delta.sequence)
        elif delta.finish_reason is not None:
            choice.finish()
            self.finish_reasons[c] = "stop" if choice.stopped else delta.finish_reason  # stop, length, abort
        touched[c] = None

    async def collect(self) -> list[str]:
        """Run to the end; the text of every choice."""
        pieces: list[list[str]] = [[] for _ in self.choices]
        async for round_ in self.updates():
            for c, text, _ in round_:
                pieces[c].append(text)
        return ["".join(p) for p in pieces]


@dataclass
class _Sampling:
    prompts: list[list[int]]
    n: int
    kwargs: dict[str, Any]
    seed: int | None
    stop: list[str]


def _is_led(model: Any) -> bool:
    from hf_accel.api import engine_of

    return engine_of(model).driver is not None


class _Server:
    """Everything the endpoints share: the model, its tokenizer, the limits, and the generations in flight."""

    def __init__(self, model: Any, tokenizer: Any, served_model_name: str, max_queued_requests: int) -> None:
        if not hasattr(model, "agenerate_stream"):
            raise ValueError("the model is not accelerated (call hf_accel.accelerate_model(model) first)")
        if max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be at least 1, got {max_queued_requests}")
        from hf_accel import engine_info

        try:
            tensor_parallel = engine_info(model).get("tensor_parallel")
        except ValueError:  # a stand-in model (tests) or one restored meanwhile: its calls say so themselves
            tensor_parallel = None
        if tensor_parallel and not _is_led(model):
            raise NotImplementedError(
                "a tensor-parallel model is served from rank 0 only, after hf_accel.api.lead_tensor_parallel(model) "
                "(the other ranks run follow_tensor_parallel(model)); `hf-accel serve` under torchrun does both")
        if tensor_parallel:  # fail at startup, not on every request
            from hf_accel.api import check_led_model_servable

            check_led_model_servable(model)
        self.model = model
        self.tokenizer = tokenizer
        self.name = served_model_name
        self.max_queued_requests = max_queued_requests
        self.in_flight = 0
        self.generations: set[_Generation] = set()
        self.shutting_down = False
        self.created = int(time.time())
        self._tasks: set[asyncio.Task] = set()
        self.device = next(model.parameters()).device
        self.vocab_size = _vocab_size(model)
        self.max_context = _max_context(model, tokenizer)
        gen_cfg = getattr(model, "generation_config", None)
        eos = getattr(gen_cfg, "eos_token_id", None)
        if eos is None:
            eos = tokenizer.eos_token_id
        self.eos_ids: list[int] = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        pad = getattr(gen_cfg, "pad_token_id", None)
        if pad is None:
            pad = tokenizer.pad_token_id
        self.pad_id: int | None = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else None)

    def keep(self, task: asyncio.Task) -> asyncio.Task:
        """Hold a reference to a background task until it is done (asyncio only keeps weak ones)."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def abort_all(self) -> None:
        """On shutdown: end every generation in flight (finish_reason "abort") and refuse new ones."""
        self.shutting_down = True
        for gen in list(self.generations):
            with contextlib.suppress(Exception):
                gen.abort()

    # -- admission -----------------------------------------------------------------------------------------------
    def acquire(self) -> Callable[[], None]:
        """A slot among `max_queued_requests`, or a 503; the returned function gives it back (once)."""
        if self.shutting_down:
            raise RequestError("the server is shutting down", status=503, type="server_error", code="shutting_down")
        if self.in_flight >= self.max_queued_requests:
            raise RequestError(f"the server has {self.in_flight} requests in flight, its limit "
                               f"(--max-queued-requests {self.max_queued_requests}); retry later", status=503,
                               type="server_error", code="server_overloaded")
        self.in_flight += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.in_flight -= 1

        return release

    # -- request to engine arguments -----------------------------------------------------------------------------
    def check_model(self, name: str) -> None:
        if name != self.name:
            raise RequestError(f"the model `{name}` does not exist; this server serves `{self.name}`", param="model",
                               code="model_not_found")

    def encode(self, text: str, *, add_special_tokens: bool, param: str) -> list[int]:
        if not text:
            raise RequestError(f"{param} must not be empty", param=param)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800" is valid JSON): the tokenizer raises TypeError
            raise RequestError(f"{param} is not valid Unicode text ({exc.reason} at character {exc.start})",
                               param=param) from exc
        ids = self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        if not ids:
            raise RequestError(f"{param} has no tokens", param=param)
        return list(ids)

    def check_ids(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise RequestError(f"{param} must not be empty", param=param)
        if self.vocab_size is not None and any(t < 0 or t >= self.vocab_size for t in ids):
            raise RequestError(f"{param} has token ids outside the vocabulary [0, {self.vocab_size})", param=param)
        return ids

    def completion_prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self.encode(prompt, add_special_tokens=True, param="prompt")]
        if not prompt:
            raise RequestError("prompt must not be empty", param="prompt")
        if all(isinstance(t, int) for t in prompt):
            return [self.check_ids(list(prompt), "prompt")]
        if all(isinstance(t, str) for t in prompt):
            return [self.encode(t, add_special_tokens=True, param="prompt") for t in prompt]
        return [self.check_ids(list(p), "prompt") for p in prompt]

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        if not req.messages:
            raise RequestError("messages must not be empty", param="messages")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise RequestError("the model's tokenizer has no chat template; use /v1/completions", param="messages")
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in req.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # the template's own checks (roles that must alternate, ...), jinja errors
            raise RequestError(f"the chat template refused the messages: {exc}", param="messages") from exc
        # the template writes the special tokens it wants (BOS included); the tokenizer must not add them again
        return self.encode(text, add_special_tokens=False, param="messages")

    def sampling(self, req: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]],
                 max_tokens: int | None, prompt_param: str) -> _Sampling:
        unsupported = req.unsupported_fields()
        if unsupported:
            raise RequestError(f"{unsupported[0]} is not supported by this server", param=unsupported[0],
                               code="unsupported_parameter")
        n = 1 if req.n is None else req.n
        if not 1 <= n <= MAX_N:
            raise RequestError(f"n must be between 1 and {MAX_N}, got {n}", param="n")
        if len(prompts) * n > MAX_CHOICES:
            raise RequestError(f"a request may ask for at most {MAX_CHOICES} choices (prompts times n), this one "
                               f"asks for {len(prompts) * n}", param="n")
        temperature = 1.0 if req.temperature is None else float(req.temperature)
        if not (math.isfinite(temperature) and temperature >= 0):
            raise RequestError(f"temperature must be a number >= 0, got {temperature}", param="temperature")
        top_p = 1.0 if req.top_p is None else float(req.top_p)
        if not 0 < top_p <= 1:  # NaN fails this too
            raise RequestError(f"top_p must be in (0, 1], got {top_p}", param="top_p")
        top_k = 0 if req.top_k is None or req.top_k in (0, -1) else req.top_k
        if top_k < 0:
            raise RequestError(f"top_k must be positive (0 or -1: off), got {top_k}", param="top_k")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if any(not s for s in stop):
            raise RequestError("stop strings must not be empty", param="stop")
        if len(stop) > MAX_STOP:
            raise RequestError(f"at most {MAX_STOP} stop strings, got {len(stop)}", param="stop")
        longest = max(len(p) for p in prompts)
        if self.max_context is not None and longest >= self.max_context:
            raise RequestError(f"the prompt has {longest} tokens, the model's context length is {self.max_context}: "
                               "no room left to generate", param=prompt_param, code="context_length_exceeded")
        if max_tokens is None:  # chat: as much as the context leaves
            max_tokens = self.max_context - longest if self.max_context is not None else 16
        if max_tokens <= 0:
            raise RequestError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        if self.max_context is not None and longest + max_tokens > self.max_context:
            raise RequestError(f"the model's context length is {self.max_context} tokens; the prompt has {longest} "
                               f"and max_tokens is {max_tokens} ({longest + max_tokens} in all)",
                               param="max_tokens", code="context_length_exceeded")
        kwargs: dict[str, Any] = {"max_new_tokens": max_tokens, "num_return_sequences": n,
                                  "eos_token_id": self.eos_ids or None, "pad_token_id": self.pad_id}
        if temperature < GREEDY_BELOW_TEMPERATURE:  # 0, or so small that logits / T overflows: the greedy limit
            kwargs["do_sample"] = False
        else:  # OpenAI's semantics: top-k only when asked for (generate() would apply top_k=50 by default)
            kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k)
        return _Sampling(prompts=prompts, n=n, kwargs=kwargs, seed=req.seed, stop=stop)


def _vocab_size(model: Any) -> int | None:
    """Token ids a prompt may hold: the input embedding's rows (config.vocab_size is nested in some configs)."""
    with contextlib.suppress(Exception):
        return int(model.get_input_embeddings().num_embeddings)
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return size if isinstance(size, int) else None


def _max_context(model: Any, tokenizer: Any) -> int | None:
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config  # multimodal: the text model's
    limit = getattr(text, "max_position_embeddings", None)
    if isinstance(limit, int) and limit > 0:
        try:  # what the engine serves: a family may serve less (Llama 4's chunked attention: one chunk)
            from hf_accel.engine.engine import ModelShape

            return min(limit, ModelShape.from_config(config).max_model_len)
        except (AttributeError, TypeError):  # a config without the attention shape: the plain limit
            return limit
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and 0 < limit < 10_000_000 else None


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def _usage(gen: _Generation) -> dict[str, int]:
    p, c = gen.prompt_tokens, gen.completion_tokens
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client has gone (the body was read already, so the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(model: Any, tokenizer: Any, served_model_name: str, *, max_queued_requests: int = 1024) -> FastAPI:
    """The OpenAI-compatible app for an accelerated `model` and its `tokenizer`.

    `served_model_name` is the only `model` value requests may name. More than `max_queued_requests` requests in
    flight get a 503. `app.state.server.abort_all()` ends every generation in flight (used on shutdown).
    """
    server = _Server(model, tokenizer, served_model_name, max_queued_requests)
    app = FastAPI(title="hf_accel", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.add_middleware(_AccessLog)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(_validation_body(exc), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), code=str(exc.status_code)), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        return _internal_error_response(request, exc)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": server.name, "object": "model", "created": server.created,
                                            "owned_by": "hf_accel", "max_model_len": server.max_context}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        try:
            server.check_model(req.model)
            prompts = server.completion_prompts(req.prompt)
            sampling = server.sampling(req, prompts, 16 if req.max_tokens is None else req.max_tokens, "prompt")
            return await _serve(server, request, req, sampling, chat=False)
        except RequestError:
            raise
        except Exception as exc:  # answered here: Starlette's last-resort handler would also re-raise it
            return _internal_error_response(request, exc)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        try:
            server.check_model(req.model)
            prompt = server.chat_prompt(req)
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            sampling = server.sampling(req, [prompt], max_tokens, "messages")
            return await _serve(server, request, req, sampling, chat=True)
        except RequestError:
            raise
        except Exception as exc:
            return _internal_error_response(request, exc)

    return app


def _internal_error_response(request: Request, exc: BaseException) -> JSONResponse:
    logger.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
    return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", type="server_error"),
                        status_code=500)


def _validation_body(exc: RequestValidationError) -> dict[str, Any]:
    """OpenAI's error body for what FastAPI's validation found, naming the first wrong field.

    pydantic reports a value that fits none of a union's types once per type, with the type as a location part
    (`prompt.str`, `prompt.list[int]`, ...): those become one message that lists the accepted types.
    """
    errors = exc.errors()
    if not errors:
        return error_body("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return error_body(f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}")

    def split(loc: Sequence[Any]) -> tuple[str | None, str | None]:
        names, tag = [], None
        for part in loc:
            if part == "body":
                continue
            if isinstance(part, str) and ("[" in part or "-" in part or part in _TYPE_TAGS):
                tag = part  # a union member: the rest of the location is inside that type
                break
            names.append(str(part))
        return (".".join(names) or None), tag

    param, _ = split(first.get("loc", ()))
    if param is None:
        return error_body(f"the body must be a JSON object with the request's fields ({first.get('msg')})")
    tags = []
    for err in errors:
        where, tag = split(err.get("loc", ()))
        if where == param and tag is not None and tag not in tags:
            tags.append(tag)
    if len(tags) > 1:
        return error_body(f"{param}: the value fits none of the accepted types ({', '.join(tags)})", param=param)
    return error_body(f"{param}: {first.get('msg', 'invalid value')}", param=param)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


async def _serve(server: _Server, request: Request, req: CompletionRequest | ChatCompletionRequest,
                 sampling: _Sampling, *, chat: bool) -> Response:
    log: _RequestLog = request.scope.get("hf_accel.serve") or _RequestLog()
    release = server.acquire()
    try:
        gen = _Generation(server, sampling.prompts, sampling.n, sampling.kwargs, sampling.seed, sampling.stop)
        log.prompt_tokens = gen.prompt_tokens
        try:
            gen.start()
        except (ValueError, NotImplementedError) as exc:  # bad input, or what this model cannot serve (a led TP
            raise RequestError(str(exc)) from exc  # model and a logits processor from its generation config)
    except BaseException:
        release()
        raise
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        chunks = _stream_chunks(gen, rid, created, server.name, chat=chat, include_usage=include_usage, log=log)

        def on_close() -> None:
            gen.cancel()
            release()

        return _EventStream(chunks, on_close)
    try:
        return await _complete(gen, request, rid, created, server.name, chat=chat, log=log)
    finally:
        gen.cancel()
        release()


async def _complete(gen: _Generation, request: Request, rid: str, created: int, name: str, *, chat: bool,
                    log: _RequestLog) -> Response:
    """A non-streaming response; if the client leaves first, the generation is cancelled."""
    collect = asyncio.ensure_future(gen.collect())
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not collect.done():
            collect.cancel()
            gen.cancel()
            with contextlib.suppress(BaseException):
                await collect
    log.completion_tokens = gen.completion_tokens
    if collect.cancelled():
        return Response(status_code=499)  # nobody reads it: this only shows in the log line
    try:
        texts = collect.result()
    except ValueError as exc:  # the engine refused the request after all (e.g. it can never fit in the KV cache)
        raise RequestError(str(exc)) from exc
    if chat:
        choices = [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": None,
                    "finish_reason": gen.finish_reasons[i]} for i, t in enumerate(texts)]
    else:
        choices = [{"index": i, "text": t, "logprobs": None, "finish_reason": gen.finish_reasons[i]}
                   for i, t in enumerate(texts)]
    return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                         "model": name, "choices": choices, "usage": _usage(gen), "system_fingerprint": None})


async def _stream_chunks(gen: _Generation, rid: str, created: int, name: str, *, chat: bool, include_usage: bool,
                         log: _RequestLog) -> AsyncIterator[bytes]:
    """SSE chunks: one per choice per round of `_Generation.updates`, then usage if asked, then [DONE]."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    extra = {"usage": None} if include_usage else {}

    def chunk(choice: dict[str, Any]) -> bytes:
        return _sse({"id": rid, "object": obj, "created": created, "model": name, "choices": [choice], **extra})

    try:
        if chat:
            for i in range(len(gen.choices)):
                yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})
        async for round_ in gen.updates():
            for i, text, finish in round_:
                if chat:
                    yield chunk({"index": i, "delta": {"content": text} if text else {}, "logprobs": None,
                                 "finish_reason": finish})
                else:
                    yield chunk({"index": i, "text": text, "logprobs": None, "finish_reason": finish})
            log.completion_tokens = gen.completion_tokens
        if include_usage:
            yield _sse({"id": rid, "object": obj, "created": created, "model": name, "choices": [],
                        "usage": _usage(gen)})
    except Exception as exc:  # headers are out: the error can only be reported in the stream
        logger.error("generation failed mid-stream", exc_info=exc)
        status = "invalid_request_error" if isinstance(exc, ValueError) else "server_error"
        yield _sse(error_body(f"{type(exc).__name__}: {exc}", type=status))
    finally:
        log.completion_tokens = gen.completion_tokens
        gen.cancel()
    yield b"data: [DONE]\n\n"
