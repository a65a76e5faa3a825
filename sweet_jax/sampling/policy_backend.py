"""Where the policy samples: in this process (generate.Sampler) or on an OpenAI-compatible inference engine.

One config field picks it wherever the policy samples (`python -m sweet_jax.rollout`, `python -m sweet_jax.rank`,
the pipeline's offline, candidates and eval stages): `policy.backend`

  in_process   the policy's weights are loaded here and sampled with sweet_jax.sampling.generate.Sampler;
  openai       the policy is sampled by one or more engines (vLLM, SGLang, `python -m sweet_jax.serve`) through
               the completions API: the prompt goes as token ids, and each reply comes back as token ids with
               their log-probs (vLLM's `return_tokens_as_token_ids`: `logprobs.tokens` = "token_id:N"), so the
               candidates, the `sampler` rank reference and the policy pairs get exactly what the engine sampled.

The `openai` settings (`policy.openai`, see config_utils.openai_config):
  base_urls          comma-separated engine URLs (ending in /v1); requests are spread over them round-robin and a
                     failed request is retried on the next one;
  command            instead of base_urls: a command template that starts an engine serving the exported policy,
                     e.g. "vllm serve {hf_dir} --port {port} --return-tokens-as-token-ids"; placeholders {hf_dir},
                     {port}, {host}, {python}. It is started before sampling, waited for (GET /v1/models), stopped
                     after, and started again if it dies while sampling;
  model              the served model name ('' = the first one GET /v1/models lists);
  concurrency        requests in flight (each is one prompt with its n samples);
  max_retries, backoff_s, timeout_s   per request: retries with exponential back-off on connection errors,
                     timeouts, 429 and 5xx (other errors fail at once with the engine's message).

Same results either way: request j of a `generate` call carries the seed the in-process sampler gives prompt j
(base.mix_seed(seed, j)) and the policy's end-of-sequence ids as stop_token_ids, and its text is decoded here
from the returned ids as the Sampler decodes them; with `python -m sweet_jax.serve` as the engine, greedy replies
are the same token ids with the same log-probs (tests/test_policy_backend.py). Sampled replies are the same up to
floating-point rounding: the engine batches concurrent requests its own way, so a logit can differ in its last
bits and, rarely, a draw lands on the neighbouring token id across one CDF boundary (tests/draws.py).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import json
import logging
import math
import os
import pathlib
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import types
import urllib.parse
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import requests
import urllib3
from requests.utils import DEFAULT_CA_BUNDLE_PATH
from tqdm import tqdm

from sweet_jax import http_bounds
from sweet_jax.data.tokenizers import load_tokenizer
from sweet_jax.errors import SweetJaxError
from sweet_jax.sampling import generate
from sweet_jax.sampling.base import BaseSampler, Sample, mix_seed
from sweet_jax.train import model_loading

log = logging.getLogger(__name__)

BACKENDS = ("in_process", "openai")
TOKEN_ID_PREFIX = "token_id:"  # vLLM's return_tokens_as_token_ids spelling of a token in logprobs.tokens
LOGPROB_SLACK = 1e-5  # float rounding of a log-softmax at its maximum; a larger positive log-prob is an error


class PolicyBackendError(SweetJaxError):
    """The policy's sampling backend cannot run (bad settings, an engine that does not start or answer)."""


class AnswerError(Exception):
    """An engine's answer that breaks what was asked (a token id outside the vocabulary, more tokens than
    max_tokens, a log-prob per token missing, NaN or > 0, ...): the request is retried, never recorded."""


def check_backend(backend: str, field: str) -> None:
    if backend not in BACKENDS:
        raise PolicyBackendError(f"{field}={backend!r}: use in_process (sample in this process) or openai "
                                 "(an OpenAI-compatible engine: vLLM, SGLang, python -m sweet_jax.serve)")


# ==========================================================================================================
# An engine started from a command template
# ==========================================================================================================

MODELS_MAX_BYTES = http_bounds.MiB  # GET /models: an honest list of served models is a few KiB
READY_PROBE_S = 10.0                 # one readiness probe's deadline (within the startup timeout)


def get_models(url: str, *, deadline: float, timeout_s: float, manager=None, read: bool = True
               ) -> tuple[int, bytes]:
    """(status, body) of GET url/models, the whole exchange (connection, headers, body) under one deadline
    (time.monotonic()) and the body under MODELS_MAX_BYTES: an engine that drips its answer, headers included,
    or sends a huge list, ends in http_bounds.AnswerBoundError. read=False: the status only (a readiness probe).

    A plain http:// endpoint is reached directly, so that the watchdog holds the socket from the start (urllib3
    hands it over only once the headers have come); https or a proxy go through `manager` (urllib3), bounded
    from the headers on."""
    target = f"{url}/models"
    parts = urllib.parse.urlsplit(target)
    left = max(0.001, deadline - time.monotonic())
    late = http_bounds.AnswerBoundError(f"{target}: no complete answer within the request's deadline of "
                                        f"{timeout_s:g} s")
    if manager is not None and (parts.scheme != "http" or isinstance(manager, urllib3.ProxyManager)):
        r = manager.request("GET", target, preload_content=False, timeout=urllib3.Timeout(total=left))
        try:
            with http_bounds.watchdog(r.shutdown, deadline):
                body = http_bounds.read_body(r.stream(65536), deadline=deadline, max_bytes=MODELS_MAX_BYTES,
                                             timeout_s=timeout_s, where=target,
                                             content_length=r.headers.get("content-length")) if read else b""
        finally:
            r.close()  # a body not read to its end leaves the connection unusable
        if time.monotonic() >= deadline:
            raise late
        return r.status, body
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=left)
    try:
        conn.connect()
        with http_bounds.watchdog(http_bounds.socket_stopper(conn.sock), deadline):
            conn.request("GET", parts.path, headers=dict(getattr(manager, "headers", None) or {}))
            r = conn.getresponse()
            body = http_bounds.read_body(iter(lambda: r.read1(65536), b""), deadline=deadline,
                                         max_bytes=MODELS_MAX_BYTES, timeout_s=timeout_s, where=target,
                                         content_length=r.getheader("content-length")) if read else b""
    except (OSError, http.client.HTTPException):
        if time.monotonic() >= deadline:  # the watchdog cut it
            raise late from None
        raise
    finally:
        conn.close()
    if time.monotonic() >= deadline:  # a body the watchdog ended early is not an answer
        raise late
    return r.status, body


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Engine:
    """An inference engine process started from `command` (a template over {hf_dir} {port} {host} {python}),
    serving at `url` once GET url/models answers. `ensure_running()` starts it again after it died."""

    def __init__(self, command: str, hf_dir: str, *, host: str = "127.0.0.1", port: int = 0,
                 startup_timeout_s: float = 900.0, log_path: str | os.PathLike | None = None):
        self.port = port or free_port(host)
        try:
            self.command = command.format(hf_dir=hf_dir, port=self.port, host=host, python=sys.executable)
        except (KeyError, IndexError, ValueError) as e:
            raise PolicyBackendError(f"policy.openai.command={command!r}: bad placeholder {e}; the placeholders "
                                     "are {hf_dir} {port} {host} {python}") from None
        self.url = f"http://{host}:{self.port}/v1"
        self.startup_timeout_s = startup_timeout_s
        self.log_path = pathlib.Path(log_path) if log_path else None
        self.process: subprocess.Popen | None = None
        self.starts = 0
        self._lock = threading.Lock()

    def start(self) -> "Engine":
        argv = shlex.split(self.command)
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        log.info("starting the policy engine: %s", self.command)
        try:
            self.process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)  # its own process group: stop() ends it whole
        except OSError as e:
            raise PolicyBackendError(f"policy.openai.command: cannot start {argv[0]!r}: {e}") from None
        finally:
            if self.log_path:
                out.close()
        self.starts += 1
        self.wait_ready()
        return self

    def wait_ready(self) -> None:
        """Until GET /models answers 200 (its status is enough; the list is not read), each probe and the whole
        wait under startup_timeout_s: an engine that answers slowly, or drips its answer, does not hold it."""
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise PolicyBackendError(f"the policy engine exited with status {self.process.returncode} before "
                                         f"it served {self.url} ({self.command}){self._log_hint()}")
            try:
                status, _ = get_models(self.url, deadline=min(deadline, time.monotonic() + READY_PROBE_S),
                                       timeout_s=READY_PROBE_S, read=False)
                if status == 200:
                    log.info("the policy engine serves %s", self.url)
                    return
            except (OSError, http.client.HTTPException, http_bounds.AnswerBoundError):
                pass
            time.sleep(max(0.0, min(0.5, deadline - time.monotonic())))
        self.stop()
        raise PolicyBackendError(f"the policy engine did not answer GET {self.url}/models within "
                                 f"{self.startup_timeout_s:g} s (policy.openai.startup_timeout_s){self._log_hint()}")

    def _log_hint(self) -> str:
        return f"; its output is in {self.log_path}" if self.log_path else ""

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def ensure_running(self) -> bool:
        """Start the engine again if its process has ended; True when it did."""
        with self._lock:
            if self.alive():
                return False
            log.warning("the policy engine (%s) has stopped (status %s): starting it again", self.url,
                        None if self.process is None else self.process.returncode)
            self.start()
            return True

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=timeout_s)
        except ProcessLookupError:
            pass

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


# ==========================================================================================================
# The sampler: generate.Sampler's `generate` over HTTP
# ==========================================================================================================

class OpenAISampler(BaseSampler):
    """`generate(prompt ids, ...)` -> samples[prompt][i] (base.Sample: text, token_ids, logprobs,
    finish_reason) from OpenAI-compatible completions endpoints; what SamplerPolicy and ranking.sample_candidates
    call. `tokenizer` renders prompts and decodes replies; `config.max_position_embeddings` is the context the
    policy's episodes are checked against; `eos_token_ids` are sent as stop_token_ids."""

    def __init__(self, base_urls: Sequence[str], tokenizer, *, model: str = "", eos_token_ids: Sequence[int] = (),
                 max_position_embeddings: int = 2**31 - 1, api_key: str = "EMPTY", concurrency: int = 64,
                 max_retries: int = 5, backoff_s: float = 1.0, max_backoff_s: float = 30.0, timeout_s: float = 600.0,
                 engine: Engine | None = None, seed: int = 0, vocab_size: int | None = None):
        if not base_urls:
            raise PolicyBackendError("policy.openai: set base_urls (running engines) or command (an engine to "
                                     "start) for policy.backend='openai'")
        self.base_urls = [u.rstrip("/") for u in base_urls]
        self.tokenizer = tokenizer
        self.config = types.SimpleNamespace(max_position_embeddings=int(max_position_embeddings))
        self.eos_token_ids = [int(i) for i in eos_token_ids]
        # The bound of a returned token id: the model's vocabulary (config.json), else the tokenizer's.
        self.vocab_size = int(vocab_size) if vocab_size else len(tokenizer)
        self.api_key, self.concurrency = api_key, max(1, int(concurrency))
        self.max_retries, self.backoff_s, self.max_backoff_s = max_retries, backoff_s, max_backoff_s
        self.timeout_s, self.engine = timeout_s, engine
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._managers: dict = {}  # endpoint -> urllib3 pool manager
        self._seeds = np.random.default_rng(seed)
        self.requests_sent = 0
        self.retries = 0
        self._environment = self._environment_settings()
        self.model_name = model or self._first_model()

    # -- HTTP --------------------------------------------------------------------------------------------

    def _environment_settings(self) -> dict:
        """Each endpoint's proxies, CA bundle and client certificate from the environment (HTTP(S)_PROXY,
        NO_PROXY, REQUESTS_CA_BUNDLE, ...) as requests reads them, read once per endpoint."""
        with requests.Session() as session:
            return {url: session.merge_environment_settings(url, {}, None, None, None) for url in self.base_urls}

    def _connections(self, url: str):
        """The endpoint's urllib3 connection pool (thread-safe, keep-alive, `concurrency` connections), through
        its proxy if the environment names one. Requests go straight through urllib3 (what requests
        wraps): requests' per-request preparation was ~40% of the client's CPU per request on a fast engine."""
        with self._lock:
            manager = self._managers.get(url)
            if manager is None:
                env = self._environment[url]
                verify, cert = env.get("verify", True), env.get("cert")
                kw = dict(num_pools=4, maxsize=self.concurrency, retries=False,
                          headers={"Authorization": f"Bearer {self.api_key}", "Content-Type": "application/json"})
                if url.startswith("https://"):
                    if verify is False:
                        kw["cert_reqs"] = "CERT_NONE"
                    else:
                        kw.update(cert_reqs="CERT_REQUIRED",
                                  ca_certs=verify if isinstance(verify, str) else DEFAULT_CA_BUNDLE_PATH)
                    if cert:
                        cert_file, key_file = (cert, None) if isinstance(cert, str) else cert
                        kw.update(cert_file=cert_file, key_file=key_file)
                proxy = (env.get("proxies") or {}).get(url.split("://", 1)[0])
                manager = self._managers[url] = (urllib3.ProxyManager(proxy, **kw) if proxy
                                                 else urllib3.PoolManager(**kw))
            return manager

    def _workers(self) -> concurrent.futures.ThreadPoolExecutor:
        """The request threads, kept across generate calls (a rollout calls generate once a turn), so a call does
        not start `concurrency` threads again. Shared by concurrent generate calls, so `concurrency` bounds the
        requests in flight."""
        with self._lock:
            if self._threads is None:
                self._threads = concurrent.futures.ThreadPoolExecutor(max_workers=self.concurrency,
                                                                      thread_name_prefix="sweet_jax-openai")
            return self._threads

    @property
    def local_model(self) -> None:
        return None  # the weights are in the engine's process

    def close(self) -> None:
        """Stop the request threads and close the connections; generate starts them again."""
        with self._lock:
            threads, self._threads = self._threads, None
            managers, self._managers = list(self._managers.values()), {}
        if threads is not None:
            threads.shutdown(wait=True)
        for manager in managers:
            manager.clear()

    def _first_model(self) -> str:
        errors = []
        for url in self.base_urls:
            try:  # under the request deadline (timeout_s) and the list's size cap, as every request to an engine
                status, raw = get_models(url, deadline=time.monotonic() + self.timeout_s, timeout_s=self.timeout_s,
                                         manager=self._connections(url))
                if status != 200:
                    errors.append(f"{url}: HTTP {status}: {raw[:200].decode('utf-8', 'replace')}")
                    continue
                models = [m["id"] for m in json.loads(raw).get("data", [])]
                if models:
                    return models[0]
                errors.append(f"{url}: no model listed")
            except http_bounds.AnswerBoundError as e:
                errors.append(str(e))
            except (urllib3.exceptions.HTTPError, OSError, http.client.HTTPException, ValueError, KeyError,
                    TypeError, AttributeError) as e:
                errors.append(f"{url}: {type(e).__name__}: {e}")
        raise PolicyBackendError(f"policy.openai.model is '' and GET /models answered no model name "
                                 f"({'; '.join(errors)}); set policy.openai.model to the served model name")

    def _post(self, body: dict, index: int, check: Callable[[dict], Any] = lambda answer: answer) -> Any:
        """POST /completions with retries: endpoint (index + attempt) of the list, so requests are spread
        round-robin and a retry goes to the next endpoint. Each attempt has timeout_s for the whole request (not
        per socket read) and a size cap from the request (http_bounds.answer_cap); its answer goes through
        `check`, and one that breaks the request (AnswerError) is retried like a timeout, never returned."""
        data = json.dumps(body).encode("utf-8")
        cap = http_bounds.answer_cap(body.get("max_tokens", 1), body.get("n", 1))
        last = ""
        for attempt in range(self.max_retries + 1):
            url = self.base_urls[(index + attempt) % len(self.base_urls)]
            self.requests_sent += 1
            deadline = time.monotonic() + self.timeout_s
            r, read_whole = None, False
            try:
                # total: the connection and the answer's headers within the deadline; the body under read_body.
                r = self._connections(url).request("POST", f"{url}/completions", body=data, preload_content=False,
                                                   timeout=urllib3.Timeout(total=self.timeout_s))
                with http_bounds.watchdog(r.shutdown, deadline):  # urllib3 >= 2.3: interrupts a blocked read
                    raw = http_bounds.read_body(r.stream(65536), deadline=deadline, max_bytes=cap,
                                                timeout_s=self.timeout_s, where=url,
                                                content_length=r.headers.get("content-length"))
                read_whole = True
            except urllib3.exceptions.HTTPError as e:  # connection refused or reset, timeout, proxy error
                last = f"{url}: {type(e).__name__}: {e}"
            except http_bounds.AnswerBoundError as e:
                last = str(e)
            else:
                text = raw.decode("utf-8", "replace")
                if r.status == 200:
                    try:
                        answer = json.loads(text)
                    except ValueError as e:
                        last = f"{url}: the answer is not JSON ({e}): {text[:200]}"
                    else:
                        try:
                            return check(answer)
                        except AnswerError as e:
                            last = f"{url}: {e}"
                elif r.status == 429 or r.status >= 500:
                    last = f"{url}: HTTP {r.status}: {text[:300]}"
                else:  # the request itself is wrong: retrying cannot help
                    raise PolicyBackendError(f"the policy engine {url} refused a completion request: HTTP "
                                             f"{r.status}: {text[:500]}")
            finally:
                if r is not None:
                    if not read_whole:  # a connection with half an answer in it is not reused
                        r.close()
                    r.release_conn()
            if attempt == self.max_retries:
                break
            self.retries += 1
            if self.engine is not None and self.engine.ensure_running():
                continue  # started again and ready: no back-off needed
            wait = min(self.max_backoff_s, self.backoff_s * 2 ** attempt)
            log.warning("policy engine request failed (%s); retry %d of %d in %.1f s", last[:200], attempt + 1,
                        self.max_retries, wait)
            time.sleep(wait)
        raise PolicyBackendError(f"the policy engine(s) {', '.join(self.base_urls)} did not answer a completion "
                                 f"request after {self.max_retries} retries (policy.openai.max_retries); last error: "
                                 f"{last[:500]}")

    # -- generate ----------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 256, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, n: int = 1, seed: int | None = None,
                 progress: bool = False) -> list[list[Any]]:
        """n samples of each prompt (token ids), as generate.Sampler.generate returns them; prompt j is one
        request with the seed the in-process sampler gives it."""
        if prompts and isinstance(prompts[0], (int, str)):
            raise PolicyBackendError("prompts must be a list of token-id lists")
        base_seed = seed if seed is not None else int(self._seeds.integers(2**31))
        bodies = []
        for j, ids in enumerate(prompts):
            body = {"model": self.model_name, "prompt": [int(t) for t in ids], "max_tokens": int(max_new_tokens),
                    "temperature": float(temperature), "top_p": float(top_p), "n": int(n),
                    "seed": mix_seed(base_seed, j), "logprobs": 1, "return_tokens_as_token_ids": True}
            if top_k:
                body["top_k"] = int(top_k)
            if self.eos_token_ids:
                body["stop_token_ids"] = self.eos_token_ids
            bodies.append(body)
        bar = None
        if progress:
            bar = tqdm(total=len(bodies), desc="generate (openai)", unit="prompt")

        def one(j):
            samples = self._post(bodies[j], j, lambda answer: self._samples(answer, n, bodies[j]["prompt"],
                                                                             int(max_new_tokens)))
            if bar is not None:
                bar.update(1)
            return samples

        try:
            if len(bodies) <= 1 or self.concurrency <= 1:
                return [one(j) for j in range(len(bodies))]
            return list(self._workers().map(one, range(len(bodies))))
        finally:
            if bar is not None:
                bar.close()

    def _samples(self, response: dict, n: int, prompt_ids: list[int], max_tokens: int) -> list[Any]:
        """The n generate.Samples of one answer, each field checked against the request (AnswerError)."""
        try:
            choices = sorted(response["choices"], key=lambda c: c.get("index", 0))
            out = []
            for choice in choices:
                lp = choice.get("logprobs") or {}
                tokens, logprobs = lp.get("tokens"), lp.get("token_logprobs")
                if tokens is None or logprobs is None:
                    raise PolicyBackendError("the policy engine returned no logprobs.tokens / token_logprobs for a "
                                             "request with logprobs=1")
                ids = self._token_ids(tokens)
                finish = choice.get("finish_reason") or "length"
                checked = self._checked_logprobs(ids, logprobs, max_tokens)  # before anything decodes the ids
                out.append(Sample(self._text(ids, finish), ids, checked, finish, prompt_token_ids=prompt_ids))
        except (KeyError, TypeError, AttributeError) as e:
            raise AnswerError(f"the completion answer is not the OpenAI shape ({type(e).__name__}: {e}): "
                              f"{json.dumps(response)[:300]}") from None
        if len(out) != n:
            raise AnswerError(f"the engine returned {len(out)} choices for n={n}")
        return out

    def _checked_logprobs(self, ids: list[int], logprobs: list, max_tokens: int) -> list[float]:
        """One finite log-prob <= 0 per token, ids in [0, vocab_size), at most max_tokens of them (AnswerError)."""
        if len(ids) > max_tokens:
            raise AnswerError(f"the engine returned {len(ids)} tokens for max_tokens={max_tokens}")
        if len(logprobs) != len(ids):
            raise AnswerError(f"the engine returned {len(ids)} tokens with {len(logprobs)} log-probs")
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise AnswerError(f"the engine returned token ids {bad[:5]} outside the policy's vocabulary "
                              f"[0, {self.vocab_size}); is it serving the same model?")
        out = []
        for x in logprobs:
            value = float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else math.nan
            if not math.isfinite(value) or value > LOGPROB_SLACK:
                raise AnswerError(f"the engine returned the log-prob {x!r}; a token's log-prob is finite and <= 0")
            out.append(min(value, 0.0))
        return out

    @staticmethod
    def _token_ids(tokens: list) -> list[int]:
        n = len(TOKEN_ID_PREFIX)
        try:
            if all(token[:n] == TOKEN_ID_PREFIX for token in tokens):
                return [int(token[n:]) for token in tokens]
        except (TypeError, ValueError):  # a token that is not a string, or token_id:<not a number>
            pass

        def is_token_id(token) -> bool:
            try:
                int(token[n:])
                return token.startswith(TOKEN_ID_PREFIX)
            except (AttributeError, TypeError, ValueError):
                return False

        token = next((t for t in tokens if not is_token_id(t)), tokens)
        raise PolicyBackendError(f"the policy engine returned the token {token!r}, not {TOKEN_ID_PREFIX}N: it "
                                 "ignores return_tokens_as_token_ids; start vLLM with --return-tokens-as-token-ids")

    def _text(self, ids: list[int], finish_reason: str) -> str:
        """The reply's text as generate.Sampler decodes it: without the stop token that ended it."""
        if finish_reason == "stop" and ids and ids[-1] in self.eos_token_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=True)


# ==========================================================================================================
# A policy sampler from a config
# ==========================================================================================================

def hf_eos_ids(hf_dir: str) -> tuple[list[int], int]:
    """(end-of-sequence ids, max_position_embeddings) of a Hugging Face checkpoint's config.json."""
    path = pathlib.Path(hf_dir) / "config.json"
    if not path.is_file():
        raise PolicyBackendError(f"{path} does not exist: the openai backend reads the policy's end-of-sequence ids "
                                 "and context from its Hugging Face config; set the policy's path to its HF directory")
    config = json.loads(path.read_text())
    eos = config.get("eos_token_id")
    eos = [] if eos is None else [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]
    return eos, int(config.get("max_position_embeddings") or 2**31 - 1)


def hf_vocab_size(hf_dir: str) -> int | None:
    """vocab_size of a Hugging Face checkpoint's config.json (None when it has none)."""
    size = json.loads((pathlib.Path(hf_dir) / "config.json").read_text()).get("vocab_size")
    return int(size) if isinstance(size, int) and size > 0 else None


@contextlib.contextmanager
def policy_sampler(policy, path: str, tokenizer: str = "", *, seed: int = 0, dtype: str | None = None, mesh=None,
                   max_batch_size: int = 64, reuse=None, cpu_matmul: str | None = None, served: str | None = None,
                   field: str = "policy", engine_log: str | os.PathLike | None = None) -> Iterator[BaseSampler]:
    """A sampler for the policy at `path` for the duration of the block, where the config's `policy` block
    (config_utils.policy_config) says: backend in_process, generate.load_sampler (the tokenizer `tokenizer`, else the model's;
    dtype, mesh, max_batch_size, reuse, cpu_matmul: its settings); openai, an OpenAISampler over
    policy.openai.base_urls, or over an engine started from policy.openai.command for `path` (stopped when the
    block ends, its output in engine_log). served: the model the engines at base_urls serve, when the caller
    knows it (asking them for another one is an error). field: where `policy` sits in the config, for errors."""
    check_backend(policy.backend, f"{field}.backend")
    if policy.backend == "in_process":
        yield generate.load_sampler(path, tokenizer, dtype=dtype, seed=seed, mesh=mesh, max_batch_size=max_batch_size,
                                    reuse=reuse, cpu_matmul=cpu_matmul,
                                    prompt_cache_mb=policy.get("prompt_cache_mb", 0))
        return

    openai = policy.openai
    if not openai.command and served is not None and path != served:
        raise PolicyBackendError(f"{field}.backend='openai' with base_urls only: the running engines serve {served}, "
                                 f"but {path} is asked for; set {field}.openai.command so that an engine is started "
                                 "for each policy")
    eos, context = hf_eos_ids(path)
    tokenizer = load_tokenizer(model_loading.tokenizer_dir(tokenizer, path))
    engine = None
    urls = [u.strip() for u in str(openai.base_urls).split(",") if u.strip()]
    if openai.command:
        if urls:
            raise PolicyBackendError(f"{field}.openai: set base_urls (running engines) or command (an engine to "
                                     "start for each policy), not both")
        engine = Engine(openai.command, path, host=openai.host, port=openai.port,
                        startup_timeout_s=openai.startup_timeout_s, log_path=engine_log)
        engine.start()
        urls = [engine.url]
    sampler = None
    try:
        sampler = OpenAISampler(urls, tokenizer, model=openai.model, eos_token_ids=eos, vocab_size=hf_vocab_size(path),
                                max_position_embeddings=context, api_key=openai.api_key,
                                concurrency=openai.concurrency, max_retries=openai.max_retries,
                                backoff_s=openai.backoff_s, timeout_s=openai.timeout_s, engine=engine, seed=seed)
        yield sampler
    finally:
        if sampler is not None:
            sampler.close()
        if engine is not None:
            engine.stop()
