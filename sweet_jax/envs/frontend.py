"""ColBench frontend design: the environment, its human simulators, the CLIP reward and the evaluation.

An episode: the user states the idea of a page (problem_description). Each agent turn may hold a page
(`<html>...</html>`, else `<body>...</body>`); the simulated human looks at the render of the agent's latest page
next to the render of the page they want (the task's ground-truth HTML) and says what differs, in at most
1000 characters. "I WANT TO ANSWER:" ends the episode, as do 10 agent turns. The answer is the agent's latest
page; its reward is the CLIP cosine between its render and the ground truth's (sweet_jax.envs.clip_reward).

Simulators (the backend's `Simulator` interface, so rollouts batch them the same way):
- VisionSimulator: a vision-language model behind any OpenAI-compatible endpoint (vLLM serving Qwen2-VL as in
  the paper), shown both screenshots as base64 PNG image parts; stateless: one user message per reply.
- ScriptedDesignSimulator: no model; compares the two pages' HTML (visible texts, colours, order of the page's
  parts) and names the first differences. For tests and the CPU demo.
"""
from __future__ import annotations

import base64
import dataclasses
import hashlib
import html.parser
import re
import threading
from typing import Any, Sequence

import numpy as np
from flax import nnx

from sweet_jax.data.frontend import extract_html
from sweet_jax.envs.browser import RendererPool
from sweet_jax.envs.clip_reward import ClipReward
from sweet_jax.envs.colbench import ColBenchEnv, task_field
from sweet_jax.envs.prompts import ANSWER_MARKER
from sweet_jax.envs.simulators import OpenAISimulator, Simulator, SimulatorError
from sweet_jax.models.clip import CLIPVision, CLIPVisionConfig, load_clip_hf

FRONTEND_RESPONSE_CHAR_LIMIT = 1000   # the official frontend simulator's reply limit

FRONTEND_AGENT_PROMPT = """You are an LLM agent building a web page for a human user.
1) The user has a particular page in mind and can only describe it; ask them short questions, and show them
drafts, to find out how it should look.
2) To show a draft, write the whole page in HTML (with inline CSS) between <html> and </html> in your reply;
the user will see it rendered in a browser and tell you how it differs from what they want.
3) For every picture use the placeholder http://placeholder.invalid/WIDTHxHEIGHT.png, e.g.
http://placeholder.invalid/400x300.png; no other pictures or outside resources are available.
4) When the page is ready, begin your reply with "I WANT TO ANSWER:" followed by the final HTML page.
5) You have at most 10 rounds of conversation with the user; your latest page is your answer."""

VISION_SIMULATOR_PROMPT = """You are a person who asked an LLM agent to build a web page, described as:
{problem_description}

You have the finished page in mind; it is the second image below. The agent may have shown you a draft (the
first image). Compare the draft with the page you want and tell the agent, as a person would, what to change:
layout, colours, texts, pictures, sizes. Name the most important differences first and keep it short. Never
write HTML or CSS yourself. If there is no draft yet, describe the page you want in a few sentences."""


# ----------------------------------------------------------------------------------------------------------
# Environment
# ----------------------------------------------------------------------------------------------------------

class FrontendEnv(ColBenchEnv):
    """One design episode: the backend's turn rules; the answer is the agent's latest page (HTML)."""

    reply_char_limit = FRONTEND_RESPONSE_CHAR_LIMIT

    def take_answer(self, parsed) -> None:
        page = extract_html(parsed.content)
        if page is not None:
            self.answer = page
        self.done = parsed.answer is not None  # the answer marker, or the last turn


def latest_page(dialogue: Sequence[dict]) -> str | None:
    """The page in the agent's last turn (what the human is shown), or None."""
    for turn in reversed(dialogue):
        if turn["role"] == "assistant":
            return extract_html(turn["content"])
    return None


# ----------------------------------------------------------------------------------------------------------
# Screenshots (shared by the simulators and the reward): reference pages rendered once per task
# ----------------------------------------------------------------------------------------------------------

class Screens:
    """A renderer pool plus a cache of the reference pages' screenshots (keyed by the HTML's hash)."""

    def __init__(self, pool):
        self.pool = pool
        self._references: dict[str, Any] = {}
        self._lock = threading.Lock()

    def pages(self, pages: Sequence[str | None]) -> list:
        return self.pool.render_many(list(pages))

    def references(self, tasks: Sequence[Any]) -> list:
        htmls = [str(task_field(t, "ground_truth", "")) for t in tasks]
        keys = [hashlib.sha1(h.encode()).hexdigest() for h in htmls]
        # One lock over check, render and fill: concurrent episodes of a task render its reference once.
        with self._lock:
            missing = {k: h for k, h in zip(keys, htmls) if k not in self._references}
            fresh = dict(zip(missing, self.pool.render_many(list(missing.values())))) if missing else {}
            # A failed render is not cached: the next episode of the task tries again.
            self._references.update({k: r for k, r in fresh.items() if r.png is not None})
            return [self._references.get(k) or fresh[k] for k in keys]


# ----------------------------------------------------------------------------------------------------------
# Simulators
# ----------------------------------------------------------------------------------------------------------

def png_data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def vision_messages(task: Any, agent_png: bytes | None, reference_png: bytes,
                    template: str = VISION_SIMULATOR_PROMPT) -> list[dict]:
    """The one user message a vision-language simulator answers: instruction, the agent's draft, the wanted page."""
    parts = [{"type": "text", "text": template.format(problem_description=task_field(task, "problem_description", ""))}]
    if agent_png is not None:
        parts += [{"type": "text", "text": "The agent's draft:"},
                  {"type": "image_url", "image_url": {"url": png_data_url(agent_png)}}]
    else:
        parts += [{"type": "text", "text": "The agent has not shown you a draft."}]
    parts += [{"type": "text", "text": "The page you want:"},
              {"type": "image_url", "image_url": {"url": png_data_url(reference_png)}}]
    return [{"role": "user", "content": parts}]


class VisionSimulator(Simulator):
    """A vision-language model compares screenshots, behind an OpenAI-compatible endpoint (retries and back-off
    as the backend's OpenAISimulator; a request that still fails is a SimulatorError for its episode only)."""

    def __init__(self, screens: Screens, base_url: str, model: str, *, max_tokens: int = 512,
                 template: str = VISION_SIMULATOR_PROMPT, **endpoint_kwargs):
        self.screens, self.template = screens, template
        self.endpoint = OpenAISimulator(base_url, model, max_tokens=max_tokens, **endpoint_kwargs)
        self.concurrency = self.endpoint.concurrency

    def reply(self, task, dialogue):
        page = latest_page(dialogue)
        agent_png = self.screens.pages([page])[0].png if page is not None else None
        (reference,) = self.screens.references([task])
        if reference.png is None:
            raise SimulatorError(f"the task's reference page did not render ({reference.error})")
        return self.endpoint.complete(vision_messages(task, agent_png, reference.png, self.template))

    def close(self):
        self.endpoint.close()


_COLOUR = re.compile(r"#[0-9a-fA-F]{3,8}\b|rgba?\([^)]*\)")
_PARTS = {"header", "nav", "main", "section", "article", "aside", "footer", "form", "table", "img", "ul", "ol",
          "h1", "h2", "h3", "button"}


class _PageOutline(html.parser.HTMLParser):
    """What a person notices in a page: visible texts in order, colours, and the order of its main parts."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.texts, self.colours, self.parts = [], [], []
        self._hidden = 0

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style", "head", "title"):
            self._hidden += 1
        if tag in _PARTS:
            self.parts.append(tag)
        for name, value in attrs:
            if name == "style" and value:
                self.colours += _COLOUR.findall(value)

    def handle_endtag(self, tag):
        if tag in ("script", "style", "head", "title") and self._hidden:
            self._hidden -= 1

    def handle_data(self, data):
        if self.lasttag == "style":
            self.colours += _COLOUR.findall(data)
        text = " ".join(data.split())
        if text and not self._hidden:
            self.texts.append(text)


def page_outline(page: str) -> _PageOutline:
    outline = _PageOutline()
    outline.feed(page)
    outline.close()
    return outline


def _listing(items, limit=3) -> str:
    return ", ".join(f"'{item}'" for item in list(dict.fromkeys(items))[:limit])


def describe_differences(agent_page: str | None, wanted_page: str) -> str:
    """A person's feedback on the agent's page, from the two pages' HTML: first the missing or extra texts,
    then the colours, then the order of the page's parts."""
    want = page_outline(wanted_page)
    if agent_page is None:
        return (f"You have not shown me a page yet. It should say {_listing(want.texts, 4)}, in the colours "
                f"{_listing(want.colours, 3) or 'of a plain page'}, with these parts in order: "
                f"{', '.join(want.parts[:8]) or 'just text'}.")
    got = page_outline(agent_page)
    remarks = []
    missing = [t for t in want.texts if t not in got.texts]
    extra = [t for t in got.texts if t not in want.texts]
    if missing:
        remarks.append(f"My page also says {_listing(missing)}.")
    if extra:
        remarks.append(f"Please drop {_listing(extra)}; that is not on my page.")
    want_colours = {c.lower().replace(" ", "") for c in want.colours}
    got_colours = {c.lower().replace(" ", "") for c in got.colours}
    if want_colours != got_colours:
        remarks.append(f"The colours should be {_listing(sorted(want_colours)) or 'the browser defaults'}, "
                       f"not {_listing(sorted(got_colours - want_colours)) or 'what you used'}.")
    if want.parts != got.parts:
        remarks.append(f"The parts should come in this order: {', '.join(want.parts[:10]) or 'plain text'}.")
    return " ".join(remarks) if remarks else "That looks exactly like the page I want."


class ScriptedDesignSimulator(Simulator):
    """Feedback computed from the HTML of the agent's latest page and of the task's page (no model, no images)."""

    def reply(self, task, dialogue):
        return describe_differences(latest_page(dialogue), str(task_field(task, "ground_truth", "")))


# ----------------------------------------------------------------------------------------------------------
# Reward and evaluation
# ----------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class DesignScore:
    """One answer's reward, in the shape rollout() reads from an evaluator (status 'ok' or why not)."""
    reward: float | None
    status: str = "ok"
    details: str = ""


class FrontendScorer:
    """Rewards of frontend answers: CLIP cosine between the answer's render and the reference's (a missing render
    scores as a black square). A reference page that does not render fails its episode instead."""

    def __init__(self, screens: Screens, clip_reward):
        self.screens, self.clip_reward = screens, clip_reward

    def score_many(self, requests: Sequence[tuple[Any, str]]) -> list[DesignScore]:
        if not requests:
            return []
        tasks = [t for t, _ in requests]
        references = self.screens.references(tasks)
        answers = self.screens.pages([extract_html(str(a)) if a else None for _, a in requests])
        ok = [i for i, r in enumerate(references) if r.png is not None]
        cosines = self.clip_reward([answers[i].png for i in ok], [references[i].png for i in ok])
        scores = [DesignScore(None, "reference_not_rendered", str(r.error)) for r in references]
        for i, cosine in zip(ok, cosines):
            scores[i] = DesignScore(float(cosine), "ok", answers[i].error or "")
        return scores


def frontend_evaluation(records: Sequence[dict], reference_records: Sequence[dict] | None = None) -> dict:
    """Mean CLIP cosine of `records`, and their win rate against a reference policy's answers to the same tasks
    (matched by rollout.task_id and sample; a win is a strictly higher cosine, a tie counts half)."""
    rewards = np.array([r["reward"] for r in records if r.get("reward") is not None], np.float64)
    result = {"episodes": len(records), "mean_cosine": float(rewards.mean()) if rewards.size else None}
    if reference_records is not None:
        key = lambda r: ((r.get("rollout") or {}).get("task_id"), (r.get("rollout") or {}).get("sample"))  # noqa: E731
        reference = {key(r): r["reward"] for r in reference_records if r.get("reward") is not None}
        outcomes = [1.0 if r["reward"] > reference[key(r)] else 0.5 if r["reward"] == reference[key(r)] else 0.0
                    for r in records if r.get("reward") is not None and key(r) in reference]
        result.update(compared=len(outcomes), win_rate=float(np.mean(outcomes)) if outcomes else None)
    return result


# ----------------------------------------------------------------------------------------------------------
# The track's pieces from a config, and scripted demonstrations
# ----------------------------------------------------------------------------------------------------------

class FrontendTrack:
    """What a frontend rollout needs besides the policy: browsers, a simulator, the CLIP scorer."""

    def __init__(self, frontend, simulator, *, seed: int = 0):
        self.pool = RendererPool(frontend.renderers, time_limit_s=frontend.page_time_limit_s)
        self.screens = Screens(self.pool)
        clip = (load_clip_hf(frontend.clip_path) if frontend.clip_path
                else CLIPVision(CLIPVisionConfig.tiny(), rngs=nnx.Rngs(seed)))
        self.scorer = FrontendScorer(self.screens, ClipReward(clip, batch_size=frontend.clip_batch_size))
        s = simulator
        if s.kind in ("scripted", "design_scripted"):
            self.simulator = ScriptedDesignSimulator()
        elif s.kind in ("openai", "vision"):
            self.simulator = VisionSimulator(self.screens, s.base_url, s.model, api_key=s.api_key,
                                             timeout_s=s.timeout_s, max_retries=s.max_retries,
                                             concurrency=s.concurrency, max_tokens=s.max_tokens)
        else:
            raise SimulatorError(f"simulator.kind={s.kind!r} for the frontend track: use scripted (feedback from "
                                 "the pages' HTML) or openai (a vision-language model behind an endpoint)")

    def close(self):
        self.simulator.close()
        self.pool.close()


def degraded_pages(page: str, rng) -> list[tuple[str, str]]:
    """(name, page) drafts of decreasing fidelity to `page`: the page itself, without its colours, with half of
    its body, and empty. Scripted agents answer with them so the offline set has rewards that differ."""
    no_colour = _COLOUR.sub("inherit", page)
    body_start, body_end = page.find("<body"), page.rfind("</body>")
    if 0 <= body_start < body_end:
        cut = body_start + int((body_end - body_start) * rng.uniform(0.3, 0.6))
        half = page[:cut] + page[body_end:]
    else:
        half = page[: len(page) // 2]
    return [("exact", page), ("no_colour", no_colour), ("half", half), ("empty", "<html><body></body></html>")]


def scripted_design_trajectories(tasks: Sequence[Any], scorer: FrontendScorer, *, per_task: int,
                                 seed: int = 0) -> list[dict]:
    """per_task episodes a task by scripted agents: one question answered by the scripted simulator, then a draft
    from degraded_pages (drawn at random), given as the answer; scored by `scorer`."""
    rng = np.random.default_rng(seed)
    simulator = ScriptedDesignSimulator()
    episodes = []
    for task in tasks:
        drafts = degraded_pages(str(task_field(task, "ground_truth", "")), rng)
        for _ in range(per_task):
            name, draft = drafts[int(rng.integers(len(drafts)))]
            env = FrontendEnv(task, simulator, max_turns=10)
            env.step("Could you describe the page you have in mind?")
            env.step(f"{ANSWER_MARKER}\n{draft}")
            episodes.append((env, name))
    scores = scorer.score_many([(env.task, env.answer) for env, _ in episodes])
    return [dict(env.trajectory(reward=score.reward), scripted_agent=name)
            for (env, name), score in zip(episodes, scores) if score.status == "ok"]
