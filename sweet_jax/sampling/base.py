"""The one sampler interface that rollouts (rl.episodes), ranking (rl.ranking), the pipeline's evaluation and
the server's engine are written against, and what a sampler returns.

Two implementations:
  sampling.generate.Sampler           in process: a JAX KV-cache decoder over an NNX Llama (its weights are here)
  sampling.policy_backend.OpenAISampler  an OpenAI-compatible engine (vLLM, SGLang, `python -m sweet_jax.serve`)
                                      over HTTP: the weights are in the engine's process

A call `generate(prompts, ..., seed=s)` gives prompt j the seed mix_seed(s, j) in both, so an engine that honours
per-request seeds samples what the in-process sampler would.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, Sequence

import numpy as np


@dataclasses.dataclass
class Sample:
    """One sampled continuation.

    token_ids / logprobs cover every generated token, including the stop token id that ended the row and
    the token that completed a stop string; `text` is the decoded continuation without the stop token and
    cut before the stop string (OpenAI semantics). logprobs are the model's (temperature 1.0) log-probs.
    """

    text: str | None
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # 'stop' (stop token or stop string) | 'length' (max_new_tokens) | 'cancelled'
    prompt_token_ids: list[int] = dataclasses.field(default_factory=list, repr=False)
    # Per token, the top alternatives [(token id, log-prob)] best first, when asked (SamplingParams.top_logprobs).
    top_logprobs: list[list[tuple[int, float]]] | None = dataclasses.field(default=None, repr=False)


def mix_seed(seed: int, index: int) -> int:
    """A distinct, reproducible 31-bit seed for (seed, index): the seed of prompt `index` of a call with `seed`."""
    return int(np.random.default_rng([int(seed) & 0xFFFFFFFF, int(index)]).integers(2**31))


class BaseSampler(abc.ABC):
    """Samples replies of a policy to token-id prompts.

    tokenizer:      renders prompts (chat template) and decodes replies
    config:         .max_position_embeddings, the context a prompt plus its new tokens must fit
    eos_token_ids:  the ids that end a reply
    """

    tokenizer: Any
    config: Any
    eos_token_ids: Sequence[int]

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 256, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, n: int = 1, seed: int | None = None,
                 progress: bool = False) -> list[list[Sample]]:
        """n samples of each prompt: samples[prompt][i]. A `seed` makes the call reproducible (prompt j uses
        mix_seed(seed, j)); None draws from the sampler's own seeded stream."""

    @property
    @abc.abstractmethod
    def local_model(self) -> Any | None:
        """The policy's model in this process (an NNX Llama: ranking scores with it as the reference instead of
        loading it again), or None where the weights live elsewhere (an engine)."""

    def close(self) -> None:
        """Release what the sampler holds besides the model (threads, connections); the default holds none."""
