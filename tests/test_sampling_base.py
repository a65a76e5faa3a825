"""The one sampler interface (sweet_jax.sampling.base): both samplers implement it, and what rollouts and ranking
need of a sampler is all in it."""
import inspect

import pytest
from flax import nnx

from sweet_jax.data import demo
from sweet_jax.data.tokenizers import load_tokenizer
from sweet_jax.models import Llama, LlamaConfig
from sweet_jax.rl import episodes, ranking
from sweet_jax.sampling import base, generate, policy_backend


def test_the_interface_cannot_be_used_without_its_methods():
    class Partial(base.BaseSampler):
        pass

    with pytest.raises(TypeError, match="generate"):
        Partial()


def test_both_samplers_implement_it():
    assert issubclass(generate.Sampler, base.BaseSampler)
    assert issubclass(policy_backend.OpenAISampler, base.BaseSampler)
    assert not inspect.isabstract(generate.Sampler) and not inspect.isabstract(policy_backend.OpenAISampler)


def test_the_in_process_sampler_holds_its_model_and_an_engine_none():
    tokenizer = load_tokenizer(str(demo.paths().tokenizer))
    model = Llama(LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_layers=1,
                              num_heads=2, num_kv_heads=1, head_dim=8), rngs=nnx.Rngs(0))
    assert generate.Sampler(model, tokenizer).local_model is model
    # No request is sent until generate: the model name is given, the vocabulary size too.
    engine = policy_backend.OpenAISampler(["http://127.0.0.1:9/v1"], tokenizer, model="policy", vocab_size=100)
    assert engine.local_model is None
    engine.close()


def test_seeds_are_mixed_the_same_way_on_both_sides():
    assert base.mix_seed(7, 0) == base.mix_seed(7, 0)
    assert len({base.mix_seed(7, j) for j in range(100)}) == 100
    assert all(0 <= base.mix_seed(s, j) < 2**31 for s in (0, -1, 2**40) for j in range(3))


def test_rollouts_and_ranking_take_the_interface():
    for fn, name in ((episodes.SamplerPolicy.__init__, "sampler"), (episodes.play, "sampler"),
                     (ranking.sample_candidates, "sampler"), (ranking.rank_with, "sampler")):
        assert inspect.signature(fn).parameters[name].annotation in ("BaseSampler", base.BaseSampler), fn
