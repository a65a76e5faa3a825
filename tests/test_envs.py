"""ColBench environment rules and human-simulator failure handling."""
from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import pytest
from local_http import LocalServer, QuietHandler, write

from sweet_jax.envs import (ANSWER_MARKER, NO_ANSWER, NO_RESPONSE, ColBenchEnv, ModelSimulator, OpenAISimulator,
                            ScriptedSimulator, SimulatorError, parse_agent_reply, simulator_messages)

TASK = {
    "problem_description": "Write a function that prices my coffee order.",
    "ground_truth": "def price(n, size):\n    return n * {'s': 2, 'l': 3}[size]",
    "test_cases": {"t1": "price(2, 's')"},
    "hidden_information": "Small coffees cost 2 dollars. Large ones cost 3 dollars. " + "x" * 600,
}


def echo_turn_simulator():
    return ScriptedSimulator(lambda task, dialogue: f"reply to turn {sum(d['role'] == 'assistant' for d in dialogue)}")


def test_user_states_the_task_first():
    env = ColBenchEnv(TASK, echo_turn_simulator())
    assert env.messages() == [{"role": "user", "content": TASK["problem_description"]}]
    assert env.answer == NO_ANSWER and not env.done


def test_question_gets_a_simulator_reply_and_answer_marker_ends_the_episode():
    env = ColBenchEnv(TASK, echo_turn_simulator())
    assert env.step("What sizes are there?", prompt="PROMPT1") is False
    assert env.dialogue_history[1] == {"role": "assistant", "content": "What sizes are there?", "input": "PROMPT1",
                                       "output": "What sizes are there?"}
    assert env.dialogue_history[2] == {"role": "user", "content": "reply to turn 1"}
    code = "\ndef price(n, size):\n    return n * 2\n"
    assert env.step(ANSWER_MARKER + code) is True
    assert env.answer == code
    assert env.turns == 2 and len(env.dialogue_history) == 4  # no simulator reply after the answer
    record = env.trajectory(reward=0.5)
    assert record["answer"] == code and record["reward"] == 0.5 and record["task"] == TASK
    assert [d["role"] for d in record["dialogue_history"]] == ["user", "assistant", "user", "assistant"]


def test_answer_marker_counts_anywhere_in_the_reply_as_the_official_env():
    parsed = parse_agent_reply(f"Sure. {ANSWER_MARKER} def f(): pass {ANSWER_MARKER} ignored")
    assert parsed.answer == " def f(): pass "
    assert parse_agent_reply("Which size?").answer is None


def test_output_marker_keeps_only_the_text_after_it():
    reply = "thinking aloud OUTPUT: What is your budget? OUTPUT: junk"
    parsed = parse_agent_reply(reply)
    assert parsed.content == " What is your budget? "
    assert parsed.raw == "thinking aloud OUTPUT: What is your budget? "
    assert parsed.answer is None
    # The answer marker is looked for in the text after OUTPUT: only.
    assert parse_agent_reply(f"{ANSWER_MARKER} draft OUTPUT: still asking?").answer is None
    assert parse_agent_reply(f"plan OUTPUT: {ANSWER_MARKER}def f(): return 1").answer == "def f(): return 1"


def test_human_reply_is_cut_to_400_characters():
    env = ColBenchEnv(TASK, ScriptedSimulator())  # default rule: the hidden information, 650+ characters
    env.step("Tell me everything.")
    assert len(TASK["hidden_information"]) > 400
    assert env.dialogue_history[-1]["content"] == TASK["hidden_information"][:400]


def test_tenth_reply_is_the_answer():
    env = ColBenchEnv(TASK, echo_turn_simulator())
    for turn in range(1, 10):
        assert env.step(f"question {turn}?") is False
    assert env.step("def price(n, size): return 0") is True
    assert env.turns == 10 and env.answer == "def price(n, size): return 0"
    assert sum(d["role"] == "assistant" for d in env.dialogue_history) == 10
    assert env.dialogue_history[-1]["role"] == "assistant"
    with pytest.raises(RuntimeError, match="over"):
        env.step("more?")


def test_max_turns_is_configurable():
    env = ColBenchEnv(TASK, echo_turn_simulator(), max_turns=2)
    assert env.step("a?") is False and env.step("b?") is True and env.answer == "b?"


def test_simulator_prompt_holds_task_hidden_info_and_dialogue():
    messages = simulator_messages(TASK, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Q?"}])
    assert messages[0]["role"] == "system" and messages[1]["role"] == "user"
    body = messages[1]["content"]
    assert TASK["problem_description"] in body and TASK["hidden_information"] in body
    assert body.index("user:hi") < body.index("assistant:Q?") < body.index("agent:")


# --- a local endpoint that misbehaves --------------------------------------------------------------------------

def completion_body(text):
    return {"id": "c1", "object": "chat.completion", "created": 0, "model": "sim",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": text}}]}


class MisbehavingEndpoint(LocalServer):
    """A chat endpoint on 127.0.0.1 that fails the first `failures` requests in the given `mode`.

    modes: 'ok', 'http500', 'timeout' (answers after `delay_s`), 'malformed' (JSON that does not parse),
    'bad_schema' (JSON without choices), 'http400', 'drip' (the answer a byte every 50 ms), 'huge' (a 3 MiB answer),
    'surrogate' (a reply holding a lone surrogate, \\ud800), 'overlong' (5000 tokens for any max_tokens).
    """

    def __init__(self, mode="ok", failures=10 ** 9, reply="Small coffee is 2 dollars.", delay_s=2.0):
        self.mode, self.failures, self.reply, self.delay_s = mode, failures, reply, delay_s
        self.requests = 0
        self.lock = threading.Lock()
        endpoint = self

        class Handler(QuietHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length", 0)))
                with endpoint.lock:
                    endpoint.requests += 1
                    failing = endpoint.requests <= endpoint.failures
                mode = endpoint.mode if failing else "ok"
                if mode == "timeout":
                    time.sleep(endpoint.delay_s)
                    mode = "ok"
                if mode == "http500":
                    return self._send(500, b'{"error": {"message": "boom"}}')
                if mode == "http400":
                    return self._send(400, b'{"error": {"message": "context too long"}}')
                if mode == "malformed":
                    return self._send(200, b'{"choices": [ {"message": ')
                if mode == "bad_schema":
                    return self._send(200, b'{"object": "chat.completion"}')
                if mode == "drip":
                    return self._send(200, json.dumps(completion_body(endpoint.reply)).encode() + b" " * 400, 0.05)
                if mode == "huge":
                    return self._send(200, json.dumps(completion_body("x" * (3 << 20))).encode())
                if mode == "overlong":
                    body = dict(completion_body("x " * 5000), usage={"prompt_tokens": 10, "completion_tokens": 5000,
                                                                     "total_tokens": 5010})
                    return self._send(200, json.dumps(body).encode())
                if mode == "surrogate":
                    return self._send(200, json.dumps(completion_body("caf\ud800e")).encode())
                return self._send(200, json.dumps(completion_body(endpoint.reply)).encode())

            def _send(self, code, body, drip_s=0.0):
                try:
                    self.send_response(code)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(body)))
                    self.end_headers()
                except (BrokenPipeError, ConnectionResetError):
                    return
                write(self.wfile, body, drip_s)

        super().__init__(Handler)


def free_port():
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fast_simulator(base_url, **kw):
    kw = {"timeout_s": 5.0, "max_retries": 2, "backoff_s": 0.01, "max_backoff_s": 0.05, **kw}
    return OpenAISimulator(base_url, "sim", **kw)


def test_openai_simulator_answers_from_the_endpoint():
    with MisbehavingEndpoint("ok") as endpoint:
        env = ColBenchEnv(TASK, fast_simulator(endpoint.url))
        env.step("What does a small coffee cost?")
    assert env.dialogue_history[-1]["content"] == "Small coffee is 2 dollars."


@pytest.mark.parametrize("mode", ["http500", "malformed", "bad_schema"])
def test_transient_failures_are_retried_until_success(mode):
    with MisbehavingEndpoint(mode, failures=2) as endpoint:
        reply = fast_simulator(endpoint.url).reply(TASK, [{"role": "user", "content": "hi"}])
    assert reply == "Small coffee is 2 dollars."
    assert endpoint.requests == 3


@pytest.mark.parametrize("mode", ["http500", "malformed", "bad_schema"])
def test_persistent_failures_raise_with_the_reason_after_retries(mode):
    with MisbehavingEndpoint(mode) as endpoint:
        with pytest.raises(SimulatorError, match="after 3 attempt") as info:
            fast_simulator(endpoint.url).reply(TASK, [{"role": "user", "content": "hi"}])
    assert endpoint.requests == 3
    assert endpoint.url in str(info.value)


def test_timeout_is_retried_then_reported():
    with MisbehavingEndpoint("timeout", delay_s=1.0) as endpoint:
        with pytest.raises(SimulatorError, match="Timeout"):
            fast_simulator(endpoint.url, timeout_s=0.2, max_retries=1).reply(TASK, [])
    assert endpoint.requests == 2


def test_endpoint_down_is_reported_as_connection_error():
    simulator = fast_simulator(f"http://127.0.0.1:{free_port()}/v1", max_retries=1)
    results = simulator.reply_many([(TASK, []), (TASK, [])])
    assert all(isinstance(r, SimulatorError) and "Connection" in str(r) for r in results)


def test_a_slow_drip_answer_is_cut_at_the_request_deadline_then_retried():
    """A byte every 50 ms keeps each socket read under timeout_s; the request as a whole is cut at timeout_s."""
    with MisbehavingEndpoint("drip", failures=1) as endpoint:
        simulator = fast_simulator(endpoint.url, timeout_s=1.0, max_retries=1)
        start = time.monotonic()
        assert simulator.reply(TASK, []) == "Small coffee is 2 dollars."
    assert endpoint.requests == 2 and time.monotonic() - start < 4.0


def test_an_answer_past_the_size_cap_is_not_read_whole_and_is_reported():
    with MisbehavingEndpoint("huge") as endpoint:
        with pytest.raises(SimulatorError, match="passed .* bytes|announces .* bytes"):
            fast_simulator(endpoint.url, max_tokens=256, max_retries=1).reply(TASK, [])
    assert endpoint.requests == 2


def test_a_reply_of_more_tokens_than_asked_is_retried_then_reported():
    with MisbehavingEndpoint("overlong") as endpoint:
        with pytest.raises(SimulatorError, match="5000 completion tokens for max_tokens=256"):
            fast_simulator(endpoint.url, max_tokens=256, max_retries=1).reply(TASK, [])
    assert endpoint.requests == 2


def test_a_reply_with_a_lone_surrogate_is_stored_with_a_replacement_character(tmp_path):
    from sweet_jax import jsonl
    with MisbehavingEndpoint("surrogate") as endpoint:
        reply = fast_simulator(endpoint.url).reply(TASK, [])
    assert reply == "caf\ufffde"
    jsonl.write(tmp_path / "t.jsonl", [{"content": reply}])  # a UTF-8 file can hold it


def test_rejected_request_gets_no_response_like_the_official_simulator():
    with MisbehavingEndpoint("http400") as endpoint:
        assert fast_simulator(endpoint.url).reply(TASK, []) == NO_RESPONSE
    assert endpoint.requests == 1  # not retried


def test_concurrency_is_bounded():
    in_flight, peak, lock = [0], [0], threading.Lock()

    class CountingClient:
        class chat:  # noqa: N801 — mimics client.chat.completions.create
            class completions:  # noqa: N801
                @staticmethod
                def create(**kw):
                    with lock:
                        in_flight[0] += 1
                        peak[0] = max(peak[0], in_flight[0])
                    time.sleep(0.05)
                    with lock:
                        in_flight[0] -= 1
                    import openai.types.chat as t
                    return t.ChatCompletion.model_validate(completion_body("ok"))

    simulator = OpenAISimulator("", "sim", client=CountingClient(), concurrency=3)
    assert simulator.reply_many([(TASK, [])] * 12) == ["ok"] * 12
    assert 1 < peak[0] <= 3


class RecordingSampler:
    """Stands in for sweet_jax.sampling.generate.Sampler.chat: records calls, returns one Sample-like per prompt."""

    def __init__(self):
        self.calls = []

    def chat(self, conversations, **kwargs):
        self.calls.append((conversations, kwargs))
        return [[type("Sample", (), {"text": f"reply {i}"})()] for i in range(len(conversations))]


def test_model_simulator_answers_a_batch_in_one_greedy_sampler_call():
    sampler = RecordingSampler()
    simulator = ModelSimulator(sampler, max_new_tokens=40)
    dialogues = [[{"role": "user", "content": f"task {i}"}, {"role": "assistant", "content": "Q?"}] for i in range(3)]
    assert simulator.reply_many([(TASK, d) for d in dialogues]) == ["reply 0", "reply 1", "reply 2"]
    (conversations, kwargs), = sampler.calls
    assert kwargs["temperature"] == 0.0 and kwargs["max_new_tokens"] == 40
    assert conversations[1] == simulator_messages(TASK, dialogues[1])


def test_model_simulator_failure_fails_its_episodes_not_the_run():
    class Broken:
        def chat(self, conversations, **kwargs):
            raise RuntimeError("out of memory")

    results = ModelSimulator(Broken()).reply_many([(TASK, []), (TASK, [])])
    assert all(isinstance(r, SimulatorError) and "out of memory" in str(r) for r in results)
