"""ColBench environments and human simulators."""
from sweet_jax.data.schema import task_field, task_json  # the tasks' own module; the environments read tasks
from sweet_jax.envs.colbench import AgentReply, ColBenchEnv, NO_ANSWER, hidden_information, parse_agent_reply
from sweet_jax.envs.prompts import (AGENT_PROMPT, ANSWER_MARKER, HUMAN_RESPONSE_CHAR_LIMIT, OUTPUT_MARKER,
                                    SIMULATOR_PROMPT, simulator_dialogue_text)
from sweet_jax.envs.simulators import (ModelSimulator, NO_RESPONSE, OpenAISimulator, ScriptedSimulator, Simulator,
                                       SimulatorError, simulator_messages)

__all__ = [
    "AGENT_PROMPT", "ANSWER_MARKER", "AgentReply", "ColBenchEnv", "HUMAN_RESPONSE_CHAR_LIMIT", "ModelSimulator",
    "NO_ANSWER", "NO_RESPONSE", "OUTPUT_MARKER", "OpenAISimulator", "SIMULATOR_PROMPT", "ScriptedSimulator",
    "Simulator", "SimulatorError", "hidden_information", "parse_agent_reply", "simulator_dialogue_text",
    "simulator_messages", "task_field", "task_json",
]
