"""The frontend environment's turn rules, its simulators (request format against a local OpenAI-style endpoint,
retries, the scripted one), the CLIP-scored answers and the evaluation."""
import base64
import io
import json

import numpy as np
import pytest
from local_http import LocalServer, QuietHandler
from flax import nnx
from PIL import Image

from sweet_jax.envs.browser import Render
from sweet_jax.envs.clip_reward import ClipReward
from sweet_jax.envs.frontend import (FRONTEND_RESPONSE_CHAR_LIMIT, FrontendEnv, FrontendScorer,
                                     ScriptedDesignSimulator, Screens, VisionSimulator, describe_differences,
                                     frontend_evaluation)
from sweet_jax.envs.prompts import ANSWER_MARKER
from sweet_jax.envs.simulators import SimulatorError
from sweet_jax.models.clip import CLIPVision, CLIPVisionConfig

WANTED = ("<html><head><style>body { background: #fdf6ec; color: #4a3222; }</style></head><body>"
          "<header><h1>Crumb &amp; Crust</h1></header><main><p>Fresh bread</p></main><footer>12 Mill Lane</footer>"
          "</body></html>")
TASK = {"problem_description": "A bakery homepage.", "ground_truth": WANTED}


def png(colour, size=(64, 48)):
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


class ColourPool:
    """Stands in for the browser pool: a page 'renders' to a solid colour named in its first <p>, or fails."""

    def __init__(self):
        self.rendered = []

    def render_many(self, pages):
        self.rendered += pages
        out = []
        for page in pages:
            if page is None:
                out.append(Render(None, "no html"))
            elif "FAIL" in page:
                out.append(Render(None, "time limit"))
            else:
                colour = page.split("<p>")[1].split("<")[0] if "<p>" in page else "white"
                out.append(Render(png(colour if colour in ("red", "blue", "white") else "white")))
        return out


# --- environment ------------------------------------------------------------------------------------------

def test_latest_page_is_the_answer_and_the_marker_ends_the_episode():
    env = FrontendEnv(TASK, ScriptedDesignSimulator())
    assert env.step("What colours do you like?") is False
    assert env.answer == "No answer"
    env.step("Draft: <html><body><p>one</p></body></html>")
    env.step("Any more wishes?")  # no page in this turn: the last page stays the answer
    assert env.answer == "<html><body><p>one</p></body></html>"
    assert env.step(f"{ANSWER_MARKER} <html><body><p>two</p></body></html>") is True
    assert env.answer == "<html><body><p>two</p></body></html>" and env.turns == 4


def test_tenth_agent_turn_ends_the_episode_and_replies_are_cut_to_1000_characters():
    env = FrontendEnv(TASK, ScriptedDesignSimulator())
    env.act("<body><p>draft</p></body>")
    env.observe("x" * 5000)
    assert len(env.dialogue_history[-1]["content"]) == FRONTEND_RESPONSE_CHAR_LIMIT == 1000
    for _ in range(8):
        assert env.step("Tell me more.") is False
    assert env.step("Still asking.") is True and env.turns == 10
    assert env.answer == "<body><p>draft</p></body>"


def test_output_marker_keeps_only_the_text_after_it():
    env = FrontendEnv(TASK)
    env.act("thinking <html><p>no</p></html> OUTPUT: <html><p>yes</p></html>")
    assert env.answer == "<html><p>yes</p></html>"


# --- the vision-language simulator against a local OpenAI-style endpoint ----------------------------------

class ChatEndpoint(LocalServer):
    """POST /v1/chat/completions on 127.0.0.1: records each request body; the first `failures` get HTTP 500."""

    def __init__(self, reply="Make the header brown.", failures=0):
        self.bodies, self.paths = [], []
        endpoint = self

        class Handler(QuietHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                endpoint.bodies.append(body)
                endpoint.paths.append(self.path)
                if len(endpoint.bodies) <= failures:
                    return self._send(500, {"error": {"message": "overloaded"}})
                self._send(200, {"id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
                                 "choices": [{"index": 0, "finish_reason": "stop",
                                              "message": {"role": "assistant", "content": reply}}]})

            def _send(self, code, obj):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        super().__init__(Handler)
        self.start()


@pytest.fixture
def endpoint():
    made = []

    def make(**kw):
        made.append(ChatEndpoint(**kw))
        return made[-1]
    yield make
    for e in made:
        e.close()


def vision_simulator(base_url, screens=None, **kw):
    return VisionSimulator(screens or Screens(ColourPool()), base_url, "qwen2-vl", timeout_s=5.0, max_retries=2,
                           backoff_s=0.01, max_backoff_s=0.02, **kw)


def image_bytes(part):
    assert part["type"] == "image_url"
    prefix, data = part["image_url"]["url"].split(",", 1)
    assert prefix == "data:image/png;base64"
    return base64.b64decode(data)


def test_vision_request_holds_instruction_draft_and_wanted_page(endpoint):
    server = endpoint()
    wanted = {**TASK, "ground_truth": "<html><body><p>blue</p></body></html>"}
    env = FrontendEnv(wanted, vision_simulator(server.url))
    env.step("Here is a draft: <html><body><p>red</p></body></html>")
    assert env.dialogue_history[-1] == {"role": "user", "content": "Make the header brown."}
    (body,) = server.bodies
    assert server.paths == ["/v1/chat/completions"]
    assert body["model"] == "qwen2-vl" and body["temperature"] == 0.0
    (message,) = body["messages"]  # stateless: one user message, no history
    assert message["role"] == "user"
    kinds = [part["type"] for part in message["content"]]
    assert kinds == ["text", "text", "image_url", "text", "image_url"]
    assert "A bakery homepage." in message["content"][0]["text"]
    assert image_bytes(message["content"][2]) == png("red")
    assert image_bytes(message["content"][4]) == png("blue")


def test_vision_request_without_a_draft_says_so(endpoint):
    server = endpoint()
    env = FrontendEnv(TASK, vision_simulator(server.url))
    env.step("What is the page about?")
    parts = server.bodies[0]["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["text", "text", "text", "image_url"]
    assert "not shown you a draft" in parts[1]["text"]


def test_reference_page_is_rendered_once_per_task(endpoint):
    server = endpoint()
    pool = ColourPool()
    simulator = vision_simulator(server.url, Screens(pool))
    simulator.reply_many([(TASK, [{"role": "assistant", "content": "q?"}])] * 3)
    assert pool.rendered.count(WANTED) == 1


def test_server_errors_are_retried(endpoint):
    server = endpoint(failures=2)
    assert vision_simulator(server.url).reply(TASK, [{"role": "assistant", "content": "q?"}]) == \
        "Make the header brown."
    assert len(server.bodies) == 3


def test_persistent_failure_fails_only_its_episode(endpoint):
    server = endpoint(failures=10 ** 6)
    (result,) = vision_simulator(server.url).reply_many([(TASK, [{"role": "assistant", "content": "q?"}])])
    assert isinstance(result, SimulatorError) and "failed after 3 attempt(s)" in str(result)


def test_a_reference_that_does_not_render_is_a_simulator_error(endpoint):
    server = endpoint()
    broken = {**TASK, "ground_truth": "<html><p>FAIL</p></html>"}
    with pytest.raises(SimulatorError, match="reference page did not render"):
        vision_simulator(server.url).reply(broken, [{"role": "assistant", "content": "q?"}])
    assert server.bodies == []


# --- the scripted simulator -------------------------------------------------------------------------------

def test_scripted_feedback_names_missing_texts_colours_and_order():
    draft = ("<html><body style='background: #ffffff'><main><p>Fresh bread</p></main><header><h1>Bakery</h1>"
             "</header></body></html>")
    feedback = describe_differences(draft, WANTED)
    assert "'Crumb & Crust'" in feedback and "'12 Mill Lane'" in feedback   # missing texts
    assert "'Bakery'" in feedback                                            # extra text
    assert "'#fdf6ec'" in feedback and "'#ffffff'" in feedback               # colours wanted / used
    assert "header, h1, main, footer" in feedback                            # the order of the parts


def test_scripted_feedback_on_no_draft_and_on_the_same_page():
    assert "not shown me a page" in describe_differences(None, WANTED)
    assert describe_differences(WANTED, WANTED) == "That looks exactly like the page I want."


# --- reward and evaluation --------------------------------------------------------------------------------

def test_scorer_gives_the_clip_cosine_of_the_renders():
    clip = ClipReward(CLIPVision(CLIPVisionConfig.tiny(), rngs=nnx.Rngs(0)), batch_size=4)
    scorer = FrontendScorer(Screens(ColourPool()), clip)
    blue = {**TASK, "ground_truth": "<html><p>blue</p></html>"}
    scores = scorer.score_many([(blue, "<html><p>blue</p></html>"), (blue, "<html><p>red</p></html>"),
                                (blue, "No answer"), ({**TASK, "ground_truth": "<p>FAIL</p>"}, "<p>red</p>")])
    assert [s.status for s in scores] == ["ok", "ok", "ok", "reference_not_rendered"]
    assert scores[0].reward == pytest.approx(1.0, abs=1e-5)
    expected = clip([png("red"), None], [png("blue"), png("blue")])  # no page scores as a black square
    np.testing.assert_allclose([scores[1].reward, scores[2].reward], expected, atol=1e-6)


def test_evaluation_reports_mean_cosine_and_win_rate():
    def record(task, sample, reward):
        return {"reward": reward, "rollout": {"task_id": task, "sample": sample}}
    ours = [record("a", 0, 0.9), record("b", 0, 0.5), record("c", 0, 0.7), record("d", 0, 0.6)]
    reference = [record("a", 0, 0.8), record("b", 0, 0.6), record("c", 0, 0.7)]
    result = frontend_evaluation(ours, reference)
    assert result["mean_cosine"] == pytest.approx(0.675)
    assert result["compared"] == 3 and result["win_rate"] == pytest.approx((1 + 0 + 0.5) / 3)
