"""Untrusted-code execution for ColBench rewards: see evaluator.py (API) and _worker.py (isolation)."""

from sweet_jax.sandbox.evaluator import (Evaluator, SWEET_RL_DENY_LIST, SandboxError, SandboxUnavailableError, Score,
                                         extract_code, sweet_rl_code, task_cases, task_field)
from sweet_jax.sandbox.protocol import ValueRejected, decode_value, encode_value, values_equal

__all__ = ["Evaluator", "Score", "SandboxError", "SandboxUnavailableError", "SWEET_RL_DENY_LIST",
           "extract_code", "sweet_rl_code", "task_cases", "task_field", "values_equal",
           "encode_value", "decode_value", "ValueRejected"]
