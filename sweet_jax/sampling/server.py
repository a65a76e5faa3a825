"""An OpenAI-compatible HTTP server over the sampler, batching concurrent requests.

    python -m sweet_jax.serve --model HF_DIR_OR_WORKDIR --port 8000 [--host 127.0.0.1] [--tokenizer DIR]

--model is a Hugging Face checkpoint directory (config.json + safetensors), or a training workdir of
`python -m sweet_jax.train` (its latest readable checkpoint, restored with sweet_jax.train.model_loading.restore_model).

Endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions (with logprobs). Request fields:
temperature, top_p, max_tokens (chat also max_completion_tokens), n, stop, seed, logprobs (chat: bool, with
top_logprobs <= 20; completions: int <= 5, the top N and the sampled token per token, as OpenAI); top_k,
stop_token_ids as extensions; stream (server-sent events: the role, then the text deltas, then each choice's
finish_reason, then with stream_options.include_usage a last chunk holding the usage, then `data: [DONE]`). A stream
is sent as the decode loop runs: the loop stops after 1, 2, 4, ... then every `chunk_steps` steps to hand the new
tokens over (the same tokens and log-probs as one loop), each choice's new tokens go out as one delta (with their
log-probs when asked), and each event is built when it is sent. Text a later
token could still change (a character split over tokens, a stop string's start) waits for it. Echo is not served
(a 400 with the reason).

Compilation: each new shape (prompt-length bucket x new-token bucket x rows) compiles once, on the first request
that needs it (seconds on a CPU, longer for an 8B model); `--warmup` compiles the single-row shapes of every
prompt bucket up to --warmup_max_prompt before the server answers, and JAX's persistent compilation cache
(sweet_jax.cli) makes a restart's compiles loads.

Token ids in and out, as vLLM serves them (what sweet_jax.sampling.policy_backend's `openai` backend sends): a completions
`prompt` may be token ids (a list of ints, or a list of such lists); `return_tokens_as_token_ids: true` writes each
`logprobs.tokens` entry as "token_id:N" (vLLM's --return-tokens-as-token-ids, per request), `return_token_ids: true`
adds `prompt_token_ids` and `token_ids` to each choice (vLLM >= 0.10.2). The sampled ids include the stop token that
ended a reply, with its log-prob, as vLLM's do.

Batching: each HTTP request is handled on its own thread, validated (a 400 naming the field; 404 for a model
this server does not serve), and queued; an engine thread takes the first queued request, waits
`batch_window_s` for more, and again after each arrival (a client's burst: up to `max_wait_s` in all and
`max_call_rows` sample rows, 8 x `max_batch_size` by default), runs one `Sampler.generate_requests` over all of
them (it sorts them by prompt length into compiled batches of `max_batch_size` rows, as an in-process call
does), and answers each request as soon as its compiled batch finishes (the first requests' answers are
sent and read while the later batches run). Requests that arrive while a call decodes make their own call at once
(up to `max_running_calls`, whose chunked decode loops take turns on the device) rather than wait for it to end.
Two engine lanes: requests of more than `long_request_rows` sample rows x new tokens are collected in their own
lane. A batch that fails is re-run request by request: only the failing request gets the error. A client that
closes its connection cancels its requests: their rows stop at the decode loop's next chunk.

Bounds (docs/sandbox.md): the work of one request (MAX_REQUEST_SAMPLES, MAX_REQUEST_NEW_TOKENS,
MAX_REQUEST_PROMPT_TOKENS: a 400 naming the limit), the body (MAX_BODY_BYTES: 413), one deadline on the request
head (read_timeout_s: 408), the open connections (MAX_CONNECTIONS: 503).

In-process (tests, notebooks):

    server = start_server(sampler, port=0)       # background thread, any free port
    client = openai.OpenAI(base_url=server.url, api_key="none")
    server.close()

Only the standard library is used (http.server: a thread per connection up to max_connections, a listen backlog
of 1024, head, body and idle deadlines, a body size limit, JSON errors everywhere); nothing else needs installing.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import http
import http.server
import json
import logging
import os
import queue
import select
import socket
import threading
import time
import uuid
from typing import Callable, Iterator

from sweet_jax.data.batching import bucket_prompt
from sweet_jax.errors import SweetJaxError
from sweet_jax.sampling import generate
from sweet_jax.sampling.generate import MAX_TOP_LOGPROBS, GenerateError, Request, Sample, Sampler, SamplingParams
from sweet_jax.train import model_loading

log = logging.getLogger(__name__)


class BadRequest(SweetJaxError):
    """A request the server refuses (HTTP 400); `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status


# ----------------------------------------------------------------------------------------------------------
# Batching engine
# ----------------------------------------------------------------------------------------------------------

def _settle(future: concurrent.futures.Future, result=None, error: BaseException | None = None) -> None:
    """Give a future its answer unless it has one already (a request its client cancelled)."""
    try:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)
    except concurrent.futures.InvalidStateError:  # cancelled between the check and the answer
        pass


class BatchingEngine:
    """Collects concurrent requests for a short window (extended while they keep arriving) and runs them as one
    generate call.

    Two lanes, each its own thread and queue: requests costing more than `long_request_rows` sample rows x
    new tokens (n=64 with 480 tokens, say) go to the long lane, everything else to the short lane. A lane hands
    each call it collects to one of `max_running_calls` runners and goes back to collecting: requests that come
    while a call decodes start their own call at once (the calls share the device) instead of waiting for the
    running one to end; when every runner is busy, the requests that come meanwhile wait and share the next
    call. The decode loop stops every chunk to hand each request's tokens so far to its `on_progress` (a
    stream's events) and to drop the rows of a request whose future was cancelled (its client left). A call that
    fails is re-run one request at a time, so only the request that fails gets the error."""

    def __init__(self, sampler: Sampler, *, max_batch_size: int = 64, batch_window_s: float = 0.01,
                 long_request_rows: int = 4096, max_call_rows: int | None = None, max_wait_s: float = 0.25,
                 max_running_calls: int = 4, chunk_steps: int = 32):
        self.sampler = sampler
        self.max_batch_size = max_batch_size
        self.max_call_rows = max_call_rows or 8 * max_batch_size
        self.batch_window_s = batch_window_s
        self.max_wait_s = max(max_wait_s, batch_window_s)
        self.long_request_rows = long_request_rows
        self.chunk_steps = chunk_steps
        self.batch_sizes: list[int] = []  # requests per batched generate call (observability, tests)
        self._closed = threading.Event()
        # Each running call holds its KV cache: the runners bound how many are in memory at once.
        self._runner_slots = threading.Semaphore(max_running_calls)
        self._runners = concurrent.futures.ThreadPoolExecutor(max_running_calls, "sweet_jax-generate")
        self._lanes = {name: queue.Queue() for name in ("short", "long")}
        self._threads = [threading.Thread(target=self._run, args=(q,), name=f"sweet_jax-batching-{name}",
                                          daemon=True) for name, q in self._lanes.items()]
        for t in self._threads:
            t.start()

    def lane(self, request: Request) -> str:
        cost = request.params.n * request.params.max_new_tokens
        return "long" if cost > self.long_request_rows else "short"

    def submit(self, request: Request, on_progress: Callable[[list[Sample]], None] | None = None
               ) -> concurrent.futures.Future:
        """Queue a request: its future gets its samples; on_progress(samples so far) is called at every chunk of
        the decode loop. Cancelling the future (future.cancel()) stops its work at the next chunk."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._lanes[self.lane(request)].put((request, future, on_progress))
        return future

    def close(self) -> None:
        self._closed.set()
        for q in self._lanes.values():
            q.put(None)
        for t in self._threads:
            t.join(timeout=10)
        self._runners.shutdown(wait=False, cancel_futures=True)

    def _run(self, lane: queue.Queue) -> None:
        while not self._closed.is_set():
            item = lane.get()
            if item is None:
                break
            # A free runner first: requests that come while every runner is busy all join the next call.
            self._runner_slots.acquire()
            batch, rows = [item], item[0].params.n
            first = time.monotonic()
            deadline = first + self.batch_window_s
            while rows < self.max_call_rows:
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    break
                try:
                    nxt = lane.get(timeout=timeout)
                except queue.Empty:
                    break
                if nxt is None:
                    self._closed.set()
                    break
                batch.append(nxt)
                rows += nxt[0].params.n
                # While requests keep coming (a client's burst), wait a window past the latest one, at most
                # max_wait_s in all: the whole burst then goes to the sampler in one call, which sorts it by
                # prompt length into batches of max_batch_size rows as an in-process call would.
                deadline = min(time.monotonic() + self.batch_window_s, first + self.max_wait_s)
            batch = [item for item in batch if not item[1].cancelled()]
            if not batch:
                self._runner_slots.release()
                continue
            self.batch_sizes.append(len(batch))
            try:
                self._runners.submit(self._generate_then_free, batch)
            except RuntimeError:  # closed
                self._runner_slots.release()
                break

    def _generate_then_free(self, batch: list) -> None:
        try:
            self._generate(batch)
        finally:
            self._runner_slots.release()

    def _generate(self, batch: list) -> None:
        def answer(indices, samples):  # each compiled batch's requests are answered while the next one runs
            for i, s in zip(indices, samples):
                _settle(batch[i][1], s)

        def progress(indices, partial):
            for i, samples in zip(indices, partial):
                _, future, on_progress = batch[i]
                if on_progress is not None and not future.done():
                    on_progress(samples)

        try:
            streamed = any(item[2] is not None for item in batch)  # else the loop stops only to look for cancels
            results = self.sampler.generate_requests(
                [item[0] for item in batch], on_batch=answer, on_chunk=progress if streamed else None,
                chunk_steps=self.chunk_steps, cancelled=lambda i: batch[i][1].cancelled())
        except Exception as e:
            pending = [item for item in batch if not item[1].done()]
            if len(pending) > 1:  # find the request that fails; the others get their samples
                for item in pending:
                    self._generate([item])
                return
            log.exception("generate failed")
            for item in pending:
                _settle(item[1], error=e)
            return
        for item, samples in zip(batch, results):
            _settle(item[1], samples)


# ----------------------------------------------------------------------------------------------------------
# OpenAI request parsing and response building
# ----------------------------------------------------------------------------------------------------------

def _field(body: dict, name: str, kind, default, *, check=None, why: str = ""):
    value = body.get(name, default)
    if value is None:
        value = default
    if value is None:
        return None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:  # an integer past a double's range
            raise BadRequest(f"'{name}' must be a number a double can hold, got {_short(value)}", name) from None
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise BadRequest(f"'{name}' must be {_KIND_NAMES.get(kind, kind.__name__)}, got {_short(value)}", name)
    if check is not None and not check(value):
        raise BadRequest(f"'{name}' {why}, got {_short(value)}", name)
    return value


_KIND_NAMES = {int: "an integer", float: "a number", bool: "a boolean", str: "a string"}
MAX_STOP_STRINGS = 4  # as OpenAI
MAX_STOP_CHARS = 256


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# Fields each endpoint reads; anything else is refused (as OpenAI refuses an unrecognized argument), so a
# misspelt or unsupported option is an error, not silently ignored.
_COMMON_FIELDS = {"model", "temperature", "top_p", "top_k", "n", "max_tokens", "stop", "seed", "stream",
                  "stream_options", "logprobs", "user", "presence_penalty", "frequency_penalty", "logit_bias"}
_CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo", "suffix", "stop_token_ids", "return_tokens_as_token_ids",
                                      "return_token_ids"}


def _check_fields(body: dict, allowed: set) -> None:
    for name in body:
        if name not in allowed:
            raise BadRequest(f"unrecognized request argument supplied: {_short(name)}", str(name)[:100])
    _field(body, "user", str, None)
    for name in ("stream", "echo"):
        _field(body, name, bool, None)
    for name in ("presence_penalty", "frequency_penalty"):
        _field(body, name, float, 0.0, check=lambda v: v == 0, why="is not supported (only 0)")
    if body.get("logit_bias"):
        raise BadRequest("'logit_bias' is not supported", "logit_bias")
    options = body.get("stream_options")
    if options is not None:
        if not body.get("stream"):
            raise BadRequest("'stream_options' is only allowed with stream=true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"} or not isinstance(
                options.get("include_usage", False), bool):
            raise BadRequest(f"'stream_options' must be {{'include_usage': bool}}, got {_short(options)}",
                             "stream_options")


def _include_usage(body: dict) -> bool:
    return bool((body.get("stream_options") or {}).get("include_usage"))


class StreamedChoice:
    """What one streamed choice has sent: its text, and the tokens whose log-probs went out with it. Each stop of
    the decode loop gives one delta per choice with all its new tokens (an event per token costs the host more
    than the decode loop at 64 streams).

    Only text that cannot change goes out before the reply ends: not the stop token's, not a character still
    incomplete (a byte-level token ends inside it), nothing from a stop string on, nor the last characters that
    could begin one (len(longest stop string) - 1). The reply's final sample brings the rest: the deltas of a
    choice always join to its non-streamed text."""

    def __init__(self, stop: tuple[str, ...] = ()):
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text, self.tokens, self.ended = "", 0, False
        self.offsets: list[int] = []   # each sent token's text_offset (its own text's start, as non-streamed)
        self._piece_end = 0

    def advance(self, sampler: Sampler, sample: Sample, final: bool) -> list[tuple[str, list[int]]]:
        """The new delta of `sample` (this choice's samples so far, or its final one): [(text, token positions)],
        or [] when nothing new can go out."""
        if self.ended:
            return []
        ids = sample.token_ids
        if final:
            self.ended = True
            end, text = len(ids), sample.text or ""
        elif sample.finish_reason is not None:  # done: its text (stop token left out, stop string cut) comes final
            return []
        else:
            end, text = self._settled(sampler, ids)
        if end <= self.tokens and text == self.text:
            return []
        if text.startswith(self.text):
            delta = text[len(self.text):]
            self.text = text
        else:  # a tokenizer whose decoded prefixes are not prefixes of the whole: what went out stays
            log.warning("stream: the reply's text does not continue what was sent; the rest is not sent")
            delta = ""
        for piece in sampler.token_texts(ids[self.tokens:end]):
            self.offsets.append(self._piece_end)
            self._piece_end += len(piece)
        out = [(delta, list(range(self.tokens, end)))]
        self.tokens = end
        return out

    def _settled(self, sampler: Sampler, ids: list[int]) -> tuple[int, str]:
        """(k, text of the first k tokens) for the most tokens whose text cannot change any more."""
        whole = sampler.decode(ids) or ""
        limit = len(whole)
        if self.stop:  # the earliest stop string, or the tail where one could still begin
            limit = min([whole.find(s) for s in self.stop if s in whole] + [max(0, len(whole) - self.hold)])

        def text_of(k: int) -> str:
            return sampler.decode(ids[:k]) or ""

        def within(text: str) -> bool:  # an incomplete last character counts as its bytes' start
            text = text.rstrip("\ufffd")
            return len(text) <= limit and whole.startswith(text)

        lo, hi = self.tokens, len(ids)
        if hi > lo and within(whole) and not whole.endswith("\ufffd"):  # the usual case
            return hi, whole
        while lo < hi:   # a prefix's text grows with it: the longest prefix within the limit by bisection
            mid = (lo + hi + 1) // 2
            if within(text_of(mid)):
                lo = mid
            else:
                hi = mid - 1
        while lo > self.tokens and text_of(lo).endswith("\ufffd"):  # back to a whole character
            lo -= 1
        return lo, text_of(lo) if lo > self.tokens else self.text


class Stream:
    """A response sent as server-sent events, each built when its tokens come: `data: {json}` events, then
    `data: [DONE]`. `chunks` yields the events' JSON objects, or None while it waits (then a client that has
    left, `client_gone()`, ends the stream); `cancel` stops the work of the stream's requests."""

    def __init__(self, chunks, cancel: Callable[[], None] = lambda: None):
        self.chunks = chunks
        self.cancel = cancel
        self.client_gone: Callable[[], bool] = lambda: False

    def events(self) -> Iterator[bytes]:
        try:
            for chunk in self.chunks:
                if chunk is None:
                    if self.client_gone():
                        self.cancel()
                        return
                    continue
                yield f"data: {json.dumps(chunk)}\n\n".encode()
        except concurrent.futures.TimeoutError:
            self.cancel()
            yield _error_event("generation did not finish within the request's deadline", "timeout")
        except Exception as e:  # noqa: BLE001 — the 200 is sent: the error goes out as an event
            log.exception("stream failed")
            self.cancel()
            yield _error_event(f"{type(e).__name__}: {e}", "server_error")
        yield b"data: [DONE]\n\n"


def _error_event(message: str, kind: str) -> bytes:
    error = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return f"data: {json.dumps(error)}\n\n".encode()


def sampling_params(body: dict, *, default_max_tokens: int, vocab_size: int | None = None,
                    max_positions: int | None = None) -> SamplingParams:
    """SamplingParams from an OpenAI request body (both endpoints); every field checked, errors name it."""
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    limit = max_positions or 2**31 - 1
    max_tokens = _field(body, name, int, default_max_tokens, check=lambda v: 1 <= v <= limit,
                        why=f"must be in [1, {limit}] (the model's max_position_embeddings)")
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(x, str) for x in stop):
        stop = tuple(stop)
    else:
        raise BadRequest(f"'stop' must be a non-empty string or a list of them, got {_short(stop)}", "stop")
    if len(stop) > MAX_STOP_STRINGS or not all(0 < len(x) <= MAX_STOP_CHARS for x in stop):
        raise BadRequest(f"'stop' must be at most {MAX_STOP_STRINGS} strings of 1 to {MAX_STOP_CHARS} "
                         "characters", "stop")
    top_k_max = vocab_size or 2**31 - 1
    stop_token_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_token_ids, list) or len(stop_token_ids) > 64 or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < top_k_max for i in stop_token_ids):
        raise BadRequest(f"'stop_token_ids' must be a list of at most 64 token ids in [0, {top_k_max}), got "
                         f"{_short(stop_token_ids)}", "stop_token_ids")
    return SamplingParams(
        stop_token_ids=tuple(stop_token_ids),
        max_new_tokens=max_tokens,
        temperature=_field(body, "temperature", float, 1.0, check=lambda v: 0 <= v <= 2, why="must be in [0, 2]"),
        top_p=_field(body, "top_p", float, 1.0, check=lambda v: 0 < v <= 1, why="must be in (0, 1]"),
        top_k=_field(body, "top_k", int, 0, check=lambda v: 0 <= v <= top_k_max,
                     why=f"must be in [0, {top_k_max}] (0 = off; at most the vocabulary size)"),
        n=_field(body, "n", int, 1, check=lambda v: 1 <= v <= 128, why="must be in [1, 128]"),
        stop=stop,
        seed=_field(body, "seed", int, None, check=lambda v: -2**63 <= v < 2**63,
                    why="must be a 64-bit integer"),
    )


def _message_text(content) -> str | None:
    """A message's text: a string, or the concatenated text parts of OpenAI's content-part list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and
                                         isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    return None


def _usage(prompt_tokens: int, samples: list[Sample]) -> dict:
    completion = sum(len(s.token_ids) for s in samples)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


class ClientGone(Exception):
    """The client closed its connection before its answer was ready: its work was cancelled."""


CLIENT_CHECK_S = 0.1  # how often a waiting request looks whether its client is still there

# The work one request may ask for; more is refused with a 400 naming the limit (split the request).
MAX_REQUEST_SAMPLES = 1024          # prompts x n
MAX_REQUEST_NEW_TOKENS = 1 << 20    # prompts x n x max_tokens
MAX_REQUEST_PROMPT_TOKENS = 1 << 20  # the prompts' tokens in all


class OpenAIApp:
    """Request handling independent of HTTP: body dict in, response dict (or a Stream of events) out.

    The work one request may ask for is bounded: at most max_request_samples samples (prompts x n),
    max_request_new_tokens new tokens (prompts x n x max_tokens) and max_request_prompt_tokens prompt tokens."""

    def __init__(self, sampler: Sampler, *, model_name: str, max_batch_size: int = 64,
                 batch_window_s: float = 0.01, default_max_tokens: int = 256, request_timeout_s: float = 600,
                 long_request_rows: int = 4096, max_call_rows: int | None = None, max_wait_s: float = 0.25,
                 max_running_calls: int = 4, chunk_steps: int = 32,
                 max_request_samples: int = MAX_REQUEST_SAMPLES, max_request_new_tokens: int = MAX_REQUEST_NEW_TOKENS,
                 max_request_prompt_tokens: int = MAX_REQUEST_PROMPT_TOKENS):
        if sampler.tokenizer is None:
            raise GenerateError("the server needs a tokenizer: load one with --tokenizer DIR")
        self.sampler = sampler
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.request_timeout_s = request_timeout_s
        self.max_request_samples = max_request_samples
        self.max_request_new_tokens = max_request_new_tokens
        self.max_request_prompt_tokens = max_request_prompt_tokens
        self.engine = BatchingEngine(sampler, max_batch_size=max_batch_size, batch_window_s=batch_window_s,
                                     long_request_rows=long_request_rows, max_call_rows=max_call_rows,
                                     max_wait_s=max_wait_s, max_running_calls=max_running_calls,
                                     chunk_steps=chunk_steps)
        self.created = int(time.time())

    def close(self) -> None:
        self.engine.close()

    def models(self) -> dict:
        return {"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "sweet_jax"}]}

    def check_model(self, body: dict) -> None:
        """404 for a model this server does not serve (as OpenAI answers)."""
        model = _field(body, "model", str, None)
        if model is not None and model != self.model_name:
            raise BadRequest(f"The model {_short(model)} does not exist; this server serves "
                             f"{self.model_name!r} (GET /v1/models)", "model", status=404)

    def _params(self, body: dict, default_max_tokens: int) -> SamplingParams:
        config = self.sampler.config
        return sampling_params(body, default_max_tokens=default_max_tokens,
                               vocab_size=getattr(config, "vocab_size", None),
                               max_positions=getattr(config, "max_position_embeddings", None))

    def check_prompt_count(self, count: int) -> None:
        """Before any prompt is tokenized: no more prompts than samples a request may ask for."""
        if count > self.max_request_samples:
            raise BadRequest(f"'prompt' holds {count} prompts; a request may ask for at most "
                             f"{self.max_request_samples} samples (prompts x n): split it", "prompt")

    def check_work(self, prompts_ids: list[list[int]], params: SamplingParams) -> None:
        """The request's work within the server's bounds (samples, new tokens, prompt tokens), or a 400 naming
        the bound."""
        self.check_prompt_count(len(prompts_ids))
        samples = len(prompts_ids) * params.n
        if samples > self.max_request_samples:
            raise BadRequest(f"{len(prompts_ids)} prompt(s) x n={params.n} = {samples} samples; a request may ask "
                             f"for at most {self.max_request_samples} (prompts x n): split it", "n")
        new_tokens = samples * params.max_new_tokens
        if new_tokens > self.max_request_new_tokens:
            raise BadRequest(f"{samples} sample(s) x max_tokens={params.max_new_tokens} = {new_tokens} new tokens; "
                             f"a request may ask for at most {self.max_request_new_tokens} (prompts x n x "
                             "max_tokens): lower max_tokens or split it", "max_tokens")
        prompt_tokens = sum(len(p) for p in prompts_ids)
        if prompt_tokens > self.max_request_prompt_tokens:
            raise BadRequest(f"the prompts hold {prompt_tokens} tokens in all; a request may send at most "
                             f"{self.max_request_prompt_tokens}: split it", "prompt")

    def _requests(self, prompts_ids: list[list[int]], params: SamplingParams) -> list[Request]:
        self.check_work(prompts_ids, params)
        requests = [Request(ids, params) for ids in prompts_ids]
        for r in requests:
            try:
                self.sampler.check_request(r)
            except GenerateError as e:
                message = str(e)
                param = ("max_tokens" if "max_new_tokens" in message else "prompt" if "prompt" in message
                         else "stop" if "stop" in message else None)
                raise BadRequest(message, param) from e
        return requests

    def _run(self, prompts_ids: list[list[int]], params: SamplingParams,
             client_gone: Callable[[], bool] | None = None) -> list[list[Sample]]:
        """Queue every prompt (so they share a batch), then wait for all of them; a client that leaves
        meanwhile (client_gone) cancels them."""
        futures = [self.engine.submit(r) for r in self._requests(prompts_ids, params)]
        deadline = time.monotonic() + self.request_timeout_s
        try:
            for f in futures:
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise concurrent.futures.TimeoutError
                    try:
                        f.result(timeout=min(left, CLIENT_CHECK_S))
                        break
                    except concurrent.futures.TimeoutError:
                        if client_gone is not None and client_gone():
                            raise ClientGone from None
            return [f.result() for f in futures]
        finally:
            for f in futures:  # a timeout or a departed client: the work nobody waits for stops
                f.cancel()

    def _stream_updates(self, prompts_ids: list[list[int]], params: SamplingParams):
        """Queue every prompt for a stream: (updates, cancel). `updates` yields (prompt index, samples so far,
        final) as the decode loop hands them over, or None every CLIENT_CHECK_S while it waits."""
        requests = self._requests(prompts_ids, params)
        box: queue.Queue = queue.Queue()
        futures = []
        for j, r in enumerate(requests):
            future = self.engine.submit(r, on_progress=lambda samples, j=j: box.put((j, samples, False)))
            future.add_done_callback(lambda f, j=j: box.put((j, f, True)))
            futures.append(future)

        def cancel():
            for f in futures:
                f.cancel()

        def updates():
            deadline, remaining = time.monotonic() + self.request_timeout_s, len(futures)
            while remaining:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise concurrent.futures.TimeoutError
                try:
                    j, payload, final = box.get(timeout=min(left, CLIENT_CHECK_S))
                except queue.Empty:
                    yield None
                    continue
                if final:
                    remaining -= 1
                    if payload.cancelled():
                        return
                    payload = payload.result()
                yield j, payload, final
        return updates(), cancel

    def chat_completions(self, body: dict, client_gone: Callable[[], bool] | None = None) -> dict | Stream:
        _check_fields(body, _CHAT_FIELDS)
        self.check_model(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and _message_text(m.get("content")) is not None
                for m in messages):
            raise BadRequest("'messages' must be a non-empty list of {'role': str, 'content': str or a list of "
                             "{'type': 'text', 'text': str} parts}", "messages")
        want_logprobs = _field(body, "logprobs", bool, False)
        top = _field(body, "top_logprobs", int, None, check=lambda v: 0 <= v <= MAX_TOP_LOGPROBS,
                     why=f"must be in [0, {MAX_TOP_LOGPROBS}]")
        if top is not None and not want_logprobs:
            raise BadRequest("'top_logprobs' needs logprobs=true", "top_logprobs")
        params = dataclasses.replace(self._params(body, self.default_max_tokens), top_logprobs=top or 0)
        try:
            prompt_ids = self.sampler.chat_prompt_ids([{"role": m["role"], "content": _message_text(m["content"])}
                                                       for m in messages])
        except Exception as e:  # template errors (e.g. roles that do not alternate) are the client's
            raise BadRequest(f"could not render 'messages' with the chat template: {e}", "messages") from e
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.model_name}
        if body.get("stream"):
            updates, cancel = self._stream_updates([prompt_ids], params)
            return Stream(self._chat_chunks(head, updates, params, want_logprobs, _include_usage(body),
                                            len(prompt_ids)), cancel)
        samples = self._run([prompt_ids], params, client_gone)[0]
        choices = []
        for i, s in enumerate(samples):
            choice = {"index": i, "message": {"role": "assistant", "content": s.text},
                      "finish_reason": s.finish_reason, "logprobs": None}
            if want_logprobs:
                choice["logprobs"] = {"content": self._chat_logprobs(s, range(len(s.token_ids)))}
            choices.append(choice)
        return {**head, "object": "chat.completion", "choices": choices,
                "usage": _usage(len(prompt_ids), samples)}

    def _chat_logprobs(self, s: Sample, positions) -> list[dict]:
        """OpenAI's chat logprobs.content entries of the tokens at `positions` (with their top alternatives)."""
        positions = list(positions)
        texts = self.sampler.token_texts([s.token_ids[t] for t in positions])
        out = []
        for t, text in zip(positions, texts):
            alternatives = []
            if s.top_logprobs is not None:
                ids = [i for i, _ in s.top_logprobs[t]]
                alternatives = [{"token": alt, "logprob": lp, "bytes": list(alt.encode("utf-8"))}
                                for alt, (_, lp) in zip(self.sampler.token_texts(ids), s.top_logprobs[t])]
            out.append({"token": text, "logprob": s.logprobs[t], "bytes": list(text.encode("utf-8")),
                        "top_logprobs": alternatives})
        return out

    def _chat_chunks(self, head: dict, updates, params: SamplingParams, want_logprobs: bool, usage: bool,
                     prompt_tokens: int):
        """chat.completion.chunk events as the tokens come: per choice its role, its token deltas (with their
        log-probs when asked), its finish_reason; then the usage (include_usage)."""
        head = {**head, "object": "chat.completion.chunk"}
        if usage:
            head["usage"] = None

        def chunk(index, delta, finish_reason=None, logprobs=None):
            return {**head, "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason,
                                         "logprobs": logprobs}]}
        choices = [StreamedChoice(params.stop) for _ in range(params.n)]
        for i in range(params.n):
            yield chunk(i, {"role": "assistant", "content": ""})
        finals: list[Sample] = []
        for update in updates:
            if update is None:
                yield None
                continue
            _, samples, final = update
            for i, s in enumerate(samples):
                for text, positions in choices[i].advance(self.sampler, s, final):
                    if text or (want_logprobs and positions):
                        logprobs = {"content": self._chat_logprobs(s, positions)} if want_logprobs else None
                        yield chunk(i, {"content": text}, logprobs=logprobs)
                if final:
                    yield chunk(i, {}, s.finish_reason)
            if final:
                finals = samples
        if usage:
            yield {**head, "choices": [], "usage": _usage(prompt_tokens, finals)}

    def completions(self, body: dict, client_gone: Callable[[], bool] | None = None) -> dict | Stream:
        _check_fields(body, _COMPLETION_FIELDS)
        self.check_model(body)
        prompts = body.get("prompt")
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and
                                        all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        if isinstance(prompts, list):
            self.check_prompt_count(len(prompts))
        if not isinstance(prompts, list) or not prompts or not all(
                isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) for t in p))
                for p in prompts):
            raise BadRequest("'prompt' must be a string, a list of strings, or token ids", "prompt")
        if body.get("echo"):
            raise BadRequest("echo is not supported; send echo=false", "echo")
        if body.get("suffix"):
            raise BadRequest("suffix is not supported", "suffix")
        # logprobs=N: each token's log-prob and the N most likely tokens' (with the sampled one, as OpenAI).
        logprobs = _field(body, "logprobs", int, None, check=lambda v: 0 <= v <= 5, why="must be in [0, 5]")
        as_ids = _field(body, "return_tokens_as_token_ids", bool, False)
        return_ids = _field(body, "return_token_ids", bool, False)
        params = dataclasses.replace(self._params(body, 16), top_logprobs=logprobs or 0)  # 16: OpenAI's default
        try:
            prompt_ids = [self.sampler.encode(p) for p in prompts]
        except GenerateError as e:
            raise BadRequest(str(e), "prompt") from e
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name}
        if body.get("stream"):
            updates, cancel = self._stream_updates(prompt_ids, params)
            return Stream(self._completion_chunks(head, updates, params, logprobs is not None, as_ids,
                                                  _include_usage(body), prompt_ids), cancel)
        choices, all_samples = [], []
        for ids, samples in zip(prompt_ids, self._run(prompt_ids, params, client_gone)):
            for s in samples:
                choice = {"index": len(choices), "text": s.text, "finish_reason": s.finish_reason, "logprobs": None}
                if logprobs is not None:
                    offsets, pos = [], 0
                    for t in self.sampler.token_texts(s.token_ids):
                        offsets.append(pos)
                        pos += len(t)
                    choice["logprobs"] = self._completion_logprobs(s, range(len(s.token_ids)), offsets, as_ids)
                if return_ids:
                    choice.update(prompt_token_ids=list(ids), token_ids=[int(i) for i in s.token_ids])
                choices.append(choice)
                all_samples.append(s)
        return {**head, "choices": choices, "usage": _usage(sum(len(p) for p in prompt_ids), all_samples)}

    def _completion_logprobs(self, s: Sample, positions, offsets: list[int], as_ids: bool) -> dict:
        """OpenAI's completions logprobs of the tokens at `positions`: tokens, token_logprobs, top_logprobs (per
        token the most likely tokens' log-probs and the sampled token's), text_offset."""
        positions = list(positions)

        def names(ids):
            return [f"token_id:{i}" for i in ids] if as_ids else self.sampler.token_texts(ids)
        tokens = names([s.token_ids[t] for t in positions])
        top = []
        for t, token in zip(positions, tokens):
            alternatives = {}
            if s.top_logprobs is not None:
                ids = [i for i, _ in s.top_logprobs[t]]
                for name, (_, lp) in zip(names(ids), s.top_logprobs[t]):
                    alternatives.setdefault(name, lp)
            alternatives.setdefault(token, s.logprobs[t])
            top.append(alternatives)
        return {"tokens": tokens, "token_logprobs": [s.logprobs[t] for t in positions], "top_logprobs": top,
                "text_offset": [offsets[t] for t in positions]}

    def _completion_chunks(self, head: dict, updates, params: SamplingParams, logprobs: bool, as_ids: bool,
                           usage: bool, prompt_ids: list[list[int]]):
        """text_completion events as the tokens come: per choice (prompt j's i-th sample is choice j * n + i) its
        token deltas (with their log-probs when asked) and its finish_reason; then the usage (include_usage)."""
        if usage:
            head = {**head, "usage": None}
        n = params.n
        choices = [StreamedChoice(params.stop) for _ in range(len(prompt_ids) * n)]
        finals: list[Sample] = []
        for update in updates:
            if update is None:
                yield None
                continue
            j, samples, final = update
            for i, s in enumerate(samples):
                index = j * n + i
                choice = choices[index]
                for text, positions in choice.advance(self.sampler, s, final):
                    if text or (logprobs and positions):
                        lp = self._completion_logprobs(s, positions, choice.offsets, as_ids) if logprobs else None
                        yield {**head, "choices": [{"index": index, "text": text, "finish_reason": None,
                                                    "logprobs": lp}]}
                if final:
                    yield {**head, "choices": [{"index": index, "text": "", "finish_reason": s.finish_reason,
                                                "logprobs": None}]}
            if final:
                finals.extend(samples)
        if usage:
            yield {**head, "choices": [], "usage": _usage(sum(len(p) for p in prompt_ids), finals)}

    def warmup(self, *, max_prompt: int = 1024, max_tokens: int | None = None) -> int:
        """Compile the one-row programs of every prompt-length bucket up to max_prompt (with max_tokens new
        tokens, default the server's), so that the first requests of those shapes do not wait for a compile.
        Returns the number of shapes run. More rows (concurrent requests, n > 1) are other shapes."""
        lengths, n = [], 1
        while bucket_prompt(n) <= max_prompt:
            lengths.append(bucket_prompt(n))
            n = bucket_prompt(n) + 1
        params = SamplingParams(max_new_tokens=max_tokens or self.default_max_tokens, temperature=0.0, n=1)
        pad = self.sampler.encode("a", add_special_tokens=False)[:1] or [0]
        done = 0
        for length in lengths:
            request = Request(pad * length, params)
            try:
                self.sampler.check_request(request)
            except GenerateError:   # longer than the model's positions allow: no request can have this shape
                break
            self.sampler.generate_requests([request])
            done += 1
        return done


# ----------------------------------------------------------------------------------------------------------
# HTTP
# ----------------------------------------------------------------------------------------------------------

MAX_BODY_BYTES = 4 << 20  # a request body; a larger one is refused (413) before any of it is read


class _Handler(http.server.BaseHTTPRequestHandler):
    """One connection (keep-alive: several requests). Every answer, errors included, is JSON."""

    server_version = "sweet_jax"
    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes: with Nagle's algorithm the body waits for the client's delayed ACK
    # of the headers (40 ms a response on Linux).
    disable_nagle_algorithm = True
    app: OpenAIApp  # set on the subclass made by OpenAIServer
    timeout = 30.0  # socket timeout: a read that stalls this long, or an idle keep-alive, closes the connection
    max_body_bytes = MAX_BODY_BYTES

    def log_message(self, format, *args):  # route access logs to logging, not stderr
        log.debug("%s - %s", self.address_string(), format % args)

    def handle_one_request(self):
        """One request, its head (request line and headers) under one deadline, `timeout` from when the server
        starts waiting for it: a read timeout alone lets a client that sends a header line every few seconds
        hold the connection for ever. At the deadline a watchdog shuts the socket's reading side (a read blocked
        in the kernel returns) and the client gets a 408."""
        self._head_lock = threading.Lock()
        self._head_read = self._head_late = False
        watchdog = threading.Timer(self.timeout, self._head_too_slow)
        watchdog.daemon = True
        watchdog.start()
        try:
            super().handle_one_request()
        finally:
            watchdog.cancel()

    def _head_too_slow(self) -> None:
        with self._head_lock:
            if self._head_read:
                return
            self._head_late = True
        try:
            self.connection.shutdown(socket.SHUT_RD)
        except OSError:
            pass

    def parse_request(self) -> bool:
        late = self._head_late
        ok = False if late else super().parse_request()
        with self._head_lock:
            self._head_read = True
            late = self._head_late
        if not late:
            return ok
        self.close_connection = True
        if ok or not getattr(self, "command", None):  # no error sent yet
            self.command, self.request_version, self.requestline = "", "HTTP/1.1", ""
            self._error(408, f"the request's head (request line and headers) did not arrive within "
                             f"{self.timeout:g} s", kind="timeout")
        return False

    def _send(self, status: int, payload: dict, headers: dict | None = None) -> None:
        data = json.dumps(payload).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _send_stream(self, stream: Stream) -> None:
        """Server-sent events in HTTP/1.1 chunked transfer encoding, each written as it is built: the connection
        stays reusable. A client that leaves (or stops reading for the socket timeout) cancels the work."""
        stream.client_gone = self._client_gone
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for event in stream.events():
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:  # a broken pipe, a reset, a write past the timeout: nobody reads the rest
            stream.cancel()
            self.close_connection = True
        finally:
            stream.cancel()  # a no-op once every request has its answer

    def _client_gone(self) -> bool:
        """Whether the client has closed its end (readable at end of file): what it asked for may be dropped."""
        try:
            poller = select.poll()  # (select.select fails on descriptors past 1024)
            poller.register(self.connection, select.POLLIN)
            return bool(poller.poll(0)) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _error(self, status: int, message: str, param: str | None = None, kind: str | None = None,
               code: str | None = None, headers: dict | None = None):
        kind = kind or {404: "not_found_error", 413: "invalid_request_error", 500: "server_error"}.get(
            status, "invalid_request_error")
        self._send(status, {"error": {"message": message, "type": kind, "param": param, "code": code}}, headers)

    def send_error(self, code, message=None, explain=None):
        """http.server's own errors (malformed request line or headers, unsupported method): JSON too."""
        self.close_connection = True
        try:
            self._error(code, message or explain or http.HTTPStatus(code).phrase)
        except (OSError, ValueError):
            pass

    def _route(self, method: str):
        path = self.path.split("?")[0].rstrip("/")
        gets = {"/v1/models": self.app.models, "/models": self.app.models,
                "/health": lambda: {"status": "ok"}, "/v1/health": lambda: {"status": "ok"}}
        posts = {"/v1/chat/completions": self.app.chat_completions, "/chat/completions": self.app.chat_completions,
                 "/v1/completions": self.app.completions, "/completions": self.app.completions}
        routes = {"GET": gets, "POST": posts}.get(method, {})
        if path in routes:
            return routes[path]
        if path in gets or path in posts:
            allowed = "GET" if path in gets else "POST"
            raise BadRequest(f"method {method} not allowed on {path}; use {allowed}", status=405)
        raise BadRequest(f"no route {method} {_short(self.path)}; the routes are GET /v1/models, "
                         "POST /v1/chat/completions and POST /v1/completions", status=404)

    def _read_body(self) -> dict:
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            raise BadRequest("Transfer-Encoding is not supported; send a Content-Length", "Content-Length",
                             status=411)
        text = self.headers.get("Content-Length")
        if text is None:
            raise BadRequest("a request body with a Content-Length header is required", "Content-Length",
                             status=411)
        text = text.strip()
        if not text.isdigit() or not text.isascii():
            self.close_connection = True  # the body's end is unknown: the connection cannot be reused
            raise BadRequest(f"Content-Length must be a non-negative integer, got {_short(text)}",
                             "Content-Length")
        length = int(text)
        if length > self.max_body_bytes:
            self.close_connection = True  # answered without reading the body
            raise BadRequest(f"request body of {length} bytes is larger than the limit of "
                             f"{self.max_body_bytes} bytes", "Content-Length", status=413)
        deadline = time.monotonic() + self.timeout
        chunks, got = [], 0
        while got < length:
            if time.monotonic() > deadline:  # trickling bytes: each read is in time, the whole is not
                raise TimeoutError
            chunk = self.rfile.read1(length - got) if hasattr(self.rfile, "read1") else self.rfile.read(length - got)
            if not chunk:
                self.close_connection = True
                raise BadRequest(f"request body ended after {got} of the {length} bytes of Content-Length",
                                 "Content-Length")
            chunks.append(chunk)
            got += len(chunk)
        raw = b"".join(chunks)
        try:
            body = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise BadRequest(f"request body is not valid UTF-8 (byte {e.start})") from None
        except RecursionError:
            raise BadRequest("request body is nested too deeply") from None
        except ValueError as e:  # not JSON, or an integer of more digits than Python converts (4300)
            raise BadRequest(f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        return body

    def _handle(self, method: str) -> None:
        try:
            handler = self._route(method)
            if method == "POST":
                body = self._read_body()
                answer = handler(body, client_gone=self._client_gone)
                if isinstance(answer, Stream):
                    self._send_stream(answer)
                else:
                    self._send(200, answer)
            else:
                self._send(200, handler())
        except BadRequest as e:
            headers = {"Allow": "GET" if "use GET" in str(e) else "POST"} if e.status == 405 else None
            code = "model_not_found" if e.status == 404 and e.param == "model" else None
            self._error(e.status, str(e), e.param, code=code, headers=headers)
            if e.status == 413:
                self._discard_input()
        except TimeoutError:
            self.close_connection = True
            self._error(408, f"the request was not received within {self.timeout:g} s", kind="timeout")
        except concurrent.futures.TimeoutError:
            self._error(504, f"generation did not finish within {self.app.request_timeout_s} s", kind="timeout")
        except (BrokenPipeError, ConnectionResetError, ClientGone):
            self.close_connection = True
        except Exception as e:  # keep serving; the client gets the reason
            log.exception("request failed")
            self._error(500, f"{type(e).__name__}: {e}", kind="server_error")

    def _discard_input(self, limit_s: float = 2.0) -> None:
        """After an early answer (413): read and drop what the client still sends, for a moment, so that
        closing the socket does not reset the connection before the client has read the answer."""
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(0.2)
            end = time.monotonic() + limit_s
            while time.monotonic() < end and self.connection.recv(1 << 16):
                pass
        except OSError:
            pass

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")

    def _not_allowed(self):
        self._handle(self.command)

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_HEAD = do_TRACE = do_CONNECT = _not_allowed


MAX_CONNECTIONS = 512  # open connections (a thread each); one more is answered 503 and closed


class _HTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # listen backlog: a burst of clients waits to be accepted instead of being reset

    def __init__(self, address, handler, max_connections: int = MAX_CONNECTIONS):
        self.max_connections = max_connections
        self._connection_slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def get_request(self):
        try:
            return super().get_request()
        except OSError as e:
            # Out of file descriptors: the connection stays in the backlog and the listening socket readable;
            # a pause keeps the accept loop from spinning on it.
            if e.errno in (errno.EMFILE, errno.ENFILE):
                time.sleep(0.1)
            raise

    def process_request(self, request, client_address):
        if not self._connection_slots.acquire(blocking=False):
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._connection_slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._connection_slots.release()

    def _refuse(self, sock: socket.socket) -> None:
        """A connection over max_connections: a 503 (sent without waiting) and closed."""
        body = json.dumps({"error": {"message": f"the server has its {self.max_connections} connections open; "
                                                "try again", "type": "server_busy", "param": None,
                                     "code": None}}).encode()
        head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: "
                f"{len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n").encode()
        try:
            sock.setblocking(False)
            sock.send(head + body)
        except OSError:
            pass
        self.shutdown_request(sock)


class OpenAIServer:
    """A running server: `.url` (ends in /v1), `.port`, `.close()`. Use as a context manager.

    read_timeout_s: a request's head (request line and headers) must arrive within it, counted from when the
        server starts waiting for it (so an idle keep-alive connection is closed after it), and its body within
        another read_timeout_s.
    max_body_bytes: larger request bodies are refused with 413 before they are read.
    max_connections: connections open at once; one more is answered 503 and closed."""

    def __init__(self, app: OpenAIApp, host: str = "127.0.0.1", port: int = 0, *, read_timeout_s: float = 30.0,
                 max_body_bytes: int = MAX_BODY_BYTES, max_connections: int = MAX_CONNECTIONS):
        handler = type("Handler", (_Handler,), {"app": app, "timeout": read_timeout_s,
                                                "max_body_bytes": max_body_bytes})
        self.app = app
        self.httpd = _HTTPServer((host, port), handler, max_connections)
        self.host, self.port = self.httpd.server_address[:2]
        self.url = f"http://{self.host}:{self.port}/v1"
        self._thread: threading.Thread | None = None

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def start(self) -> "OpenAIServer":
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="sweet_jax-http", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.app.close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def start_server(sampler: Sampler, *, host: str = "127.0.0.1", port: int = 0, model_name: str = "sweet_jax",
                 max_batch_size: int = 64, batch_window_s: float = 0.01, long_request_rows: int = 4096,
                 read_timeout_s: float = 30.0, max_body_bytes: int = MAX_BODY_BYTES,
                 max_connections: int = MAX_CONNECTIONS, **app_options) -> OpenAIServer:
    """Serve `sampler` on a background thread; port 0 picks a free port (see `.url`). app_options: OpenAIApp's
    (chunk_steps, max_running_calls, max_request_samples, ...)."""
    app = OpenAIApp(sampler, model_name=model_name, max_batch_size=max_batch_size, batch_window_s=batch_window_s,
                    long_request_rows=long_request_rows, **app_options)
    return OpenAIServer(app, host, port, read_timeout_s=read_timeout_s, max_body_bytes=max_body_bytes,
                        max_connections=max_connections).start()


# ----------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------

def load_model_sampler(model: str, *, tokenizer: str | None = None, dtype: str | None = None,
                       mesh_shape: tuple[int, int, int] | None = None, max_batch_size: int = 64,
                       prompt_cache_mb: int = 0) -> Sampler:
    """A Sampler for a Hugging Face checkpoint directory or a training workdir (its latest checkpoint)."""
    if not model or not os.path.isdir(model):
        raise SweetJaxError(f"--model {model!r}: no such directory; pass a Hugging Face checkpoint directory "
                            "(config.json + *.safetensors) or a training workdir")
    mesh = model_loading.make_mesh(mesh_shape, field="--mesh") if mesh_shape is not None else None
    # Plain completions need no chat template; /v1/chat/completions says so when the tokenizer has none.
    return generate.load_sampler(model, tokenizer, dtype=dtype, mesh=mesh, max_batch_size=max_batch_size,
                                 chat_template=False, prompt_cache_mb=prompt_cache_mb)


