"""The policy's `openai` sampling backend against `python -m sweet_jax.serve` over real HTTP on 127.0.0.1: the same
candidates (token ids) and log-probs as the in-process sampler, and an engine killed mid-way is started again and
the sampling goes on without losing or repeating a prompt."""
from __future__ import annotations

import json
import re
import shutil
import signal
import time

import numpy as np
import pytest
import requests

from sweet_jax.sampling import policy_backend
from sweet_jax.rl import ranking
from sweet_jax.data.schema import Trajectory
from draws import MIN_IDENTICAL, assert_mostly_identical, assert_same_draws
from local_http import LocalServer, QuietHandler, write

pytestmark = pytest.mark.slow  # an engine (python -m sweet_jax.serve) per module, restarted by some tests

SERVE = "{python} -m sweet_jax.serve --model {hf_dir} --port {port} --served-model-name policy"


@pytest.fixture(scope="module")
def policy_hf(tmp_path_factory):
    """A tiny random HF Llama with the demo tokenizer's files beside it (what the pipeline exports)."""
    from tiny import make_hf_llama

    from sweet_jax.data import demo, tokenizers

    tok_dir = demo.paths().tokenizer
    vocab = len(tokenizers.load_tokenizer(tok_dir))
    path = make_hf_llama(tmp_path_factory.mktemp("policy") / "hf", "llama31", vocab_size=vocab,
                         max_position_embeddings=2048, hidden_size=32, intermediate_size=64, num_layers=1)
    for f in tok_dir.iterdir():
        if f.is_file() and f.name != "config.json":
            shutil.copy2(f, path / f.name)
    return path


@pytest.fixture(scope="module")
def in_process(policy_hf):
    from sweet_jax.sampling import generate
    return generate.load_sampler(str(policy_hf), seed=0)


@pytest.fixture(scope="module")
def engine(policy_hf, tmp_path_factory):
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    with policy_backend.Engine(SERVE, str(policy_hf), startup_timeout_s=300, log_path=log) as engine:
        yield engine


def remote(engine, in_process, hf_dir, **kw):
    eos, context = policy_backend.hf_eos_ids(hf_dir)
    return policy_backend.OpenAISampler([engine.url], in_process.tokenizer, eos_token_ids=eos,
                                        max_position_embeddings=context, engine=engine, **kw)


def turn_prompts():
    rows = []
    for i, question in enumerate(["What should the function return?", "Which key do you mean?",
                                  "Is the value an integer?", "Should it handle None?", "And for strings?"]):
        rows.append(Trajectory.from_json({
            "task": {"problem_description": f"write f{i}", "ground_truth": f"def f{i}(x): return {i}",
                     "test_cases": {"t": f"f{i}(1)"}},
            "dialogue_history": [{"role": "user", "content": f"write f{i}"},
                                 {"role": "assistant", "content": question},
                                 {"role": "user", "content": "an integer"},
                                 {"role": "assistant", "content": "I WANT TO ANSWER: ..."}]}))
    return ranking.turn_prompts(rows)


def test_serve_takes_token_ids_and_returns_them_with_logprobs_as_vllm_does(engine, in_process):
    prompt = in_process.tokenizer("def f(x):", add_special_tokens=False)["input_ids"]
    body = {"model": "policy", "prompt": prompt, "max_tokens": 6, "temperature": 0.0, "logprobs": 1,
            "return_tokens_as_token_ids": True, "return_token_ids": True}
    choice = requests.post(f"{engine.url}/completions", json=body, timeout=120).json()["choices"][0]
    want = in_process.generate([prompt], max_new_tokens=6, temperature=0.0)[0][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{i}" for i in want.token_ids]
    assert choice["token_ids"] == want.token_ids and choice["prompt_token_ids"] == prompt
    np.testing.assert_allclose(choice["logprobs"]["token_logprobs"], want.logprobs, atol=1e-4)
    assert choice["text"] == want.text


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_openai_backend_gives_the_in_process_candidates_and_logprobs(engine, in_process, policy_hf, temperature):
    """Greedy: the same token ids and log-probs (1e-4). Temperature 1: request j carries the seed the in-process
    sampler gives prompt j, so the draws are the same too, up to rare CDF-boundary flips (tests/draws.py)."""
    prompts = turn_prompts()
    kw = dict(n=3, max_new_tokens=10, temperature=temperature, seed=17)
    want = ranking.sample_candidates(in_process, prompts, **kw)
    got = ranking.sample_candidates(remote(engine, in_process, policy_hf, concurrency=8), prompts, **kw)
    assert [(g.prompt_ids, g.prompt_text) for g in got] == [(w.prompt_ids, w.prompt_text) for w in want]
    flat = lambda rows, key: [x for r in rows for x in getattr(r, key)]  # noqa: E731
    same = assert_same_draws(flat(got, "token_ids"), flat(want, "token_ids"),
                             min_identical=1.0 if temperature == 0 else MIN_IDENTICAL)
    pick = lambda values: [v for v, s in zip(values, same) if s]  # noqa: E731
    assert pick(flat(got, "texts")) == pick(flat(want, "texts"))
    np.testing.assert_allclose(pick(flat(got, "sampler_logp")), pick(flat(want, "sampler_logp")), atol=1e-4)


def test_requests_are_spread_over_the_endpoints_and_a_dead_one_is_skipped(engine, in_process):
    """Two base URLs, one of them closed: every prompt is still answered (a failed request goes to the next
    endpoint), with the same replies as from the live one alone."""
    dead = f"http://127.0.0.1:{policy_backend.free_port()}/v1"
    sampler = policy_backend.OpenAISampler([dead, engine.url], in_process.tokenizer, model="policy",
                                           eos_token_ids=[2, 3], backoff_s=0.01, concurrency=4)
    ids = [in_process.tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("a", "b c", "d e f", "g")]
    got = sampler.generate(ids, max_new_tokens=5, temperature=0.0)
    want = in_process.generate(ids, max_new_tokens=5, temperature=0.0)
    assert [[s.token_ids for s in p] for p in got] == [[s.token_ids for s in p] for p in want]
    assert sampler.retries == 2  # the two prompts that went to the dead endpoint first


def test_a_killed_engine_is_started_again_and_no_prompt_is_lost_or_repeated(policy_hf, in_process, tmp_path):
    prompts = turn_prompts() * 2  # 20 prompts: the engine dies while they are in flight
    kw = dict(n=2, max_new_tokens=8, temperature=1.0, seed=5)
    want = ranking.sample_candidates(in_process, prompts, **kw)
    with policy_backend.Engine(SERVE, str(policy_hf), startup_timeout_s=300, log_path=tmp_path / "log") as engine:
        sampler = remote(engine, in_process, policy_hf, concurrency=2, backoff_s=0.05)
        first = engine.process.pid
        answered = []
        original = sampler._samples

        def count(*args):  # kill the engine once a few prompts are done
            answered.append(1)
            if len(answered) == 3:
                engine.process.send_signal(signal.SIGKILL)
            return original(*args)

        sampler._samples = count
        got = ranking.sample_candidates(sampler, prompts, **kw)
        assert engine.starts == 2 and engine.process.pid != first and sampler.retries >= 1
    assert len(got) == len(prompts)
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids
        np.testing.assert_allclose(g.sampler_logp, w.sampler_logp, atol=1e-4)


def test_an_engine_that_never_answers_is_a_one_line_error(policy_hf, tmp_path):
    with pytest.raises(policy_backend.PolicyBackendError, match="exited with status 2 before it served"):
        policy_backend.Engine("{python} -m sweet_jax.serve --model {hf_dir} --port {port} --no-such-flag",
                              str(policy_hf), startup_timeout_s=120).start()
    with pytest.raises(policy_backend.PolicyBackendError, match="bad placeholder"):
        policy_backend.Engine("vllm serve {model}", str(policy_hf))


def test_an_engine_without_token_ids_is_refused_with_what_to_do(in_process):
    """An engine that answers with token texts (vLLM without --return-tokens-as-token-ids) is an error saying so."""
    class Texts(QuietHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            data = json.dumps({"choices": [{"index": 0, "text": "hi", "finish_reason": "length",
                                            "logprobs": {"tokens": ["hi"], "token_logprobs": [-0.5]}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    with LocalServer(Texts) as server:
        sampler = policy_backend.OpenAISampler([server.url], in_process.tokenizer, model="m", max_retries=0)
        with pytest.raises(policy_backend.PolicyBackendError, match="--return-tokens-as-token-ids"):
            sampler.generate([[1, 2]], max_new_tokens=1)


def test_proxies_from_the_environment_still_apply(engine, in_process, monkeypatch):
    """The environment's proxy settings are read once per endpoint (not on every request) and still used: a
    dead HTTP proxy fails the request unless NO_PROXY names the engine's host."""
    for name in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    dead = f"http://127.0.0.1:{policy_backend.free_port()}"
    monkeypatch.setenv("HTTP_PROXY", dead)
    monkeypatch.setenv("http_proxy", dead)
    proxied = policy_backend.OpenAISampler([engine.url], in_process.tokenizer, model="policy", max_retries=0)
    with pytest.raises(policy_backend.PolicyBackendError, match="ProxyError"):
        proxied.generate([[1, 2]], max_new_tokens=1)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    direct = policy_backend.OpenAISampler([engine.url], in_process.tokenizer, model="policy", max_retries=0)
    assert len(direct.generate([[1, 2]], max_new_tokens=2, temperature=0.0)[0][0].token_ids) >= 1


def load_config(name: str, preset: str = "demo"):
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location(f"{name}_config", pathlib.Path(__file__).parents[1] / "configs" /
                                                  f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(preset)


def backend_config(command: str, backend: str, policy_hf, engine):
    """`command`'s default config sampling `policy_hf` through `backend` (openai: the running engine)."""
    config = load_config(command)
    config.policy.path = str(policy_hf)
    config.policy.backend = backend
    config.policy.openai.base_urls = engine.url
    return config


def test_rank_takes_the_backend_switch_and_writes_the_same_pairs(engine, policy_hf, tmp_path):
    """`sweet_jax.rank` with policy.backend=openai (an engine already running at base_urls) writes the pairs the
    in-process sampler gives (same candidates, same critic and reference scores)."""
    from sweet_jax.rl import ranking as rank

    pairs = {}
    for backend in ("in_process", "openai"):
        config = backend_config("rank", backend, policy_hf, engine)
        config.num_trajectories = 2
        config.max_new_tokens = 8
        config.progress = False
        config.output = str(tmp_path / f"{backend}.jsonl")
        rank.run(config)
        pairs[backend] = [json.loads(line) for line in open(config.output)]
    # The same pair slots; the pairs themselves the same up to a rare CDF-boundary flip in a candidate
    # (tests/draws.py), which can change the critic's pick for that turn.
    fields = lambda rows: [(p["turn"], p["chosen_ids"], p["rejected_ids"], p["chosen"]) for p in rows]  # noqa: E731
    got, want = fields(pairs["openai"]), fields(pairs["in_process"])
    assert got and [g[0] for g in got] == [w[0] for w in want]
    assert_mostly_identical(got, want, what="pairs")


def test_rollout_takes_the_backend_switch_and_plays_the_same_episodes(engine, policy_hf, tmp_path):
    from sweet_jax.rl import episodes as rollout

    episodes = {}
    for backend in ("in_process", "openai"):
        config = backend_config("rollout", backend, policy_hf, engine)
        config.num_tasks, config.best_of, config.max_turns, config.sampling.max_new_tokens = 2, 2, 2, 8
        config.sandbox.enabled = False
        config.progress = False
        config.output = str(tmp_path / backend / "trajectories.jsonl")
        assert rollout.run(config)["episodes"] == 4
        episodes[backend] = [json.loads(line)["dialogue_history"] for line in open(config.output)]
    # The same episodes up to a rare CDF-boundary flip in one of them (tests/draws.py).
    assert_mostly_identical(episodes["openai"], episodes["in_process"], what="episodes")


# -- hostile engines: every field of an answer is checked against the request; deadline and size per request --

class HostileEngine(LocalServer):
    """A completions endpoint on 127.0.0.1 whose first `bad` answers are `answer(body)` (a dict, or raw bytes with
    `drip_s` seconds between them), then honest ones: `max_tokens` tokens of id 1 at log-prob -0.5."""

    def __init__(self, answer, bad=10 ** 9, drip_s=0.0, headers=None):
        self.requests = 0
        engine = self

        class Handler(QuietHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                engine.requests += 1
                honest = {"choices": [{"index": i, "finish_reason": "length", "logprobs": {
                    "tokens": ["token_id:1"] * body["max_tokens"], "token_logprobs": [-0.5] * body["max_tokens"]}}
                    for i in range(body["n"])]}
                data = answer(body) if engine.requests <= bad else honest
                data = data if isinstance(data, bytes) else json.dumps(data).encode()
                try:
                    self.send_response(200)
                    for k, v in (headers or {"Content-Length": str(len(data))}).items():
                        self.send_header(k, v)
                    self.end_headers()
                except (BrokenPipeError, ConnectionResetError):
                    return
                write(self.wfile, data, drip_s)

        super().__init__(Handler)


@pytest.fixture(scope="module")
def demo_tokenizer():
    from sweet_jax.data import demo, tokenizers
    return tokenizers.load_tokenizer(demo.paths().tokenizer)


def one_choice(tokens, logprobs):
    return {"choices": [{"index": 0, "finish_reason": "length",
                         "logprobs": {"tokens": [f"token_id:{t}" for t in tokens], "token_logprobs": logprobs}}]}


VOCAB = 1000
ATTACKS = {  # what the engine answers a request of max_tokens=4, n=1 -> what the error names
    "id_past_vocab": (lambda b: one_choice([1, VOCAB + 5], [-0.1, -0.2]), "outside the policy's vocabulary"),
    "negative_id": (lambda b: one_choice([-3], [-0.1]), "outside the policy's vocabulary"),
    "fewer_logprobs": (lambda b: one_choice([1, 2, 3, 4], [-0.1]), "4 tokens with 1 log-probs"),
    "nan_logprob": (lambda b: one_choice([1, 2], [-0.1, float("nan")]), "log-prob nan"),
    "positive_logprob": (lambda b: one_choice([1, 2], [-0.1, 0.7]), "log-prob 0.7"),
    "null_logprob": (lambda b: one_choice([1], [None]), "log-prob None"),
    "ten_times_max_tokens": (lambda b: one_choice([1] * 40, [-0.1] * 40), "40 tokens for max_tokens=4"),
    "missing_choice": (lambda b: {"choices": []}, "0 choices for n=1"),
    "not_the_shape": (lambda b: {"choices": [{"logprobs": "x"}]}, "not the OpenAI shape"),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_an_answer_that_breaks_the_request_is_retried_then_refused_never_recorded(demo_tokenizer, attack):
    answer, named = ATTACKS[attack]
    with HostileEngine(answer) as engine:
        sampler = policy_backend.OpenAISampler([engine.url], demo_tokenizer, model="m", max_retries=1,
                                               backoff_s=0.01, vocab_size=VOCAB)
        with pytest.raises(policy_backend.PolicyBackendError, match=f"after 1 retries.*{re.escape(named)}"):
            sampler.generate([[1, 2]], max_new_tokens=4)
    assert engine.requests == 2


def test_a_bad_answer_followed_by_an_honest_one_gives_the_honest_samples(demo_tokenizer):
    with HostileEngine(ATTACKS["nan_logprob"][0], bad=1) as engine:
        sampler = policy_backend.OpenAISampler([engine.url], demo_tokenizer, model="m", max_retries=2,
                                               backoff_s=0.01, vocab_size=VOCAB)
        (sample,), = sampler.generate([[1, 2]], max_new_tokens=3)
    assert sample.token_ids == [1, 1, 1] and sample.logprobs == [-0.5] * 3 and engine.requests == 2


def test_a_slow_drip_answer_is_cut_at_the_request_deadline_not_per_read(demo_tokenizer):
    """One byte every 50 ms keeps every socket read under the timeout; the request as a whole may not."""
    body = json.dumps(one_choice([1], [-0.1])).encode() + b" " * 400  # about 20 s at this pace
    with HostileEngine(lambda b: body, drip_s=0.05) as engine:
        sampler = policy_backend.OpenAISampler([engine.url], demo_tokenizer, model="m", max_retries=0,
                                               timeout_s=1.0, vocab_size=VOCAB)
        start = time.monotonic()
        with pytest.raises(policy_backend.PolicyBackendError, match="deadline of 1 s"):
            sampler.generate([[1, 2]], max_new_tokens=1)
    assert time.monotonic() - start < 3.0


@pytest.mark.parametrize("announced", [True, False])
def test_an_answer_larger_than_the_request_allows_is_not_read_whole(demo_tokenizer, announced):
    """A 1-token request's answer fits in about 1 MiB; 3 MiB (announced, or chunked without a length) is cut."""
    from sweet_jax import http_bounds
    big = b" " * (3 * http_bounds.MiB)
    headers = None if announced else {"Transfer-Encoding": "identity", "Connection": "close"}
    with HostileEngine(lambda b: big, headers=headers) as engine:
        sampler = policy_backend.OpenAISampler([engine.url], demo_tokenizer, model="m", max_retries=0,
                                               vocab_size=VOCAB)
        with pytest.raises(policy_backend.PolicyBackendError, match="announces|passed"):
            sampler.generate([[1, 2]], max_new_tokens=1)


# -- the engine while it starts: GET /models under the request deadline and the answer's size cap --

class ModelsEngine(LocalServer):
    """GET /v1/models on 127.0.0.1: `body` after the status line, a byte every `drip_s` seconds (headers
    included) when drip_s > 0."""

    def __init__(self, body: bytes, drip_s: float = 0.0):
        class Handler(QuietHandler):
            def do_GET(self):
                write(self.wfile, b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                      % (len(body), body), drip_s)

        super().__init__(Handler)


MODEL_LIST = json.dumps({"object": "list", "data": [{"id": "served-policy", "object": "model"}]}).encode()


def test_an_engine_that_drips_its_readiness_answer_does_not_hold_the_start_past_its_timeout(tmp_path):
    """A byte every 50 ms (each read in time; the whole answer ~10 s) against a 1 s startup timeout: the wait
    gives up at its deadline with the one-line error; an engine that answers is ready at once."""
    with ModelsEngine(MODEL_LIST, drip_s=0.05) as dripping:
        engine = policy_backend.Engine("unused {port}", str(tmp_path), port=dripping.port, startup_timeout_s=1.0)
        with pytest.raises(policy_backend.PolicyBackendError, match="within 1 s .policy.openai.startup_timeout_s"):
            engine.wait_ready()
    with ModelsEngine(MODEL_LIST) as honest:
        policy_backend.Engine("unused {port}", str(tmp_path), port=honest.port, startup_timeout_s=30).wait_ready()


@pytest.mark.parametrize("attack", ["drip", "huge"])
def test_the_model_listing_is_under_the_request_deadline_and_size_cap(demo_tokenizer, attack):
    """policy.openai.model='' reads the served name from GET /models: a dripped list is cut at timeout_s, a
    3 MiB one at the 1 MiB cap, each with a one-line error naming it; an honest list gives the name."""
    from sweet_jax import http_bounds
    huge = json.dumps({"data": [{"id": "served-policy", "pad": " " * (3 * http_bounds.MiB)}]}).encode()
    body, drip_s, named = {"drip": (MODEL_LIST, 0.05, "deadline of 1 s"),
                           "huge": (huge, 0.0, "more than the 1048576")}[attack]
    with ModelsEngine(body, drip_s=drip_s) as engine:
        with pytest.raises(policy_backend.PolicyBackendError, match=f"GET /models answered no model name.*{named}"):
            policy_backend.OpenAISampler([engine.url], demo_tokenizer, model="", timeout_s=1.0, vocab_size=VOCAB)
    with ModelsEngine(MODEL_LIST) as honest:
        sampler = policy_backend.OpenAISampler([honest.url], demo_tokenizer, model="", timeout_s=1.0,
                                               vocab_size=VOCAB)
        assert sampler.model_name == "served-policy"
