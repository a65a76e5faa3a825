"""Prompts of the ColBench backend task, written in our own words after the official ones.

The agent prompt tells the policy the rules of the environment; the simulator prompt makes a chat
model play the human who holds the hidden information. Both keep the official structure and markers
("I WANT TO ANSWER:", two-sentence replies, ten rounds) because the environment parses them.
"""

import pathlib
import string

from sweet_jax.errors import SweetJaxError

ANSWER_MARKER = "I WANT TO ANSWER:"
OUTPUT_MARKER = "OUTPUT:"
HUMAN_RESPONSE_CHAR_LIMIT = 400  # the official HUMAN_RESPONSE_CHARACTER_LIMIT

AGENT_PROMPT = """You are an LLM agent helping a human user with a Python programming problem.
1) The problem is personal to this user: details you need are only known to them, so find them out by
asking the user short clarification questions about hidden details and implicit constraints.
2) Ask simple questions; the user answers briefly, in at most two sentences.
3) Once you know enough, begin your reply with "I WANT TO ANSWER:" and follow it directly with the raw
Python code of your final answer.
4) You have at most 10 rounds of conversation with the user and must give your final answer within them.
5) Keep every reply to the user concise."""

SIMULATOR_SYSTEM_PROMPT = "You are a helpful assistant."

SIMULATOR_PROMPT = """Play the part of a human user talking with an LLM agent.
You want the agent to help you with this problem:
{problem_description}

Help the agent reach the answer that fits you personally. Answer its questions using only the hidden
information below; if the hidden information does not contain the answer, say that you don't know.
Act like a person who needs the agent's help, and never hand the agent the code itself.

HIDDEN INFORMATION:
{hidden_information}
END OF HIDDEN INFORMATION

The dialogue so far:
{dialogue_history}

Reply to the agent now, in at most TWO SENTENCES, and say nothing else."""


def simulator_dialogue_text(dialogue) -> str:
    """The dialogue as the official simulator sees it: 'role:content' blocks, ending with 'agent:'."""
    parts = [f"{turn['role']}:{turn['content']}\n\n\n\n" for turn in dialogue]
    return "".join(parts) + "agent:"


# The placeholders a prompt file may use (the official prompt files' names); the agent prompt has none.
PROMPT_FIELDS = {"simulator": ("problem_description", "hidden_information", "dialogue_history"), "agent": ()}


def load_prompt(path: str, kind: str) -> str:
    """A prompt from a text file (e.g. the official prompt files, which this package does not ship).

    kind="simulator": a template over {problem_description}, {hidden_information} and {dialogue_history} (the
    dialogue as 'role:content' blocks ending with 'agent:', simulator_dialogue_text), formatted per reply.
    kind="agent": the agent's system message, used verbatim (no placeholders)."""
    if kind not in PROMPT_FIELDS:
        raise SweetJaxError(f"prompt kind must be one of {tuple(PROMPT_FIELDS)}, got {kind!r}")
    p = pathlib.Path(path)
    if not p.is_file():
        raise SweetJaxError(f"{kind} prompt file {path} does not exist")
    text = p.read_text(encoding="utf-8")
    if kind == "agent":
        return text
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(text) if name is not None]
    except ValueError as e:
        raise SweetJaxError(f"{path}: not a valid template ({e}); write a literal brace as {{{{ or }}}}") from None
    unknown = sorted(set(fields) - set(PROMPT_FIELDS[kind]))
    if unknown:
        raise SweetJaxError(f"{path}: unknown placeholder(s) {unknown}; a {kind} prompt may use "
                            + ", ".join("{" + f + "}" for f in PROMPT_FIELDS[kind]))
    if "hidden_information" not in fields:
        raise SweetJaxError(f"{path}: the simulator prompt never shows {{hidden_information}}, so the simulated "
                            "human cannot answer from it; add the placeholder")
    return text
