"""The ColBench backend-programming environment (DESIGN.md section 2), rule for rule as the official one.

An episode: the user states the task (its problem_description). Each agent turn either asks a
question, which the human simulator answers from the hidden information (its reply cut to 400
characters), or contains "I WANT TO ANSWER:" followed by the final code, which ends the episode.
If a reply contains "OUTPUT:", only the text after the first "OUTPUT:" (up to a second one) counts.
The episode ends after at most `max_turns` agent turns; the last turn's reply is then the answer.

The environment is split into `act` (record the agent's reply) and `observe` (append the human's
reply) so that a rollout loop can batch the simulator calls of many episodes; `step` does both.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from sweet_jax.data.schema import task_field, task_json
from sweet_jax.envs.prompts import ANSWER_MARKER, HUMAN_RESPONSE_CHAR_LIMIT, OUTPUT_MARKER

NO_ANSWER = "No answer"  # the official environment's answer before the agent gives one


def hidden_information(task: Any) -> str:
    """What the simulated human knows: `hidden_information`, defaulting to the reference solution."""
    info = task_field(task, "hidden_information")
    return str(info if info else task_field(task, "ground_truth", ""))


@dataclasses.dataclass(frozen=True)
class AgentReply:
    content: str      # what enters the dialogue: the text after "OUTPUT:" when present
    raw: str          # the reply as generated, cut after a second "OUTPUT:" (the official `output`)
    answer: str | None  # the final code when the reply answers, else None


def parse_agent_reply(reply: str, *, last_turn: bool = False) -> AgentReply:
    """Apply the official parsing rules to one agent reply.

    "OUTPUT:" present: content = the text between the first and a second "OUTPUT:".
    "I WANT TO ANSWER:" anywhere in the content: answer = the text after it (up to a repeated marker).
    On the last turn a reply without the marker is the answer as a whole.
    """
    content, raw = reply, reply
    if OUTPUT_MARKER in reply:
        pieces = reply.split(OUTPUT_MARKER)
        content = pieces[1]
        raw = OUTPUT_MARKER.join(pieces[:2])
    if ANSWER_MARKER in content:
        answer = content.split(ANSWER_MARKER)[1]
    elif last_turn:
        answer = content
    else:
        answer = None
    return AgentReply(content=content, raw=raw, answer=answer)


class ColBenchEnv:
    """One backend-programming episode between an agent and a human simulator."""

    reply_char_limit = HUMAN_RESPONSE_CHAR_LIMIT  # the human's replies are cut to this many characters

    def __init__(self, task: Any, simulator=None, *, max_turns: int = 10):
        if max_turns < 1:
            raise ValueError(f"ColBenchEnv: max_turns must be >= 1, got {max_turns}")
        self.task = task
        self.simulator = simulator
        self.max_turns = max_turns
        self.reset()

    def reset(self) -> list[dict]:
        self.turns = 0          # agent turns taken
        self.done = False
        self.answer = NO_ANSWER
        self.dialogue_history: list[dict] = [
            {"role": "user", "content": str(task_field(self.task, "problem_description", ""))}]
        return self.messages()

    def messages(self) -> list[dict]:
        """The dialogue as chat messages (role, content) — what the agent is prompted with."""
        return [{"role": d["role"], "content": d["content"]} for d in self.dialogue_history]

    @property
    def awaiting_human(self) -> bool:
        return not self.done and self.dialogue_history[-1]["role"] == "assistant"

    def act(self, reply: str, *, prompt: str | None = None) -> bool:
        """Record the agent's reply; returns True when the episode is over (answer given or turns used up)."""
        if self.done:
            raise RuntimeError(f"{type(self).__name__}.act: the episode is over; call reset() for a new one")
        if self.awaiting_human:
            raise RuntimeError(f"{type(self).__name__}.act: the human has not replied to the previous turn yet "
                               "(observe)")
        self.turns += 1
        parsed = parse_agent_reply(reply, last_turn=self.turns >= self.max_turns)
        turn = {"role": "assistant", "content": parsed.content}
        if prompt is not None:  # the official record of what the agent saw and said, when known
            turn.update(input=prompt, output=parsed.raw)
        self.dialogue_history.append(turn)
        self.take_answer(parsed)
        return self.done

    def take_answer(self, parsed) -> None:
        """What a reply makes of the answer: the code after the answer marker ends the episode."""
        if parsed.answer is not None:
            self.answer = parsed.answer
            self.done = True

    def observe(self, human_reply: str) -> None:
        """Append the human's reply to the last agent turn, cut to the 400-character limit."""
        if not self.awaiting_human:
            raise RuntimeError(f"{type(self).__name__}.observe: no agent question is waiting for a human reply")
        self.dialogue_history.append({"role": "user", "content": str(human_reply)[:self.reply_char_limit]})

    def step(self, reply: str, *, prompt: str | None = None) -> bool:
        """act() and, when the episode goes on, ask the simulator and observe() its reply."""
        if self.act(reply, prompt=prompt):
            return True
        if self.simulator is None:
            raise RuntimeError("ColBenchEnv.step needs a simulator; pass one or use act()/observe()")
        self.observe(self.simulator.reply(self.task, self.messages()))
        return False

    def trajectory(self, reward: float | None = None) -> dict:
        """The episode in the official trajectory JSONL form."""
        record = {"task": task_json(self.task), "dialogue_history": [dict(d) for d in self.dialogue_history],
                  "answer": self.answer}
        if reward is not None:
            record["reward"] = float(reward)
        return record
