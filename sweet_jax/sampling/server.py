"""An OpenAI-compatible HTTP server over the sampler, batching concurrent requests.

    python -m sweet_jax.serve --model HF_DIR_OR_WORKDIR --port 8000 [--host 127.0.0.1] [--tokenizer DIR]

--model is a Hugging Face checkpoint directory (config.json + safetensors), or a training workdir of
`python -m sweet_jax.train` (its latest readable checkpoint, restored with sweet_jax.train.model_loading.restore_model).

Endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions (with logprobs). Request fields:
temperature, top_p, max_tokens (chat also max_completion_tokens), n, stop, seed, logprobs (chat: bool;
completions: int); top_k, stop_token_ids as extensions; stream (server-sent events: the role, then one delta per
token, then each choice's finish_reason, then with stream_options.include_usage a last chunk holding the usage, then
`data: [DONE]`). A reply is generated whole in its compiled batch, then streamed: the first delta comes when the
reply is complete. Echo and top-N alternatives (top_logprobs) are not served: a request asking for them gets a 400
with the reason.

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
sent and read while the later batches run). Two engine lanes: requests of more than
`long_request_rows` sample rows x new tokens run in their own lane, so a long request does not hold short ones
for its whole length. A batch that fails is re-run request by request: only the failing request gets the error.

In-process (tests, notebooks):

    server = start_server(sampler, port=0)       # background thread, any free port
    client = openai.OpenAI(base_url=server.url, api_key="none")
    server.close()

Only the standard library is used (http.server: a thread per connection, a listen backlog of 1024, read and
idle timeouts, a body size limit, JSON errors everywhere); nothing else needs installing.
"""
from __future__ import annotations

import concurrent.futures
import http
import http.server
import json
import logging
import os
import queue
import socket
import threading
import time
import uuid

from sweet_jax.errors import SweetJaxError
from sweet_jax.sampling import generate
from sweet_jax.sampling.generate import GenerateError, Request, Sample, Sampler, SamplingParams, bucket_length
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

class BatchingEngine:
    """Collects concurrent requests for a short window (extended while they keep arriving) and runs them as one
    generate call.

    Two lanes, each its own thread and queue: requests costing more than `long_request_rows` sample rows x
    new tokens (n=64 with 480 tokens, say) run in the long lane, everything else in the short lane, so a long
    request never holds short ones for its whole length (the lanes share the device; measured in
    bench/bench_serve.py). A batch that fails is re-run one request at a time, so only the request that
    fails gets the error."""

    def __init__(self, sampler: Sampler, *, max_batch_size: int = 64, batch_window_s: float = 0.01,
                 long_request_rows: int = 4096, max_call_rows: int | None = None, max_wait_s: float = 0.25):
        self.sampler = sampler
        self.max_batch_size = max_batch_size
        self.max_call_rows = max_call_rows or 8 * max_batch_size
        self.batch_window_s = batch_window_s
        self.max_wait_s = max(max_wait_s, batch_window_s)
        self.long_request_rows = long_request_rows
        self.batch_sizes: list[int] = []  # requests per batched generate call (observability, tests)
        self._closed = threading.Event()
        self._lanes = {name: queue.Queue() for name in ("short", "long")}
        self._threads = [threading.Thread(target=self._run, args=(q,), name=f"sweet_jax-batching-{name}",
                                          daemon=True) for name, q in self._lanes.items()]
        for t in self._threads:
            t.start()

    def lane(self, request: Request) -> str:
        cost = request.params.n * request.params.max_new_tokens
        return "long" if cost > self.long_request_rows else "short"

    def submit(self, request: Request) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._lanes[self.lane(request)].put((request, future))
        return future

    def close(self) -> None:
        self._closed.set()
        for q in self._lanes.values():
            q.put(None)
        for t in self._threads:
            t.join(timeout=10)

    def _run(self, lane: queue.Queue) -> None:
        while not self._closed.is_set():
            item = lane.get()
            if item is None:
                break
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
            self.batch_sizes.append(len(batch))
            self._generate(batch)

    def _generate(self, batch: list) -> None:
        def answer(indices, samples):  # each compiled batch's requests are answered while the next one runs
            for i, s in zip(indices, samples):
                batch[i][1].set_result(s)

        try:
            results = self.sampler.generate_requests([r for r, _ in batch], on_batch=answer)
        except Exception as e:
            pending = [item for item in batch if not item[1].done()]
            if len(pending) > 1:  # find the request that fails; the others get their samples
                for item in pending:
                    self._generate([item])
                return
            log.exception("generate failed")
            for _, future in pending:
                future.set_exception(e)
            return
        for (_, future), samples in zip(batch, results):
            if not future.done():
                future.set_result(samples)


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
        value = float(value)
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


def text_deltas(text: str, pieces: list[str]) -> list[tuple[str, int]]:
    """A reply's text cut into stream deltas, one per token: (delta, index of its token). Token texts that do not
    add up to the reply (a stop string cut it, a token that decodes only with its neighbours) end the per-token
    cut; what remains of the text is the last delta (index -1). The deltas always join to `text`."""
    out, done = [], ""
    for i, piece in enumerate(pieces):
        if not piece or not text.startswith(done + piece):
            break
        done += piece
        out.append((piece, i))
    if done != text:
        out.append((text[len(done):], -1))
    return out


class Stream:
    """A response sent as server-sent events: each chunk a `data: {json}` event, then `data: [DONE]`."""

    def __init__(self, chunks: list[dict]):
        self.chunks = chunks

    def events(self):
        for chunk in self.chunks:
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        yield b"data: [DONE]\n\n"


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


class OpenAIApp:
    """Request handling independent of HTTP: body dict in, (status, response dict) out."""

    def __init__(self, sampler: Sampler, *, model_name: str, max_batch_size: int = 64,
                 batch_window_s: float = 0.01, default_max_tokens: int = 256, request_timeout_s: float = 600,
                 long_request_rows: int = 4096, max_call_rows: int | None = None, max_wait_s: float = 0.25):
        if sampler.tokenizer is None:
            raise GenerateError("the server needs a tokenizer: load one with --tokenizer DIR")
        self.sampler = sampler
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.request_timeout_s = request_timeout_s
        self.engine = BatchingEngine(sampler, max_batch_size=max_batch_size, batch_window_s=batch_window_s,
                                     long_request_rows=long_request_rows, max_call_rows=max_call_rows,
                                     max_wait_s=max_wait_s)
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

    def _run(self, prompts_ids: list[list[int]], params: SamplingParams) -> list[list[Sample]]:
        """Queue every prompt (so they share a batch), then wait for all of them."""
        requests = [Request(ids, params) for ids in prompts_ids]
        for r in requests:
            try:
                self.sampler.check_request(r)
            except GenerateError as e:
                message = str(e)
                param = ("max_tokens" if "max_new_tokens" in message else "prompt" if "prompt" in message
                         else "stop" if "stop" in message else None)
                raise BadRequest(message, param) from e
        futures = [self.engine.submit(r) for r in requests]
        return [f.result(timeout=self.request_timeout_s) for f in futures]

    def chat_completions(self, body: dict) -> dict:
        _check_fields(body, _CHAT_FIELDS)
        self.check_model(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and _message_text(m.get("content")) is not None
                for m in messages):
            raise BadRequest("'messages' must be a non-empty list of {'role': str, 'content': str or a list of "
                             "{'type': 'text', 'text': str} parts}", "messages")
        if body.get("top_logprobs"):
            raise BadRequest("top_logprobs is not supported; logprobs=true returns each sampled token's "
                             "log-prob", "top_logprobs")
        want_logprobs = _field(body, "logprobs", bool, False)
        params = self._params(body, self.default_max_tokens)
        try:
            prompt_ids = self.sampler.chat_prompt_ids([{"role": m["role"], "content": _message_text(m["content"])}
                                                       for m in messages])
        except Exception as e:  # template errors (e.g. roles that do not alternate) are the client's
            raise BadRequest(f"could not render 'messages' with the chat template: {e}", "messages") from e
        samples = self._run([prompt_ids], params)[0]
        choices = []
        for i, s in enumerate(samples):
            choice = {"index": i, "message": {"role": "assistant", "content": s.text},
                      "finish_reason": s.finish_reason, "logprobs": None}
            if want_logprobs:
                choice["logprobs"] = {"content": [
                    {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8")), "top_logprobs": []}
                    for tok, lp in zip(self.sampler.token_texts(s.token_ids), s.logprobs)]}
            choices.append(choice)
        response = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                    "model": self.model_name, "choices": choices, "usage": _usage(len(prompt_ids), samples)}
        return self._chat_stream(response, samples, want_logprobs, _include_usage(body)) if body.get("stream") \
            else response

    def _chat_stream(self, response: dict, samples: list[Sample], want_logprobs: bool, usage: bool) -> Stream:
        """The chat response as chat.completion.chunk events: per choice its role, its token deltas (with their
        log-probs when asked), its finish_reason; then the usage (include_usage)."""
        head = {"id": response["id"], "object": "chat.completion.chunk", "created": response["created"],
                "model": self.model_name}
        if usage:
            head["usage"] = None

        def chunk(index, delta, finish_reason=None, logprobs=None):
            return {**head, "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason,
                                         "logprobs": logprobs}]}
        chunks = []
        for i, s in enumerate(samples):
            pieces = self.sampler.token_texts(s.token_ids)
            chunks.append(chunk(i, {"role": "assistant", "content": ""}))
            for delta, t in text_deltas(s.text, pieces):
                logprobs = None
                if want_logprobs and t >= 0:
                    logprobs = {"content": [{"token": pieces[t], "logprob": s.logprobs[t],
                                             "bytes": list(pieces[t].encode("utf-8")), "top_logprobs": []}]}
                chunks.append(chunk(i, {"content": delta}, logprobs=logprobs))
            chunks.append(chunk(i, {}, s.finish_reason))
        if usage:
            chunks.append({**head, "choices": [], "usage": response["usage"]})
        return Stream(chunks)

    def completions(self, body: dict) -> dict:
        _check_fields(body, _COMPLETION_FIELDS)
        self.check_model(body)
        prompts = body.get("prompt")
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and
                                        all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        if not isinstance(prompts, list) or not prompts or not all(
                isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) for t in p))
                for p in prompts):
            raise BadRequest("'prompt' must be a string, a list of strings, or token ids", "prompt")
        if body.get("echo"):
            raise BadRequest("echo is not supported; send echo=false", "echo")
        if body.get("suffix"):
            raise BadRequest("suffix is not supported", "suffix")
        logprobs = _field(body, "logprobs", int, None, check=lambda v: 0 <= v <= 5, why="must be in [0, 5]")
        as_ids = _field(body, "return_tokens_as_token_ids", bool, False)
        return_ids = _field(body, "return_token_ids", bool, False)
        params = self._params(body, 16)  # OpenAI's default for completions
        try:
            prompt_ids = [self.sampler.encode(p) for p in prompts]
        except GenerateError as e:
            raise BadRequest(str(e), "prompt") from e
        choices, all_samples = [], []
        for ids, samples in zip(prompt_ids, self._run(prompt_ids, params)):
            for s in samples:
                choice = {"index": len(choices), "text": s.text, "finish_reason": s.finish_reason, "logprobs": None}
                if logprobs is not None:
                    texts = self.sampler.token_texts(s.token_ids)
                    offsets, pos = [], 0
                    for t in texts:
                        offsets.append(pos)
                        pos += len(t)
                    tokens = [f"token_id:{i}" for i in s.token_ids] if as_ids else texts
                    choice["logprobs"] = {"tokens": tokens, "token_logprobs": s.logprobs,
                                          "top_logprobs": None, "text_offset": offsets}
                if return_ids:
                    choice.update(prompt_token_ids=list(ids), token_ids=[int(i) for i in s.token_ids])
                choices.append(choice)
                all_samples.append(s)
        response = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                    "model": self.model_name, "choices": choices,
                    "usage": _usage(sum(len(p) for p in prompt_ids), all_samples)}
        if not body.get("stream"):
            return response
        return self._completion_stream(response, all_samples, logprobs is not None, as_ids, _include_usage(body))

    def _completion_stream(self, response: dict, samples: list[Sample], logprobs: bool, as_ids: bool,
                           usage: bool) -> Stream:
        """The completions response as text_completion events: per choice its token deltas (with their log-probs
        when asked), its finish_reason; then the usage (include_usage)."""
        head = {"id": response["id"], "object": "text_completion", "created": response["created"],
                "model": self.model_name}
        if usage:
            head["usage"] = None
        chunks = []
        for i, s in enumerate(samples):
            pieces = self.sampler.token_texts(s.token_ids)
            offset = 0
            for delta, t in text_deltas(s.text, pieces):
                lp = None
                if logprobs and t >= 0:
                    lp = {"tokens": [f"token_id:{s.token_ids[t]}" if as_ids else pieces[t]],
                          "token_logprobs": [s.logprobs[t]], "top_logprobs": None, "text_offset": [offset]}
                offset += len(delta)
                chunks.append({**head, "choices": [{"index": i, "text": delta, "finish_reason": None,
                                                    "logprobs": lp}]})
            chunks.append({**head, "choices": [{"index": i, "text": "", "finish_reason": s.finish_reason,
                                                "logprobs": None}]})
        if usage:
            chunks.append({**head, "choices": [], "usage": response["usage"]})
        return Stream(chunks)

    def warmup(self, *, max_prompt: int = 1024, max_tokens: int | None = None) -> int:
        """Compile the one-row programs of every prompt-length bucket up to max_prompt (with max_tokens new
        tokens, default the server's), so that the first requests of those shapes do not wait for a compile.
        Returns the number of shapes run. More rows (concurrent requests, n > 1) are other shapes."""
        lengths, n = [], 1
        while bucket_length(n) <= max_prompt:
            lengths.append(bucket_length(n))
            n = bucket_length(n) + 1
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
        """Server-sent events in HTTP/1.1 chunked transfer encoding: the connection stays reusable."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for event in stream.events():
            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

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
        except json.JSONDecodeError as e:
            raise BadRequest(f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        return body

    def _handle(self, method: str) -> None:
        try:
            handler = self._route(method)
            if method == "POST":
                body = self._read_body()
                answer = handler(body)
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
        except (BrokenPipeError, ConnectionResetError):
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


class _HTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # listen backlog: a burst of clients waits to be accepted instead of being reset


class OpenAIServer:
    """A running server: `.url` (ends in /v1), `.port`, `.close()`. Use as a context manager.

    read_timeout_s: a request must arrive whole within it, and an idle keep-alive connection is closed after it.
    max_body_bytes: larger request bodies are refused with 413 before they are read."""

    def __init__(self, app: OpenAIApp, host: str = "127.0.0.1", port: int = 0, *, read_timeout_s: float = 30.0,
                 max_body_bytes: int = MAX_BODY_BYTES):
        handler = type("Handler", (_Handler,), {"app": app, "timeout": read_timeout_s,
                                                "max_body_bytes": max_body_bytes})
        self.app = app
        self.httpd = _HTTPServer((host, port), handler)
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
                 read_timeout_s: float = 30.0, max_body_bytes: int = MAX_BODY_BYTES) -> OpenAIServer:
    """Serve `sampler` on a background thread; port 0 picks a free port (see `.url`)."""
    app = OpenAIApp(sampler, model_name=model_name, max_batch_size=max_batch_size, batch_window_s=batch_window_s,
                    long_request_rows=long_request_rows)
    return OpenAIServer(app, host, port, read_timeout_s=read_timeout_s, max_body_bytes=max_body_bytes).start()


# ----------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------

def load_model_sampler(model: str, *, tokenizer: str | None = None, dtype: str | None = None,
                       mesh_shape: tuple[int, int, int] | None = None, max_batch_size: int = 64) -> Sampler:
    """A Sampler for a Hugging Face checkpoint directory or a training workdir (its latest checkpoint)."""
    if not model or not os.path.isdir(model):
        raise SweetJaxError(f"--model {model!r}: no such directory; pass a Hugging Face checkpoint directory "
                            "(config.json + *.safetensors) or a training workdir")
    mesh = model_loading.make_mesh(mesh_shape, field="--mesh") if mesh_shape is not None else None
    # Plain completions need no chat template; /v1/chat/completions says so when the tokenizer has none.
    return generate.load_sampler(model, tokenizer, dtype=dtype, mesh=mesh, max_batch_size=max_batch_size,
                               chat_template=False)


