"""sweet_jax.costs: the timers and counters a pipeline stage keeps in its done.json."""
import jax
import jax.numpy as jnp
import numpy as np

from sweet_jax import costs


def test_timers_counters_and_tokens_add_up_until_reset():
    costs.reset()
    with costs.timed("score_pass"):
        pass
    with costs.timed("score_pass"):
        pass
    costs.tokens("score", 30, 64)
    costs.tokens("score", np.int64(10), 16)
    costs.add("compiles", 2)
    got = costs.snapshot()
    assert got["score_pass_calls"] == 2 and got["score_pass_s"] >= 0
    assert (got["score_tokens"], got["score_padded_tokens"], got["compiles"]) == (40, 80, 2)
    costs.reset()
    assert costs.snapshot() == {}


def test_compilations_are_counted_with_their_seconds_and_a_cached_program_is_not():
    costs.listen_to_compiles()
    costs.listen_to_compiles()   # idempotent: one listener, not two
    costs.reset()
    f = jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0)
    x = np.ones((7, 3), np.float32)   # a host array: only f compiles
    f(x).block_until_ready()
    first = costs.snapshot()
    assert first["compiles"] == 1 and first["compile_s"] > 0
    assert first["compile_s"] >= first["compile_backend_compile_s"] > 0
    f(x).block_until_ready()   # the in-memory cache: nothing compiles again
    assert costs.snapshot()["compiles"] == 1
