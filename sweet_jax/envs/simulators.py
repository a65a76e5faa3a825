"""Human simulators behind one interface: `reply(task, dialogue) -> str`.

- OpenAISimulator: any OpenAI-compatible chat endpoint (vLLM serving Llama-3.1-70B-Instruct as in the
  paper, or `python -m sweet_jax.serve`), temperature 0, per-request timeout, retries with exponential
  back-off, at most `concurrency` requests in flight.
- ModelSimulator: a sweet_jax Sampler in this process, greedy, all pending replies in one batch.
- ScriptedSimulator: a Python function (or the default rule: repeat the hidden information); for tests
  and synthetic tasks.

`reply_many(requests)` answers a batch of (task, dialogue) requests and never raises: a request that
failed after its retries comes back as a SimulatorError carrying the reason, so one broken episode
does not stop the others.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Any, Callable, Sequence

import httpx2
import openai

from sweet_jax import http_bounds
from sweet_jax.envs.colbench import hidden_information, task_field
from sweet_jax.envs.prompts import SIMULATOR_PROMPT, SIMULATOR_SYSTEM_PROMPT, simulator_dialogue_text
from sweet_jax.errors import SweetJaxError
from sweet_jax.jsonl import replace_lone_surrogates

log = logging.getLogger(__name__)

NO_RESPONSE = "No response."  # the official simulator's reply when the endpoint rejects the request (400)


class SimulatorError(SweetJaxError):
    """The human simulator could not produce a reply (after retries); the message says why."""


def simulator_messages(task: Any, dialogue: Sequence[dict], *, template: str = SIMULATOR_PROMPT,
                       system_prompt: str = SIMULATOR_SYSTEM_PROMPT) -> list[dict]:
    """The chat request a simulator model answers: the official two messages (system, user)."""
    prompt = template.format(problem_description=task_field(task, "problem_description", ""),
                             hidden_information=hidden_information(task),
                             dialogue_history=simulator_dialogue_text(dialogue))
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": prompt}]


class Simulator:
    """Base class: subclasses implement `reply`; `reply_many` fans requests out over threads."""

    concurrency: int = 1

    def reply(self, task: Any, dialogue: Sequence[dict]) -> str:
        raise NotImplementedError

    def reply_many(self, requests: Sequence[tuple[Any, Sequence[dict]]]) -> list[str | SimulatorError]:
        def one(request):
            try:
                return clean_reply(self.reply(*request))
            except SimulatorError as e:
                return e
            except Exception as e:  # noqa: BLE001 — any simulator bug fails its episode, not the run
                return SimulatorError(f"{type(self).__name__} raised {type(e).__name__}: {e}")

        if len(requests) <= 1 or self.concurrency <= 1:
            return [one(r) for r in requests]
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(self.concurrency, len(requests))) as pool:
            return list(pool.map(one, requests))

    def close(self) -> None:
        pass


class ScriptedSimulator(Simulator):
    """Replies computed by `fn(task, dialogue) -> str`; by default the hidden information itself."""

    def __init__(self, fn: Callable[[Any, Sequence[dict]], str] | None = None):
        self.fn = fn or (lambda task, dialogue: hidden_information(task))

    def reply(self, task, dialogue):
        return str(self.fn(task, dialogue))


def _retryable(error: Exception) -> bool:
    if isinstance(error, (openai.APIConnectionError, openai.APIResponseValidationError)):
        return True  # endpoint down, timed out, or sent something that is not a chat completion
    if isinstance(error, openai.APIStatusError):
        return error.status_code in (408, 409, 429) or error.status_code >= 500
    return isinstance(error, (ValueError, AttributeError, TypeError, KeyError, IndexError))  # malformed body


def bounded_http_client(timeout_s: float, max_bytes: int):
    """An HTTP client for the openai library whose every request has timeout_s in all (not per socket read) and
    an answer of at most max_bytes (sweet_jax.http_bounds); past either it fails like a timeout, and is retried."""
    class BoundedTransport(httpx2.HTTPTransport):
        def handle_request(self, request):
            deadline = time.monotonic() + timeout_s
            response = super().handle_request(request)
            stream = response.extensions.get("network_stream")
            sock = stream.get_extra_info("socket") if stream is not None else None
            try:
                with http_bounds.watchdog(http_bounds.socket_stopper(sock), deadline):
                    body = http_bounds.read_body(response.stream, deadline=deadline, max_bytes=max_bytes,
                                                 timeout_s=timeout_s, where=str(request.url),
                                                 content_length=response.headers.get("content-length"))
            except http_bounds.AnswerBoundError as e:
                raise httpx2.ReadTimeout(str(e), request=request) from e
            finally:
                response.close()
            headers = [(k, v) for k, v in response.headers.multi_items()
                       if k.lower() not in ("content-length", "transfer-encoding", "content-encoding")]
            return httpx2.Response(response.status_code, headers=headers, content=body,
                                   extensions={k: v for k, v in response.extensions.items() if k != "network_stream"})

    return httpx2.Client(transport=BoundedTransport(), timeout=timeout_s, follow_redirects=True)


def clean_reply(text: str) -> str:
    """A simulator's reply as text that can be stored: lone surrogates (a JSON escape like \\ud800 decodes to one,
    and no UTF-8 file can hold it) become U+FFFD."""
    return replace_lone_surrogates(text)


class OpenAISimulator(Simulator):
    """The human simulator served by an OpenAI-compatible endpoint (temperature 0, as the paper). Each request has
    timeout_s in all, an answer of at most http_bounds.answer_cap(max_tokens) bytes, and a reply of text."""

    def __init__(self, base_url: str, model: str, *, api_key: str = "EMPTY", timeout_s: float = 60.0,
                 max_retries: int = 3, backoff_s: float = 1.0, max_backoff_s: float = 30.0,
                 concurrency: int = 16, max_tokens: int = 256, temperature: float = 0.0,
                 template: str = SIMULATOR_PROMPT, system_prompt: str = SIMULATOR_SYSTEM_PROMPT, client=None):
        if not base_url and client is None:
            raise SimulatorError("OpenAISimulator: base_url is empty; set --config.simulator.base_url "
                                 "(e.g. http://127.0.0.1:8000/v1)")
        # Our own retry loop (below) decides what to retry, so the client's is off.
        self.client = client or openai.OpenAI(
            base_url=base_url, api_key=api_key or "EMPTY", timeout=timeout_s, max_retries=0,
            http_client=bounded_http_client(timeout_s, http_bounds.answer_cap(max_tokens)))
        self.base_url, self.model = base_url, model
        self.max_retries, self.backoff_s, self.max_backoff_s = max_retries, backoff_s, max_backoff_s
        self.concurrency, self.max_tokens, self.temperature = max(1, concurrency), max_tokens, temperature
        self.template, self.system_prompt = template, system_prompt
        self._slots = threading.BoundedSemaphore(self.concurrency)

    def _complete_once(self, messages) -> str:
        completion = self.client.chat.completions.create(
            model=self.model, messages=messages, max_tokens=self.max_tokens, temperature=self.temperature)
        content = completion.choices[0].message.content  # malformed bodies fail here and are retried
        if not isinstance(content, str):
            raise TypeError(f"the completion's message content is {type(content).__name__}, not text")
        used = getattr(getattr(completion, "usage", None), "completion_tokens", None)
        if isinstance(used, int) and used > self.max_tokens:  # an answer to another request: retried
            raise ValueError(f"the endpoint reports {used} completion tokens for max_tokens={self.max_tokens}")
        return clean_reply(content)

    def reply(self, task, dialogue):
        return self.complete(simulator_messages(task, dialogue, template=self.template,
                                                system_prompt=self.system_prompt))

    def complete(self, messages: list[dict]) -> str:
        """The endpoint's reply to a chat request, with retries and back-off; SimulatorError when it fails."""
        last_error = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)))
            try:
                with self._slots:
                    return self._complete_once(messages)
            except openai.BadRequestError as e:
                # As the official simulator: a request the server rejects (e.g. a dialogue longer than
                # its context) gets "No response." and the episode goes on.
                log.warning("simulator request rejected (400), replying %r: %s", NO_RESPONSE, e)
                return NO_RESPONSE
            except Exception as e:  # noqa: BLE001 — sorted by _retryable
                last_error = e
                if not _retryable(e):
                    break
                log.info("simulator attempt %d/%d failed: %s: %s", attempt + 1, self.max_retries + 1,
                         type(e).__name__, e)
        cause = last_error.__cause__ or last_error  # the bound that cut an answer, not "Request timed out."
        raise SimulatorError(
            f"human simulator at {self.base_url} (model {self.model!r}) failed after "
            f"{attempt + 1} attempt(s): {type(last_error).__name__}: {str(last_error)[:300]}"
            + (f" ({str(cause)[:300]})" if cause is not last_error else ""))

    def close(self):
        self.client.close()


class ModelSimulator(Simulator):
    """The human simulator as a sweet_jax Sampler in this process (greedy, one batched call)."""

    def __init__(self, sampler, *, max_new_tokens: int = 128, template: str = SIMULATOR_PROMPT,
                 system_prompt: str = SIMULATOR_SYSTEM_PROMPT, seed: int = 0):
        self.sampler, self.max_new_tokens, self.seed = sampler, max_new_tokens, seed
        self.template, self.system_prompt = template, system_prompt

    def reply(self, task, dialogue):
        (result,) = self.reply_many([(task, dialogue)])
        if isinstance(result, SimulatorError):
            raise result
        return result

    def reply_many(self, requests):
        if not requests:
            return []
        conversations = [simulator_messages(t, d, template=self.template, system_prompt=self.system_prompt)
                         for t, d in requests]
        try:
            outputs = self.sampler.chat(conversations, max_new_tokens=self.max_new_tokens, temperature=0.0,
                                        seed=self.seed)
        except Exception as e:  # noqa: BLE001 — an in-process failure fails these episodes, not the run
            return [SimulatorError(f"ModelSimulator sampler failed: {type(e).__name__}: {e}")] * len(requests)
        return [clean_reply(output_text(o)) for o in outputs]


def output_text(output) -> str:
    """The text of one sampler output: a Sample (.text), the list of a prompt's samples, a dict or a str."""
    if isinstance(output, (list, tuple)):
        output = output[0]
    if isinstance(output, str):
        return output
    if isinstance(output, dict):
        return output["text"]
    return output.text
