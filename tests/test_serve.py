"""OpenAI-compatible server: the real `openai` client against 127.0.0.1, in-process and as a subprocess."""
import concurrent.futures
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest

from tiny import make_hf_llama

from sweet_jax.data.tokenizers import ENGLISH_SAMPLE, build_llama3_tokenizer
from sweet_jax.sampling.generate import Request, Sampler, SamplingParams
from sweet_jax.models import load_hf
from sweet_jax.sampling.server import BatchingEngine, start_server

VOCAB = 320


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("served")
    tokenizer = build_llama3_tokenizer(path, [ENGLISH_SAMPLE] * 4, vocab_size=VOCAB)
    eos = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    make_hf_llama(path, "llama32", vocab_size=VOCAB, bos_token_id=tokenizer.bos_token_id, eos_token_id=eos)
    return path


@pytest.fixture(scope="module")
def server(hf_dir):
    import transformers

    sampler = Sampler(load_hf(hf_dir), transformers.AutoTokenizer.from_pretrained(str(hf_dir)))
    # A wide collection window so that the concurrent-requests test lands in one batch.
    with start_server(sampler, port=0, model_name="tiny", batch_window_s=0.3) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_chat_completion_greedy_matches_the_sampler(client, server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the sum?"}]
    r = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=12)
    expected = server.app.sampler.chat([messages], max_new_tokens=12, temperature=0.0)[0][0]
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected.text
    assert r.choices[0].finish_reason == expected.finish_reason
    assert r.usage.completion_tokens == len(expected.token_ids)
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
             messages[1]]  # OpenAI's content-part form renders the same prompt
    r2 = client.chat.completions.create(model="tiny", messages=parts, temperature=0, max_tokens=12)
    assert r2.choices[0].message.content == expected.text and r2.usage.prompt_tokens == r.usage.prompt_tokens


def test_chat_n_seed_and_logprobs(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "hello"}], temperature=1.0, max_tokens=10,
              n=3, seed=5, logprobs=True)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert len(a.choices) == 3
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    for c in a.choices:
        lps = [t.logprob for t in c.logprobs.content]
        assert len(lps) >= 1 and all(lp <= 0 for lp in lps)


def test_completions_logprobs_are_the_samplers(client, server):
    prompt = "def add(a, b):"
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1.0, seed=3, logprobs=1)
    choice = r.choices[0]
    sampler = server.app.sampler
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)
    expected = sampler.generate_requests([Request(sampler.encode(prompt), params)])[0][0]
    assert choice.text == expected.text
    assert choice.logprobs.tokens == [sampler.tokenizer.decode([t]) for t in expected.token_ids]
    np.testing.assert_allclose(choice.logprobs.token_logprobs, expected.logprobs, rtol=1e-6)
    assert choice.logprobs.text_offset[0] == 0
    assert r.usage.completion_tokens == len(expected.token_ids)
    # token texts are decoded once per id and kept: a second request's (many ids seen before) are still right
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1.0, seed=4,
                                      logprobs=1, n=3, extra_body={"return_token_ids": True})
    for c in again.choices:
        assert c.logprobs.tokens == [sampler.tokenizer.decode([t]) for t in c.token_ids]
        assert c.logprobs.text_offset == list(np.cumsum([0] + [len(t) for t in c.logprobs.tokens[:-1]]))


def test_concurrent_requests_are_batched(client, server):
    before = len(server.app.engine.batch_sizes)

    def ask(i):
        return client.completions.create(model="tiny", prompt=f"request {i}", max_tokens=6, temperature=0)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(ask, range(4)))
    sizes = server.app.engine.batch_sizes[before:]
    assert sum(sizes) == 4 and max(sizes) >= 2, sizes
    sampler = server.app.sampler
    for i, r in enumerate(results):  # batching does not change greedy results
        assert r.choices[0].text == sampler.generate([f"request {i}"], max_new_tokens=6, temperature=0.0)[0][0].text


def test_malformed_requests_get_a_400_json_error(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], top_p=5.0)
    assert "top_p" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages="not a list")
    with pytest.raises(openai.BadRequestError, match="max_position_embeddings"):
        client.completions.create(model="tiny", prompt="x", max_tokens=10**6)
    request = urllib.request.Request(server.url + "/chat/completions", data=b"{not json",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=30)
    assert e.value.code == 400
    assert "not valid JSON" in json.loads(e.value.read())["error"]["message"]


def test_server_runs_as_a_subprocess(hf_dir):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.Popen([sys.executable, "-m", "sweet_jax.serve", "--model", str(hf_dir), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "serving" in line:
                break
        assert proc.poll() is None, "".join(lines)
        url = line.strip().rsplit(" ", 1)[-1]
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        r = client.chat.completions.create(model=hf_dir.name, messages=[{"role": "user", "content": "hi"}],
                                           temperature=0, max_tokens=5)
        assert r.choices[0].finish_reason in ("stop", "length")
        assert [m.id for m in client.models.list().data] == [hf_dir.name]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# --- hostile and malformed input ------------------------------------------------------------------------

READ_TIMEOUT_S = 1.0
BODY_LIMIT = 64 << 10


@pytest.fixture(scope="module")
def strict_server(server):
    """A second server over the same sampler, with a short read timeout and a small body limit."""
    with start_server(server.app.sampler, port=0, model_name="tiny", read_timeout_s=READ_TIMEOUT_S,
                      max_body_bytes=BODY_LIMIT) as srv:
        yield srv


def _post(server, path, body, *, raw=None, headers=None, method="POST"):
    """(status, parsed JSON body) of one request over a fresh connection."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
    try:
        data = raw if raw is not None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        payload = response.read()
        assert response.getheader("Content-Type") == "application/json", payload[:200]
        return response.status, json.loads(payload)
    finally:
        conn.close()


def _raw_exchange(server, data: bytes, *, wait_s: float = 10.0) -> bytes:
    """Sends bytes as they are, then reads until the server closes (or wait_s passes)."""
    with socket.create_connection((server.host, server.port), timeout=wait_s) as sock:
        sock.sendall(data)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except socket.timeout:
            pass
        return b"".join(chunks)


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}


@pytest.mark.parametrize("field,value", [
    ("top_k", 1099511627776), ("top_k", -1), ("top_k", 321), ("temperature", "hot"), ("temperature", 3),
    ("top_p", 0), ("n", 0), ("n", 1000), ("n", 2.5), ("seed", 2**70), ("seed", "7"), ("max_tokens", 0),
    ("max_tokens", 10**6), ("max_completion_tokens", -3), ("stop", ["a"] * 5), ("stop", [""]), ("stop", 5),
    ("logprobs", "yes"), ("presence_penalty", 0.5), ("frequency_penalty", "x"), ("logit_bias", {"1": 5}),
    ("stream", "yes"), ("stream_options", {"include_usage": True}), ("user", 5), ("messages", []),
    ("messages", [{"role": "user"}]), ("top_logprobs", 2),
    ("temprature", 0.5),
])
def test_every_chat_parameter_is_checked_and_named(server, field, value):
    status, body = _post(server, "/v1/chat/completions", {**CHAT, field: value})
    assert status == 400, body
    assert body["error"]["param"] == field and body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("field,value", [("prompt", [[1, 2, 10**6]]), ("prompt", [[]]), ("prompt", 5),
                                         ("logprobs", 9), ("echo", True), ("suffix", "x"), ("top_k", 10**12)])
def test_every_completion_parameter_is_checked_and_named(server, field, value):
    status, body = _post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2, field: value})
    assert status == 400, body
    assert body["error"]["param"] == field


def test_unknown_model_is_a_404_like_openai(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4-does-not-exist", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["code"] == "model_not_found" and "tiny" in e.value.body["message"]


def test_a_bad_request_never_fails_the_good_ones_sent_with_it(server):
    """Six valid requests and one with an absurd top_k, at once: six answers and one 400."""
    bodies = [{**CHAT, "max_tokens": 4}] * 6 + [{**CHAT, "top_k": 1099511627776}]
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        results = list(pool.map(lambda b: _post(server, "/v1/chat/completions", b), bodies))
    assert [status for status, _ in results] == [200] * 6 + [400]
    assert results[-1][1]["error"]["param"] == "top_k"


def test_a_burst_goes_to_the_sampler_in_one_call_up_to_max_call_rows():
    """Requests arriving less than a window apart wait for each other (up to max_wait_s in all), so a client's
    burst reaches the sampler as one call, sorted there by prompt length as in-process; max_call_rows caps a call."""
    class RecordingSampler:
        def __init__(self):
            self.calls = []

        def generate_requests(self, requests, on_batch=None, **streaming):
            self.calls.append([r.prompt_ids[0] for r in requests])
            return [[f"samples of {r.prompt_ids}"] for r in requests]

    for max_call_rows, want in ((64, [[0, 1, 2, 3, 4]]), (6, [[0, 1, 2], [3, 4]])):
        sampler = RecordingSampler()
        engine = BatchingEngine(sampler, batch_window_s=0.2, max_wait_s=5.0, max_call_rows=max_call_rows)
        try:
            futures = []
            for i in range(5):  # 0.1 s apart: 0.4 s in all, twice the window
                futures.append(engine.submit(Request([i], SamplingParams(max_new_tokens=2, n=2))))
                time.sleep(0.1)
            assert [f.result(timeout=30) for f in futures] == [[f"samples of {[i]}"] for i in range(5)]
            assert sampler.calls == want
        finally:
            engine.close()


def test_requests_are_answered_as_their_compiled_batch_finishes():
    """A burst runs as one sampler call of several compiled batches; the first batch's requests get their answers
    while a later batch is still running (the client reads them meanwhile)."""
    first_done, release = threading.Event(), threading.Event()

    class TwoBatches:
        def generate_requests(self, requests, on_batch=None, **streaming):
            on_batch([0, 1], [[f"samples of {r.prompt_ids}"] for r in requests[:2]])
            first_done.set()
            assert release.wait(30)
            on_batch([2], [[f"samples of {requests[2].prompt_ids}"]])
            return [[f"samples of {r.prompt_ids}"] for r in requests]

    engine = BatchingEngine(TwoBatches(), batch_window_s=0.3)
    try:
        futures = [engine.submit(Request(ids, SamplingParams(max_new_tokens=2))) for ids in ([1], [2], [3])]
        assert first_done.wait(30)
        assert futures[0].result(timeout=1) == ["samples of [1]"] and futures[1].result(timeout=1) == ["samples of [2]"]
        assert not futures[2].done()
        release.set()
        assert futures[2].result(timeout=30) == ["samples of [3]"]
    finally:
        engine.close()


def test_a_batch_that_fails_is_rerun_request_by_request():
    """Whatever slips past validation and fails inside the sampler fails only its own request."""
    class FlakySampler:
        def generate_requests(self, requests, on_batch=None, **streaming):
            if any(r.prompt_ids == [666] for r in requests):
                raise RuntimeError("boom")
            return [[f"samples of {r.prompt_ids}"] for r in requests]

    engine = BatchingEngine(FlakySampler(), batch_window_s=0.3)
    try:
        futures = [engine.submit(Request(ids, SamplingParams(max_new_tokens=2))) for ids in ([1], [666], [2])]
        assert futures[0].result(timeout=30) == ["samples of [1]"]
        assert futures[2].result(timeout=30) == ["samples of [2]"]
        with pytest.raises(RuntimeError, match="boom"):
            futures[1].result(timeout=30)
        assert engine.batch_sizes == [3]
    finally:
        engine.close()


def test_malformed_bodies_get_400_json_errors(server):
    assert _post(server, "/v1/chat/completions", None, raw=b'{"model": "tiny", "x": "\xff\xfe"}')[0] == 400
    status, body = _post(server, "/v1/chat/completions", None, raw=b"[" * 100_000 + b"]" * 100_000)
    assert status == 400 and "nested" in body["error"]["message"]
    for length in ("abc", "-1", "1e3", " "):
        reply = _raw_exchange(server, (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                                       f"Content-Length: {length}\r\n\r\n{{}}").encode())
        assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["param"] == "Content-Length"


def test_every_route_and_method_answers_json(server):
    for method, path, status in [("PUT", "/v1/chat/completions", 405), ("DELETE", "/v1/models", 405),
                                 ("PATCH", "/v1/completions", 405), ("OPTIONS", "/v1/models", 405),
                                 ("GET", "/v1/chat/completions", 405), ("POST", "/v1/models", 405),
                                 ("GET", "/nowhere", 404), ("POST", "/v1/nowhere", 404), ("FOO", "/v1/models", 501)]:
        got, body = _post(server, path, {}, method=method)
        assert got == status and body["error"]["message"], (method, path, got, body)


def test_a_body_over_the_limit_is_refused_at_once_unread(strict_server):
    """Only the headers are sent: the 413 comes without waiting for the 50 MB announced."""
    start = time.monotonic()
    reply = _raw_exchange(strict_server, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                                         b"Content-Length: 50000000\r\n\r\n{", wait_s=30)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert time.monotonic() - start < 10 * READ_TIMEOUT_S
    with pytest.raises(openai.APIStatusError) as e:  # a client that sends it all still reads the answer
        openai.OpenAI(base_url=strict_server.url, api_key="x", max_retries=0).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x" * (2 * BODY_LIMIT)}])
    assert e.value.status_code == 413


def test_read_and_idle_timeouts_close_stalled_connections(strict_server):
    # Content-Length longer than the body: a 408 after the read timeout, not a hang.
    reply = _raw_exchange(strict_server, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                                         b"Content-Length: 100\r\n\r\n{\"model\"", wait_s=30)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    # An idle keep-alive connection is closed by the server.
    with socket.create_connection((strict_server.host, strict_server.port), timeout=30) as sock:
        assert sock.recv(1) == b""


def test_hundreds_of_concurrent_clients_are_queued_not_reset(strict_server):
    n = 300
    barrier = threading.Barrier(n)

    def ask(_):
        barrier.wait()
        return _post(strict_server, "/v1/models", None, method="GET")[0]

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        assert list(pool.map(ask, range(n))) == [200] * n


def test_a_long_request_does_not_hold_short_ones(server):
    """A long request (16 x 300 tokens, over long_request_rows) is running: a short one is answered before
    it ends (bench/bench_serve.py measures n=64 x 480)."""
    done = {}

    def long_request():
        body = {**CHAT, "n": 16, "max_tokens": 300, "temperature": 1.0}
        done["long"] = (_post(server, "/v1/chat/completions", body)[0], time.monotonic())

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(1.0)  # the long batch is decoding
    status, _ = _post(server, "/v1/chat/completions", {**CHAT, "max_tokens": 2})
    short_done = time.monotonic()
    thread.join(timeout=600)
    assert status == 200 and done["long"][0] == 200
    assert short_done < done["long"][1]


def test_chat_streams_token_deltas_that_join_to_the_reply_then_finish_reason_and_usage(client, server):
    """stream=true through the openai client: the role first, deltas that join to the non-streamed reply, the
    finish reason, and with include_usage a last chunk with no choices and the usage."""
    messages = [{"role": "user", "content": "What is the sum?"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=12)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=12,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta.content for c in chunks[1:-2]]
    assert len(deltas) > 1 and "".join(deltas) == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1]) and len({c.id for c in chunks}) == 1


def test_completions_stream_each_choice_with_its_token_logprobs(client, server):
    kwargs = dict(model="tiny", prompt="The sum", max_tokens=6, n=2, seed=3, logprobs=1)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True))
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text and mine[-1].finish_reason == choice.finish_reason
        streamed = [lp for c in mine if c.logprobs for lp in c.logprobs.token_logprobs]
        assert streamed == choice.logprobs.token_logprobs[:len(streamed)] and streamed
    assert all(c.usage is None for c in chunks)   # no include_usage: no usage chunk


def test_warmup_compiles_the_shapes_a_first_request_would_otherwise_wait_for(hf_dir):
    import transformers

    from sweet_jax.sampling.server import OpenAIApp

    sampler = Sampler(load_hf(hf_dir), transformers.AutoTokenizer.from_pretrained(str(hf_dir)))
    app = OpenAIApp(sampler, model_name="tiny", default_max_tokens=4)
    try:
        assert app.warmup(max_prompt=32) == 2       # the 16- and 32-token prompt buckets
        compiled = lambda: {k: f._cache_size() for fns in (sampler._prefill_fns, sampler._decode_fns,  # noqa: E731
                                                            sampler._grow_fns) for k, f in fns.items()}
        before = compiled()
        app.completions({"model": "tiny", "prompt": "The sum of two", "max_tokens": 4, "temperature": 0})
        assert compiled() == before
    finally:
        app.close()


# ----------------------------------------------------------------------------------------------------------
# Streaming as the decode loop runs; top log-probs
# ----------------------------------------------------------------------------------------------------------

class RecordingSampler:
    """The server's sampler, recording each generate call's end and what it returned."""

    def __init__(self, sampler):
        self._sampler = sampler
        self.calls = []   # (end time, requests, results)

    def __getattr__(self, name):
        return getattr(self._sampler, name)

    def generate_requests(self, requests, **kwargs):
        results = self._sampler.generate_requests(requests, **kwargs)
        self.calls.append((time.monotonic(), requests, results))
        return results


@pytest.fixture(scope="module")
def recorded(server):
    """(server over a RecordingSampler, the recorder, a prompt whose greedy reply runs to max_tokens=400)."""
    sampler = server.app.sampler
    prompt = next(p for p in ("The sum of two", "def add(a, b):", "hello there", "x = 1") if
                  sampler.generate([p], max_new_tokens=400, temperature=0.0)[0][0].finish_reason == "length")
    recorder = RecordingSampler(sampler)
    with start_server(recorder, port=0, model_name="tiny", max_connections=64) as srv:
        yield srv, recorder, prompt


def _stream_lines(server, body):
    """Yields (arrival time, parsed event or '[DONE]') of a streamed completion as they arrive."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    try:
        while line := response.readline():
            if line.startswith(b"data: "):
                data = line[6:].strip()
                yield time.monotonic(), "[DONE]" if data == b"[DONE]" else json.loads(data)
    finally:
        conn.close()


def test_a_stream_sends_its_first_tokens_while_the_batch_still_decodes(recorded):
    """The first token arrives before the batch's generate call returns; the deltas join to the non-streamed
    reply and carry its tokens' log-probs, in order."""
    srv, recorder, prompt = recorded
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 400, "temperature": 0, "logprobs": 0}
    whole = _post(srv, "/v1/completions", body)[1]["choices"][0]
    recorder.calls.clear()
    events = list(_stream_lines(srv, body))
    call_end = _wait_for(lambda: recorder.calls)[-1][0]
    deltas = [(t, e) for t, e in events if e != "[DONE]" and e["choices"] and e["choices"][0]["text"]]
    assert deltas[0][0] < call_end   # the first token came while the decode loop ran
    assert len({t for t, _ in deltas}) > 3   # in several pieces, not one burst
    assert "".join(e["choices"][0]["text"] for _, e in deltas) == whole["text"]
    streamed = [lp for _, e in events if e != "[DONE]" and e["choices"] and e["choices"][0]["logprobs"]
                for lp in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == whole["logprobs"]["token_logprobs"]
    assert events[-2][1]["choices"][0]["finish_reason"] == "length" and events[-1][1] == "[DONE]"


def test_a_request_that_comes_while_a_batch_decodes_is_answered_before_it_ends(recorded):
    """Both in the short lane: the second starts its own call instead of waiting for the running one."""
    srv, recorder, prompt = recorded
    long_body = {"model": "tiny", "prompt": prompt, "max_tokens": 400, "temperature": 0, "n": 8}
    short_body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 0}
    assert _post(srv, "/v1/completions", long_body)[0] == 200 and _post(srv, "/v1/completions", short_body)[0] == 200
    stream = _stream_lines(srv, long_body)   # (both shapes are compiled now)
    next(e for _, e in stream if e["choices"] and e["choices"][0]["text"])   # the long batch is decoding
    status, short = _post(srv, "/v1/completions", short_body)
    short_done = time.monotonic()
    rest = list(stream)
    assert status == 200 and short["choices"][0]["finish_reason"] in ("stop", "length")
    assert rest[-2][1]["choices"][0]["finish_reason"] == "length"
    assert short_done < rest[-2][0]


def _wait_for(condition, tries: int = 600):
    for _ in range(tries):
        if value := condition():
            return value
        time.sleep(0.1)
    raise AssertionError("the condition never held")


def test_completions_top_logprobs_are_the_top_n_and_the_sampled_token(client, server):
    """logprobs=2 answers each token's two most likely tokens (and the sampled one, as OpenAI): never null."""
    sampler = server.app.sampler
    r = client.completions.create(model="tiny", prompt="The sum", max_tokens=5, temperature=1.0, seed=4, logprobs=2)
    choice = r.choices[0]
    expected = sampler.generate_requests([Request(sampler.encode("The sum"), SamplingParams(
        max_new_tokens=5, temperature=1.0, seed=4, top_logprobs=2))])[0][0]
    assert len(choice.logprobs.top_logprobs) == len(expected.token_ids)
    for token, lp, top, want in zip(choice.logprobs.tokens, choice.logprobs.token_logprobs,
                                    choice.logprobs.top_logprobs, expected.top_logprobs):
        names = sampler.token_texts([i for i, _ in want])
        assert {k: v for k, v in top.items() if k in names} == pytest.approx(dict(zip(names, [v for _, v in want])))
        assert top[token] == pytest.approx(lp) and 2 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(want[0][1])
    zero = client.completions.create(model="tiny", prompt="The sum", max_tokens=3, temperature=0, logprobs=0)
    assert zero.choices[0].logprobs.top_logprobs == [{t: lp} for t, lp in zip(zero.choices[0].logprobs.tokens,
                                                                             zero.choices[0].logprobs.token_logprobs)]
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=3)
    for entry in chat.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], top_logprobs=2)


# ----------------------------------------------------------------------------------------------------------
# One heavy client, many slow ones
# ----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bounded_server(server):
    with start_server(server.app.sampler, port=0, model_name="tiny", read_timeout_s=READ_TIMEOUT_S,
                      max_connections=4, max_request_samples=16, max_request_new_tokens=1000) as srv:
        yield srv


HONEST = {"model": "tiny", "prompt": "The sum", "max_tokens": 3, "temperature": 0}


def test_the_work_of_one_request_is_bounded_with_a_400_naming_the_limit(server, bounded_server):
    status, body = _post(server, "/v1/completions", {**HONEST, "prompt": [[5, 6]] * 100_000})
    assert status == 400 and body["error"]["param"] == "prompt" and "1024" in body["error"]["message"]
    for ask, param, limit in ((dict(prompt=["a"] * 5, n=4), "n", "16"),
                              (dict(prompt=["a"] * 4, n=4, max_tokens=100), "max_tokens", "1000")):
        status, body = _post(bounded_server, "/v1/completions", {**HONEST, **ask})
        assert status == 400 and body["error"]["param"] == param and limit in body["error"]["message"], body
    assert _post(bounded_server, "/v1/completions", {**HONEST, "prompt": ["a"] * 4, "n": 4})[0] == 200
    assert _post(server, "/v1/completions", HONEST)[0] == 200


def _cancelled_calls(recorder):
    return [samples for _, requests, results in recorder.calls for samples in results
            if samples and samples[0].finish_reason == "cancelled"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_cancels_its_work(recorded, stream):
    srv, recorder, prompt = recorded
    recorder.calls.clear()
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 400, "temperature": 0, "n": 64, "stream": stream}
    with socket.create_connection((srv.host, srv.port), timeout=60) as sock:
        data = json.dumps(body).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
        if stream:
            assert sock.recv(100).startswith(b"HTTP/1.1 200")
        else:
            time.sleep(0.3)   # the request is queued or decoding
    _wait_for(lambda: recorder.calls)   # the engine notices at its next chunk
    cancelled = _cancelled_calls(recorder)
    assert cancelled and all(len(s.token_ids) < 400 for s in cancelled[0])
    assert _post(srv, "/v1/completions", HONEST)[0] == 200


def test_a_head_trickled_line_by_line_is_cut_at_one_deadline(bounded_server):
    """A header line every 0.6 x the read timeout: each read is in time, the head is not (408)."""
    with socket.create_connection((bounded_server.host, bounded_server.port), timeout=30) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\n")
        reply = b""
        try:
            for i in range(6):
                time.sleep(0.6 * READ_TIMEOUT_S)
                sock.sendall(b"X-Slow-%d: 1\r\n" % i)
            sock.sendall(b"\r\n")
        except OSError:   # the server has closed
            pass
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "timeout"
    assert _post(bounded_server, "/v1/models", None, method="GET")[0] == 200


@pytest.fixture
def capped_server(server):
    """Four connections at most, and a read timeout no loaded host outlasts: an idle connection keeps its slot."""
    with start_server(server.app.sampler, port=0, model_name="tiny", read_timeout_s=120.0, max_connections=4) as srv:
        yield srv


def test_connections_over_the_cap_are_refused_not_spun_on(capped_server):
    # The accept loop takes the backlog in order and each accepted connection holds its slot until it closes, so
    # the fifth connection is refused without waiting for the first four.
    idle = [socket.create_connection((capped_server.host, capped_server.port), timeout=30) for _ in range(4)]
    try:
        reply = _raw_exchange(capped_server, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 503"), reply[:200]
        assert "4 connections" in json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["message"]
    finally:
        for sock in idle:
            sock.close()

    def models_answered():
        try:
            return _post(capped_server, "/v1/models", None, method="GET")[0] == 200
        except ConnectionError:   # still over the cap: answered 503 and closed before the request was all sent
            return False

    _wait_for(models_answered, tries=300)   # the closed connections' slots come back


@pytest.mark.parametrize("raw", [
    b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "temperature": 1' + b"0" * 400 + b"}",
    b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "top_p": 1' + b"0" * 400 + b"}",
    b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "presence_penalty": 1' + b"0" * 400 + b"}",
    b'{"model": "tiny", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}",
    b'{"model": "tiny", "prompt": [1' + b"0" * 30 + b"], \"max_tokens\": 2}",
    b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "seed": -1' + b"0" * 30 + b"}",
])
def test_a_number_past_a_machine_integer_is_a_400(server, raw):
    status, body = _post(server, "/v1/completions", None, raw=raw)
    assert status == 400, body
    assert _post(server, "/v1/completions", HONEST)[0] == 200


def test_a_streamed_choice_sends_only_text_no_later_token_can_change():
    """A character split over two tokens waits for its second token; the last characters that could begin a stop
    string wait; the final sample brings the rest. The deltas join to the final text and carry each token once."""
    from sweet_jax.sampling.base import Sample
    from sweet_jax.sampling.server import StreamedChoice

    texts = {1: "He", 2: "llo", 3: " wor", 4: "ld", 9: "\ufffd", 10: "\ufffd"}

    class Pieces:  # token 9 then 10 spell one character, "€"; alone, 9 is incomplete
        def decode(self, ids):
            out, ids = [], list(ids)
            for k, t in enumerate(ids):
                if t == 10 and k and ids[k - 1] == 9:
                    continue
                out.append("€" if t == 9 and ids[k + 1:k + 2] == [10] else texts[t])
            return "".join(out)

        def token_texts(self, ids):
            return [texts[t] for t in ids]

    choice, sampler = StreamedChoice(stop=("ld",)), Pieces()

    def partial(ids):
        return choice.advance(sampler, Sample(None, ids, [0.0] * len(ids), None), final=False)
    assert partial([1, 2]) == [("He", [0])]              # "Hello": its last character could begin "ld"
    assert partial([1, 2, 9]) == [("llo", [1])]          # the euro sign is incomplete
    assert partial([1, 2, 9, 10, 3]) == [("€", [2, 3])]  # " wor" could end in "l" + "d"
    final = Sample("Hello€ wor", [1, 2, 9, 10, 3, 4], [0.0] * 6, "stop")
    assert choice.advance(sampler, final, final=True) == [(" wor", [4, 5])]
    assert choice.text == final.text and choice.offsets == [0, 2, 5, 6, 7, 11]


def test_a_stream_with_stop_strings_joins_to_the_cut_reply(recorded):
    """Streamed while the decode loop runs, a reply cut by a stop string sends nothing past the cut."""
    srv, _, _ = recorded
    body = {"model": "tiny", "prompt": "The sum of two", "max_tokens": 120, "temperature": 1.0, "seed": 8, "n": 4,
            "stop": ["e ", "th"], "logprobs": 1}
    whole = _post(srv, "/v1/completions", body)[1]["choices"]
    assert any(c["finish_reason"] == "stop" for c in whole)
    events = [e for _, e in _stream_lines(srv, body) if e != "[DONE]"]
    for choice in whole:
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert mine[-1]["finish_reason"] == choice["finish_reason"]
        assert [lp for c in mine if c["logprobs"] for lp in c["logprobs"]["token_logprobs"]] == \
            choice["logprobs"]["token_logprobs"]
