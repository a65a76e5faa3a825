"""Rollouts: batched episodes, incremental resumable output, failed episodes recorded, CLI against our server."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from local_http import LocalServer, QuietHandler

from sweet_jax.rl import episodes as collect
from sweet_jax.envs import ANSWER_MARKER, OpenAISimulator, ScriptedSimulator

REPO = pathlib.Path(__file__).resolve().parents[1]


def make_tasks(n):
    return [{"problem_description": f"Task {i}: write f(x) returning x plus my number.",
             "ground_truth": f"def f(x):\n    return x + {i}", "test_cases": {"a": "f(1)", "b": "f(2)"},
             "hidden_information": f"My number is {i}."} for i in range(n)]


def asking_then_answering_policy(messages):
    """Asks twice, then answers with the number the human gave (correct unless the human said nothing)."""
    asked = sum(m["role"] == "assistant" for m in messages)
    if asked < 2:
        return f"Question {asked + 1}: what is your number?"
    number = messages[-1]["content"].split()[-1].rstrip(".")
    return f"{ANSWER_MARKER}\ndef f(x):\n    return x + {number}"


def keys_of(path):
    return [(r["rollout"]["task_index"], r["rollout"]["sample"]) for r in collect.read_records(path)]


def test_rollout_writes_official_trajectories_with_rewards(tmp_path):
    from sweet_jax.data.loading import load_trajectories

    out = tmp_path / "traj.jsonl"
    tasks = make_tasks(5)
    from sweet_jax.sandbox import Evaluator

    tasks[4]["ground_truth"] = "def f(x):\n    return x - 4"  # the policy's answer fails this one
    with Evaluator(workers=2, timeout_s=5.0) as evaluator:
        summary = collect.rollout(tasks, collect.FunctionPolicy(asking_then_answering_policy),
                                      ScriptedSimulator(), out, best_of=2, batch_size=3, evaluator=evaluator,
                                      progress=False)
    assert sorted(keys_of(out)) == [(i, s) for i in range(5) for s in range(2)]
    loaded = load_trajectories(out)
    assert len(loaded) == 10
    assert all(t.reward == (0.0 if t.extra["rollout"]["task_index"] == 4 else 1.0) for t in loaded)
    first = collect.read_records(out)[0]
    assert first["task"] == tasks[first["rollout"]["task_index"]]
    assert [d["role"] for d in first["dialogue_history"]] == ["user", "assistant", "user", "assistant", "user",
                                                              "assistant"]
    assert summary == {"episodes": 10, "failed_episodes": 0, "success_rate": 0.8, "tests_passed_pct": 80.0,
                       "mean_reward": 0.8, "turns_per_episode": 3.0}
    assert json.loads(collect.summary_path(out).read_text()) == summary


class Crash(Exception):
    pass


def test_rerun_after_a_crash_completes_without_duplicates(tmp_path):
    out = tmp_path / "traj.jsonl"
    tasks = make_tasks(7)
    policy = collect.FunctionPolicy(asking_then_answering_policy)
    batches = []

    def crash_after_two_batches(n):
        batches.append(n)
        if len(batches) == 2:
            raise Crash

    with pytest.raises(Crash):
        collect.rollout(tasks, policy, ScriptedSimulator(), out, best_of=2, batch_size=4, progress=False,
                            on_batch=crash_after_two_batches)
    assert len(keys_of(out)) == 8
    with open(out, "a") as f:  # a write the crash cut short
        f.write('{"task": {"problem_desc')
    summary = collect.rollout(tasks, policy, ScriptedSimulator(), out, best_of=2, batch_size=4, progress=False)
    keys = keys_of(out)
    assert sorted(keys) == [(i, s) for i in range(7) for s in range(2)] and len(set(keys)) == len(keys)
    assert summary["episodes"] == 14


def test_resume_refuses_an_output_written_for_other_tasks(tmp_path):
    out = tmp_path / "traj.jsonl"
    policy = collect.FunctionPolicy(asking_then_answering_policy)
    collect.rollout(make_tasks(2), policy, ScriptedSimulator(), out, progress=False)
    other = make_tasks(3)[1:]
    with pytest.raises(collect.RolloutError, match="other tasks"):
        collect.rollout(other, policy, ScriptedSimulator(), out, progress=False)


class PoisonEndpoint(LocalServer):
    """Chat endpoint: HTTP 500 when the request mentions POISON, a malformed body for GARBLED, else a reply."""

    def __init__(self):
        endpoint = self
        self.requests = 0

        class Handler(QuietHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0))).decode()
                endpoint.requests += 1
                if "POISON" in body:
                    code, payload = 500, b'{"error": {"message": "simulator crashed"}}'
                elif "GARBLED" in body:
                    code, payload = 200, b'{"choices": [{"message": {"content": '
                else:
                    code, payload = 200, json.dumps({
                        "id": "x", "object": "chat.completion", "created": 0, "model": "sim",
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": "My number is 3."}}]}).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        super().__init__(Handler)
        self.start()


def test_failed_simulator_episodes_are_recorded_with_reason_and_the_run_goes_on(tmp_path):
    out = tmp_path / "traj.jsonl"
    tasks = make_tasks(4)
    tasks[1]["problem_description"] += " POISON"
    tasks[2]["hidden_information"] += " GARBLED"
    endpoint = PoisonEndpoint()
    try:
        simulator = OpenAISimulator(endpoint.url, "sim", max_retries=2, backoff_s=0.01, timeout_s=5)
        summary = collect.rollout(tasks, collect.FunctionPolicy(asking_then_answering_policy), simulator,
                                      out, batch_size=4, progress=False)
    finally:
        endpoint.close()
    assert sorted(keys_of(out)) == [(0, 0), (3, 0)]
    failures = {r["task_index"]: r for r in collect.read_records(collect.failures_path(out))}
    assert sorted(failures) == [1, 2]
    assert "simulator" in failures[1]["reason"] and "InternalServerError" in failures[1]["reason"]
    assert "after 3 attempt" in failures[2]["reason"]
    assert failures[1]["dialogue_history"][1]["role"] == "assistant"  # what happened before the failure is kept
    assert summary["episodes"] == 2 and summary["failed_episodes"] == 2
    # A rerun retries only the failed episodes (here the endpoint is gone: they fail again, nothing is duplicated).
    simulator = OpenAISimulator(endpoint.url, "sim", max_retries=0, timeout_s=2)
    summary = collect.rollout(tasks, collect.FunctionPolicy(asking_then_answering_policy), simulator, out,
                                  progress=False)
    assert summary["failed_episodes"] == 2 and sorted(keys_of(out)) == [(0, 0), (3, 0)]


# --- the CLI against the project's own OpenAI-compatible server --------------------------------------------------

@pytest.fixture(scope="module")
def simulator_server(tmp_path_factory):
    """`sweet_jax.serve` on 127.0.0.1 over a tiny random HF Llama with the demo tokenizer."""
    from tiny import make_hf_llama

    from sweet_jax.data import demo, tokenizers
    from sweet_jax.sampling.server import load_model_sampler, start_server

    tok_dir = demo.paths().tokenizer
    vocab = len(tokenizers.load_tokenizer(tok_dir))
    model_dir = make_hf_llama(tmp_path_factory.mktemp("sim") / "model", "llama31", vocab_size=vocab,
                              max_position_embeddings=2048)
    server = start_server(load_model_sampler(str(model_dir), tokenizer=str(tok_dir)), model_name="tiny-sim")
    yield server
    server.close()


def rollout_cli(out, server_url, *extra):
    return [sys.executable, "-m", "sweet_jax.rollout", "--config", "configs/rollout.py:demo_server",
            f"--config.simulator.base_url={server_url}", "--config.simulator.model=tiny-sim",
            f"--config.output={out}", "--config.num_tasks=4", "--config.best_of=2", "--config.batch_size=2",
            "--config.max_turns=2", "--config.sampling.max_new_tokens=8", "--config.simulator.max_tokens=12",
            "--config.sandbox.workers=1", "--config.progress=False", *extra]


@pytest.mark.slow
def test_cli_rollout_against_our_server_survives_sigkill_and_resumes(tmp_path, simulator_server):
    from sweet_jax.data.loading import load_trajectories

    out = tmp_path / "traj.jsonl"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)   # the command line as a user runs it (one device, XLA's optimisation)
    first = subprocess.Popen(rollout_cli(out, simulator_server.url), cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and first.poll() is None and len(keys_of(out)) < 2:
        time.sleep(0.2)
    still_running = first.poll() is None
    first.send_signal(signal.SIGKILL)
    log = first.communicate()[0].decode(errors="replace")
    assert still_running, f"the rollout finished (or died) before it could be killed midway:\n{log[-3000:]}"
    written = keys_of(out)
    assert 2 <= len(written) < 8

    second = subprocess.run(rollout_cli(out, simulator_server.url), cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=300)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    keys = keys_of(out)
    assert sorted(keys) == [(i, s) for i in range(4) for s in range(2)], keys
    assert len(set(keys)) == len(keys) and keys[:len(written)] == written  # appended, nothing rewritten
    trajectories = load_trajectories(out)
    assert all(t.reward is not None and 0.0 <= t.reward <= 1.0 for t in trajectories)
    for t in trajectories:
        replies = [d for d in t.dialogue_history if d.role == "assistant"]
        assert 1 <= len(replies) <= 2 and all(d.input.startswith("<|begin_of_text|>") for d in replies)
        humans = [d for d in t.dialogue_history[1:] if d.role == "user"]
        assert len(humans) == len(replies) - 1 and all(len(h.content) <= 400 for h in humans)
    assert "8 episodes" in second.stdout and "success rate" in second.stdout
    assert json.loads(collect.summary_path(out).read_text())["episodes"] == 8
    assert simulator_server.app.engine.batch_sizes, "the simulator server was never asked"


def test_the_summary_names_the_failures_file_only_where_it_exists(tmp_path):
    from sweet_jax.rl.episodes import format_summary

    out = tmp_path / "traj.jsonl"
    summary = {"episodes": 4, "failed_episodes": 0, "success_rate": 0.5, "tests_passed_pct": 60.0,
               "turns_per_episode": 2.0}
    assert "(0 failed this run)" in format_summary(summary, out) and "failed.jsonl" not in format_summary(summary, out)
    collect.failures_path(out).write_text('{"task_index": 0}\n')
    assert f"see {out.name}.failed.jsonl" in format_summary(dict(summary, failed_episodes=1), out)
