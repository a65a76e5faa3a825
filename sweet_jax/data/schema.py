"""ColBench records: backend tasks and trajectories, loaded from JSONL with validation.

Task (one JSON object a line): problem_description (str), ground_truth (str: reference Python source),
test_cases (object: name -> call expression), hidden_information (str, optional; defaults to ground_truth).

Trajectory: task (a task object), dialogue_history (list of turns), answer (str), reward (number, optional
until evaluated). A turn is {"role": "user" | "assistant" | "system", "content": str}; assistant turns of the
official offline file also hold `input` (the fully chat-templated prompt the agent saw) and `output` (its raw
reply), and may lack `content` (then `output` is the content). Both forms load.

Paths: anything etils.epath opens (local, gs://, ...), or tfds://colbench/<config>[/<split>] (see tfds_colbench).
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
from typing import Any

from sweet_jax import jsonl

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")


DataError = jsonl.DataError  # a malformed record; the message names file:line and field


@dataclasses.dataclass(frozen=True)
class Task:
    problem_description: str
    ground_truth: str
    test_cases: dict[str, str]
    hidden_information: str = ""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)

    def __post_init__(self):
        if not self.hidden_information:
            object.__setattr__(self, "hidden_information", self.ground_truth)

    @property
    def key(self) -> str:
        """Content hash grouping the trajectories of one task (file position is not identity)."""
        h = hashlib.sha1()
        for part in (self.problem_description, self.ground_truth):
            h.update(part.encode("utf-8"))
            h.update(b"\0")
        return h.hexdigest()[:16]

    def to_json(self) -> dict:
        return {**self.extra, "problem_description": self.problem_description,
                "ground_truth": self.ground_truth, "test_cases": dict(self.test_cases),
                "hidden_information": self.hidden_information}

    @classmethod
    def from_json(cls, obj, *, where: str = "", prefix: str = "") -> "Task":
        _require_object(obj, where, prefix.rstrip(".") or "")
        known = {"problem_description", "ground_truth", "test_cases", "hidden_information"}
        problem = _field(obj, "problem_description", str, where, prefix)
        truth = _field(obj, "ground_truth", str, where, prefix)
        cases = obj.get("test_cases", {})
        if not isinstance(cases, dict):
            raise DataError(f"must be an object mapping test name -> call expression, got "
                            f"{type(cases).__name__}", where=where, field=prefix + "test_cases")
        for name, call in cases.items():
            if not isinstance(call, str):
                raise DataError(f"must be a string (a call expression such as \"f(2, 3)\"), got "
                                f"{type(call).__name__}", where=where, field=f"{prefix}test_cases.{name}")
        hidden = obj.get("hidden_information")
        if hidden is not None and not isinstance(hidden, str):
            raise DataError(f"must be a string, got {type(hidden).__name__}", where=where,
                            field=prefix + "hidden_information")
        if not problem.strip():
            raise DataError("is empty", where=where, field=prefix + "problem_description")
        return cls(problem, truth, dict(cases), hidden or truth,
                   {k: v for k, v in obj.items() if k not in known})


def task_field(task: Any, name: str, default: Any = None) -> Any:
    """A task's field, from a Task or from its JSON form (a dict, as the environments and the sandbox get it)."""
    if isinstance(task, dict):
        return task.get(name, default)
    return getattr(task, name, default)


def task_json(task: Any) -> dict:
    """A task in the official JSONL form (a dict): a dict as it is, a Task by its to_json()."""
    if isinstance(task, dict):
        return dict(task)
    if hasattr(task, "to_json"):
        return task.to_json()
    return dataclasses.asdict(task)


@dataclasses.dataclass(frozen=True)
class Turn:
    role: str
    content: str
    input: str | None = None   # official files: the fully templated prompt before this assistant reply
    output: str | None = None  # official files: the raw reply

    def to_json(self) -> dict:
        out = {"role": self.role, "content": self.content}
        if self.input is not None:
            out["input"] = self.input
        if self.output is not None:
            out["output"] = self.output
        return out


@dataclasses.dataclass(frozen=True)
class Trajectory:
    task: Task
    dialogue_history: tuple[Turn, ...]
    answer: str = ""
    reward: float | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)

    @property
    def num_replies(self) -> int:
        return sum(t.role == "assistant" for t in self.dialogue_history)

    @property
    def prerendered(self) -> bool:
        """True when every assistant turn carries the official `input`/`output` strings."""
        return all(t.input is not None and t.output is not None
                   for t in self.dialogue_history if t.role == "assistant")

    def messages(self) -> list[dict]:
        return [{"role": t.role, "content": t.content} for t in self.dialogue_history]

    def to_json(self) -> dict:
        out = {**self.extra, "task": self.task.to_json(),
               "dialogue_history": [t.to_json() for t in self.dialogue_history], "answer": self.answer}
        if self.reward is not None:
            out["reward"] = self.reward
        return out

    @classmethod
    def from_json(cls, obj, *, where: str = "", no_reply: str = "nothing to train on") -> "Trajectory":
        """no_reply: why a trajectory without an assistant turn cannot be used, in the reading command's words."""
        _require_object(obj, where, "")
        if "task" not in obj:
            raise DataError("is missing (each trajectory holds its task object)", where=where, field="task")
        task = Task.from_json(obj["task"], where=where, prefix="task.")
        history = obj.get("dialogue_history")
        if history is None:
            raise DataError("is missing", where=where, field="dialogue_history")
        if not isinstance(history, list):
            raise DataError(f"must be a list of turns, got {type(history).__name__}", where=where,
                            field="dialogue_history")
        if not history:
            raise DataError("is empty: a trajectory needs the user's task statement and at least one "
                            "assistant reply", where=where, field="dialogue_history")
        turns = tuple(_turn(t, where, f"dialogue_history[{i}]") for i, t in enumerate(history))
        if not any(t.role == "assistant" for t in turns):
            raise DataError(f"has no assistant turn: {no_reply}", where=where,
                            field="dialogue_history")
        answer = obj.get("answer", "")
        if answer is None:
            answer = ""
        if not isinstance(answer, str):
            raise DataError(f"must be a string, got {type(answer).__name__}", where=where, field="answer")
        reward = obj.get("reward")
        if reward is not None:
            if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
                raise DataError(f"must be a finite number (fraction of tests passed) or null, got "
                                f"{reward!r}", where=where, field="reward")
            reward = float(reward)
        known = {"task", "dialogue_history", "answer", "reward"}
        return cls(task, turns, answer, reward, {k: v for k, v in obj.items() if k not in known})


@dataclasses.dataclass(frozen=True)
class CandidatesRecord:
    """One line of the pipeline's candidates/candidates.jsonl: the replies sampled from the starting policy for
    the turn prefix o_t before reply `turn` of offline trajectory `trajectory_index` (shared by both rankings)."""
    trajectory_index: int
    turn: int                          # 1-based index of the assistant reply the prompt precedes
    texts: list[str]                   # [N] the sampled replies
    sampler_logp: list[float]          # [N] each reply's mean log-prob under the sampler (no c)
    prompt_text: str                   # the rendered prompt the replies were sampled from
    prompt_ids: list[int] | None = None        # its token ids, and each reply's (stop token included): the
    token_ids: list[list[int]] | None = None   # policy pairs carry them to the DPO step

    @property
    def key(self) -> tuple[int, int]:
        return (self.trajectory_index, self.turn)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, obj, *, where: str = "") -> "CandidatesRecord":
        _require_object(obj, where, "")
        texts = _field(obj, "texts", list, where, "")
        logp = _field(obj, "sampler_logp", list, where, "")
        if len(logp) != len(texts):
            raise DataError(f"has {len(logp)} values for {len(texts)} texts", where=where, field="sampler_logp")
        token_ids = obj.get("token_ids")
        if token_ids is not None and len(token_ids) != len(texts):
            raise DataError(f"has {len(token_ids)} replies for {len(texts)} texts", where=where, field="token_ids")
        return cls(_field(obj, "trajectory_index", int, where, ""), _field(obj, "turn", int, where, ""), texts,
                   [float(x) for x in logp], _field(obj, "prompt_text", str, where, ""), obj.get("prompt_ids"),
                   token_ids)


@dataclasses.dataclass(frozen=True)
class PolicyPair:
    """One step-level policy pair (a line of `python -m sweet_jax.rank`'s output, rank*/pairs.jsonl): two
    candidates for the same turn prefix, `chosen` scored strictly above `rejected` by the critic."""
    trajectory_index: int
    turn: int
    task_key: str
    prompt: list[dict]                 # the messages before the reply ({'role', 'content'}, ...)
    prompt_text: str                   # the rendered prompt the candidates were sampled from
    chosen: str
    rejected: str
    chosen_score: float
    rejected_score: float
    rank_reference: str                # what the critic's log-prob was measured against (ref_with_info | sampler)
    prompt_ids: list[int] | None = None      # the token ids the sampler read and wrote, when known: the DPO
    chosen_ids: list[int] | None = None      # step trains on them rather than on the texts tokenised again
    rejected_ids: list[int] | None = None

    IDS = ("prompt_ids", "chosen_ids", "rejected_ids")

    @property
    def key(self) -> tuple[int, int]:
        return (self.trajectory_index, self.turn)

    @property
    def has_sampled_ids(self) -> bool:
        """The token ids the policy read and sampled are known: DPO trains on them, not on the texts."""
        return all(getattr(self, name) is not None for name in self.IDS)

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        if not self.has_sampled_ids:
            for name in self.IDS:
                del out[name]
        return out

    @classmethod
    def from_json(cls, obj, *, where: str = "") -> "PolicyPair":
        _require_object(obj, where, "")
        number = lambda name: float(_field(obj, name, (int, float), where, ""))  # noqa: E731
        ids = {name: obj.get(name) for name in cls.IDS}
        for name, value in ids.items():
            if value is not None and not isinstance(value, list):
                raise DataError(f"must be a list of token ids, got {type(value).__name__}", where=where, field=name)
        return cls(_field(obj, "trajectory_index", int, where, ""), _field(obj, "turn", int, where, ""),
                   str(obj.get("task_key", "")), _field(obj, "prompt", list, where, ""),
                   str(obj.get("prompt_text", "")), _field(obj, "chosen", str, where, ""),
                   _field(obj, "rejected", str, where, ""), number("chosen_score"), number("rejected_score"),
                   str(obj.get("rank_reference", "")), **ids)


def _require_object(obj, where, field):
    if not isinstance(obj, dict):
        raise DataError(f"must be a JSON object, got {type(obj).__name__}", where=where, field=field)


def _field(obj: dict, name: str, typ, where: str, prefix: str):
    if name not in obj:
        raise DataError("is missing", where=where, field=prefix + name)
    value = obj[name]
    if not isinstance(value, typ) or (isinstance(value, bool) and typ is not bool):
        names = " or ".join(x.__name__ for x in typ) if isinstance(typ, tuple) else typ.__name__
        raise DataError(f"must be {names}, got {type(value).__name__}", where=where, field=prefix + name)
    return value


def _turn(obj, where: str, field: str) -> Turn:
    _require_object(obj, where, field)
    role = obj.get("role")
    if role not in ROLES:
        raise DataError(f"must be one of {ROLES}, got {role!r}", where=where, field=field + ".role")
    for name in ("content", "input", "output"):
        if obj.get(name) is not None and not isinstance(obj[name], str):
            raise DataError(f"must be a string, got {type(obj[name]).__name__}", where=where,
                            field=f"{field}.{name}")
    content, inp, out = obj.get("content"), obj.get("input"), obj.get("output")
    if content is None:
        if role == "assistant" and out is not None:
            content = out  # official files: the reply lives in `output`
        else:
            raise DataError("is missing", where=where, field=field + ".content")
    if (inp is None) != (out is None) and role == "assistant":
        raise DataError("pre-rendered assistant turns need both `input` and `output`", where=where,
                        field=field + (".output" if out is None else ".input"))
    return Turn(role, content, inp, out)


# ----------------------------------------------------------------------------------------------------
# Loading.


