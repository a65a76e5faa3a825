"""KV-cache sampler: parity with transformers' generate, log-probs, n samples, stops, sharding."""
import dataclasses

import jax
import numpy as np
import pytest
import torch

from tiny import load_torch, make_hf_llama

from sweet_jax import costs
from sweet_jax.data.batching import bucket_prompt
from sweet_jax.data.tokenizers import ENGLISH_SAMPLE, build_llama3_tokenizer
from sweet_jax.sampling.generate import (GenerateError, Request, Sampler, SamplingParams, bucket_length,
                                         decode_windows, filter_logits, first_argmax, inverse_cdf_draw, shared_prefix_length)
from sweet_jax.models import load_hf

VOCAB = 320  # the test tokenizer's size (256 bytes + merges + 6 specials)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_llama3_tokenizer(tmp_path_factory.mktemp("tok"), [ENGLISH_SAMPLE] * 4, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, tokenizer):
    # llama31 style: GQA and llama3 rope scaling; eos = the tokenizer's <|eot_id|> and <|end_of_text|>.
    eos = [tokenizer.convert_tokens_to_ids("<|eot_id|>"), tokenizer.convert_tokens_to_ids("<|end_of_text|>")]
    path = make_hf_llama(tmp_path_factory.mktemp("llama31"), "llama31", vocab_size=VOCAB,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=eos)
    tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def sampler(hf_dir, tokenizer):
    return Sampler(load_hf(hf_dir), tokenizer)


def random_prompts(lengths, seed=0, vocab=256):
    rng = np.random.default_rng(seed)
    return [rng.integers(10, vocab, size=n).tolist() for n in lengths]


def hf_greedy(hf_dir, prompts, max_new_tokens, pad_id):
    """transformers' generate on a left-padded batch; each row cut after its first eos (inclusive)."""
    model = load_torch(hf_dir)
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                             pad_token_id=pad_id)
    eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
              else [model.generation_config.eos_token_id])
    rows = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:cut])
    return rows


def test_greedy_tokens_identical_to_transformers_generate(tmp_path):
    # llama31 style: GQA + llama3 rope scaling (the tied-embedding style is served in test_serve.py).
    hf_dir = make_hf_llama(tmp_path, "llama31", vocab_size=256, seed=3)
    prompts = random_prompts([3, 11, 6, 19], seed=1)
    expected = hf_greedy(hf_dir, prompts, max_new_tokens=24, pad_id=0)
    samples = Sampler(load_hf(hf_dir)).generate(prompts, max_new_tokens=24, temperature=0.0)
    assert [s[0].token_ids for s in samples] == expected
    for s, e in zip(samples, expected):
        assert s[0].finish_reason == ("length" if len(e) == 24 else "stop")


def test_a_long_prompt_prefills_a_finer_width_and_decodes_transformers_greedy_tokens(tmp_path):
    """Past 128 tokens the prefill runs the prompt bucket_prompt wide (176 -> 192, not 256); the decode starts at
    the coarser bucket_length slot, the slots between masked: transformers' greedy tokens, with and without a
    shared prefix."""
    hf_dir = make_hf_llama(tmp_path, "llama31", vocab_size=256, seed=3)
    sampler, calls = Sampler(load_hf(hf_dir), min_shared_prefix=32), []
    spy_prefill(sampler, calls)
    for prompts in (random_prompts([131, 176, 150], seed=2), prompts_with_a_common_prefix(40, [100, 141, 120], seed=6)):
        expected = hf_greedy(hf_dir, prompts, max_new_tokens=20, pad_id=0)
        assert [s[0].token_ids for s in sampler.generate(prompts, max_new_tokens=20, temperature=0.0)] == expected
    assert calls == [(0, 4, 192), (32, 4, 160)]   # 176 tokens; 8 + 141 after the shared 32
    assert sampler._decode_fns.keys() == {(256, 256 + 32, 0), (32 + 256, 32 + 256 + 32, 0)}


def test_prompt_buckets_are_powers_of_two_then_quarter_octaves():
    assert [bucket_prompt(n) for n in (1, 17, 33, 44, 65, 100, 128, 129, 161, 256, 257, 600, 1025, 9000)] == \
        [16, 32, 40, 48, 80, 112, 128, 160, 192, 256, 320, 640, 1280, 9216]
    for n in range(1, 5000, 7):   # never past the decode's width; under 25% padding past 32 tokens
        assert n <= bucket_prompt(n) <= bucket_length(n)
        assert n <= 32 or bucket_prompt(n) < 1.25 * n


def prompts_with_a_common_prefix(prefix_len, suffix_lengths, seed):
    prefix = random_prompts([prefix_len], seed=seed)[0]
    return [prefix + s for s in random_prompts(suffix_lengths, seed=seed + 1)]


def spy_prefill(sampler, calls):
    """Record each prefill's (shared prefix length, prompt rows, width of the rest) while it runs; `del
    sampler._prefill_fn` undoes it."""
    original = sampler._prefill_fn

    def spy(*shape):
        fn = original(*shape)
        return lambda graphdef, state, prefix_ids, input_ids, *rest: (
            calls.append((prefix_ids.shape[1], *input_ids.shape)),
            fn(graphdef, state, prefix_ids, input_ids, *rest))[1]
    sampler._prefill_fn = spy


def test_a_shared_prefix_runs_once_with_transformers_greedy_tokens(tmp_path):
    # A 37-token common prefix: 32 of it run once on one row, each prompt's rest (5 + 2..17 tokens) on its row.
    hf_dir = make_hf_llama(tmp_path, "llama31", vocab_size=256, seed=3)
    prompts = prompts_with_a_common_prefix(37, [2, 9, 17, 4], seed=4)
    expected = hf_greedy(hf_dir, prompts, max_new_tokens=20, pad_id=0)
    sampler, calls = Sampler(load_hf(hf_dir), min_shared_prefix=32), []
    spy_prefill(sampler, calls)
    samples = sampler.generate(prompts, max_new_tokens=20, temperature=0.0)
    assert calls == [(32, 4, 32)]  # P = 32 + 32 = 64 slots, the 4 rows' prefill 32 wide
    assert [s[0].token_ids for s in samples] == expected


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_shared_prefix_gives_the_samples_and_logprobs_of_the_unshared_prefill(hf_dir, tokenizer, temperature):
    prompts = prompts_with_a_common_prefix(50, [3, 12, 7], seed=6)
    shared, calls = Sampler(load_hf(hf_dir), tokenizer, min_shared_prefix=16), []
    spy_prefill(shared, calls)
    plain = Sampler(load_hf(hf_dir), tokenizer, min_shared_prefix=0)
    kwargs = dict(max_new_tokens=16, temperature=temperature, n=2, seed=5, ignore_eos=True)
    got, want = shared.generate(prompts, **kwargs), plain.generate(prompts, **kwargs)
    assert calls == [(48, 4, 16)]
    assert [[s.token_ids for s in g] for g in got] == [[s.token_ids for s in g] for g in want]
    for prompt, g, w in zip(prompts, got, want):
        for s, t in zip(g, w):
            np.testing.assert_allclose(s.logprobs, t.logprobs, atol=2e-5)
            np.testing.assert_allclose(s.logprobs, teacher_forced_logprobs(shared.model, prompt, s.token_ids),
                                       atol=2e-4)


def test_shared_prefix_length_is_the_common_prefix_in_whole_blocks():
    a, b, c = [1] * 40 + [2], [1] * 40 + [3, 4], [1] * 35 + [5]
    assert shared_prefix_length([a, b], 32) == 32  # 40 in common, rounded down to 16s
    assert shared_prefix_length([a, b, c], 32) == 32 and shared_prefix_length([a, b, c], 33) == 0
    assert shared_prefix_length([a, b], 32, multiple=8) == 40
    assert shared_prefix_length([a, a, a], 16) == 0  # one distinct prompt: nothing to share
    assert shared_prefix_length([[1] * 32, [1] * 40], 16) == 16  # each prompt keeps a token of its own
    assert shared_prefix_length([a, b], 0) == 0  # off
    assert shared_prefix_length([[7] + a, a], 16) == 0


def teacher_forced_logp(model, prompt, completion):
    """[len(completion), V]: log p(. | prompt, completion_<t) from one full forward pass (no cache)."""
    ids = np.asarray([prompt + completion], np.int32)
    logits = np.asarray(model(ids))[0, len(prompt) - 1:-1]
    return logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)


def teacher_forced_logprobs(model, prompt, completion):
    """log p(completion_t | prompt, completion_<t)."""
    logp = teacher_forced_logp(model, prompt, completion)
    return logp[np.arange(len(completion)), completion]


@pytest.mark.parametrize("temperature, top_p, top_k", [(1.0, 1.0, 0), (0.7, 0.9, 40)])
def test_sampled_logprobs_equal_teacher_forced_forward(sampler, temperature, top_p, top_k):
    # The returned log-probs are the model's at temperature 1, whatever the sampling settings were.
    prompts = random_prompts([5, 13], seed=2)
    samples = sampler.generate(prompts, max_new_tokens=16, temperature=temperature, top_p=top_p, top_k=top_k,
                               n=3, seed=7, ignore_eos=True)
    for prompt, group in zip(prompts, samples):
        for s in group:
            assert len(s.token_ids) == len(s.logprobs) == 16
            ref = teacher_forced_logprobs(sampler.model, prompt, s.token_ids)
            np.testing.assert_allclose(s.logprobs, ref, atol=2e-4)


def test_n_samples_share_one_prefill_and_differ(sampler):
    calls = []
    spy_prefill(sampler, calls)
    try:
        prompts = random_prompts([4, 9], seed=3)
        samples = sampler.generate(prompts, max_new_tokens=12, temperature=1.0, n=4, seed=11, ignore_eos=True)
    finally:
        del sampler._prefill_fn
    assert [rows for _, rows, _ in calls] == [2]  # two prompt rows, not 2 x 4 sample rows
    for group in samples:
        assert len(group) == 4
        assert len({tuple(s.token_ids) for s in group}) >= 3
    again = sampler.generate(prompts, max_new_tokens=12, temperature=1.0, n=4, seed=11, ignore_eos=True)
    assert [[s.token_ids for s in g] for g in again] == [[s.token_ids for s in g] for g in samples]
    other = sampler.generate(prompts, max_new_tokens=12, temperature=1.0, n=4, seed=12, ignore_eos=True)
    assert [[s.token_ids for s in g] for g in other] != [[s.token_ids for s in g] for g in samples]


def test_rows_of_one_batch_keep_their_own_settings(sampler):
    # What the server relies on: requests with different settings share one compiled batch.
    prompts = random_prompts([6, 10], seed=6)
    greedy = Request(prompts[0], SamplingParams(max_new_tokens=12, temperature=0.0, n=4))
    sampled = Request(prompts[1], SamplingParams(max_new_tokens=5, temperature=1.0, top_k=3, n=4, seed=1,
                                                 ignore_eos=True))
    mixed = sampler.generate_requests([greedy, sampled])
    alone = sampler.generate_requests([greedy, Request(prompts[1], dataclasses.replace(sampled.params,
                                                                                     temperature=0.0))])
    assert [s.token_ids for s in mixed[0]] == [alone[0][0].token_ids] * 4
    assert all(len(s.token_ids) == 5 and s.finish_reason == "length" for s in mixed[1])
    for s in mixed[1]:  # top_k=3: every sampled token is among the 3 most likely
        logp = teacher_forced_logp(sampler.model, prompts[1], s.token_ids)
        rank = (logp > logp[np.arange(5), s.token_ids][:, None]).sum(-1)
        assert rank.max() < 3, rank
    assert len({tuple(s.token_ids) for s in mixed[1]}) >= 2


def test_stop_token_ids_end_the_row_and_are_kept(sampler):
    prompt = random_prompts([7], seed=4)
    free = sampler.generate(prompt, max_new_tokens=16, temperature=0.0, ignore_eos=True)[0][0].token_ids
    stop_id = free[5]
    first = free.index(stop_id)
    s = sampler.generate(prompt, max_new_tokens=16, temperature=0.0, ignore_eos=True,
                         stop_token_ids=[stop_id])[0][0]
    assert s.token_ids == free[:first + 1]
    assert s.finish_reason == "stop"
    assert sampler.generate(prompt, max_new_tokens=16, temperature=0.0, ignore_eos=True)[0][0].finish_reason == \
        "length"


def test_stop_strings_truncate_the_text(sampler, monkeypatch):
    monkeypatch.setattr(sampler, "stop_check_every", 4)  # several host checks within the 16 tokens
    prompt = ["def f(x):"]
    free = sampler.generate(prompt, max_new_tokens=16, temperature=0.0, ignore_eos=True)[0][0]
    text = free.text
    assert len(text) > 12
    stop = text[10:13]
    cut = text.find(stop)
    s = sampler.generate(prompt, max_new_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop, "\x00never"])[0][0]
    assert s.text == text[:cut]
    assert s.finish_reason == "stop"
    assert s.token_ids == free.token_ids[:len(s.token_ids)]
    # The kept tokens are the shortest prefix that spells the stop string.
    assert stop in sampler.decode(s.token_ids) and stop not in sampler.decode(s.token_ids[:-1])


def test_chat_uses_the_chat_template_with_generation_prompt(sampler, tokenizer):
    messages = [{"role": "user", "content": "Write a function."}]
    s = sampler.chat([messages], max_new_tokens=4, temperature=0.0)[0][0]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert s.prompt_token_ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]


def test_sharded_mesh_gives_the_same_greedy_tokens(hf_dir, sampler):
    from sweet_jax.sharding import make_mesh

    # The last three share a 40-token prefix: their prefix runs once on one (replicated) row.
    prompts = random_prompts([3, 8, 5], seed=5) + prompts_with_a_common_prefix(40, [1, 6, 3], seed=8)
    mesh = make_mesh((2, 2, 2))  # rows over data x fsdp, heads over tensor
    sharded = Sampler(load_hf(hf_dir, mesh=mesh), sampler.tokenizer, mesh=mesh, min_shared_prefix=32)
    calls = []
    spy_prefill(sharded, calls)
    for batch in (prompts[:3], prompts[3:]):
        expected = [s[0].token_ids for s in sampler.generate(batch, max_new_tokens=12, temperature=0.0)]
        got = [s[0].token_ids for s in sharded.generate(batch, max_new_tokens=12, temperature=0.0)]
        assert got == expected
    assert [(S, W) for S, _, W in calls] == [(0, 16), (32, 16)]
    kernel = sharded.model.layers[0].attn.q_proj.kernel[...]
    assert len(kernel.sharding.device_set) == 8 and kernel.sharding.spec != jax.sharding.PartitionSpec()


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = jax.numpy.log(jax.numpy.asarray([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    kept = np.isfinite(np.asarray(filter_logits(logits, jax.numpy.asarray([0.75, 1.0]),
                                                jax.numpy.asarray([0, 3]))))
    assert kept.tolist() == [[True, True, False, False], [True, True, True, False]]


def test_errors_name_the_problem(sampler):
    with pytest.raises(GenerateError, match="max_position_embeddings"):
        sampler.generate([[5] * 500], max_new_tokens=100)
    with pytest.raises(GenerateError, match="list of prompts"):
        sampler.generate("a single string")
    with pytest.raises(GenerateError, match="top_p"):
        sampler.generate(["x"], top_p=0.0)
    assert bucket_length(5) == 16 and bucket_length(17) == 32 and bucket_length(1500) == 2048


def test_set_params_swaps_weights_without_recompiling(hf_dir, tmp_path, sampler):
    config = sampler.config  # same architecture and special ids, other weights
    other_dir = make_hf_llama(tmp_path / "other", "llama31", vocab_size=VOCAB, seed=9,
                              bos_token_id=config.bos_token_id, eos_token_id=list(config.eos_token_ids))
    prompts = random_prompts([4, 9], seed=8)
    fresh = Sampler(load_hf(other_dir), sampler.tokenizer)
    expected = [s[0].token_ids for s in fresh.generate(prompts, max_new_tokens=10, temperature=0.0, ignore_eos=True)]
    swapped = Sampler(load_hf(hf_dir), sampler.tokenizer, seed=1)
    before = [s[0].token_ids for s in swapped.generate(prompts, max_new_tokens=10, temperature=0.0, ignore_eos=True)]
    compiled = {**swapped._prefill_fns, **{("decode",) + k: f for k, f in swapped._decode_fns.items()}}
    traces = {k: f._cache_size() for k, f in compiled.items()}
    swapped.set_params(load_hf(other_dir), seed=3)
    # seed restarts the sampler's own stream, as a fresh Sampler(seed=3) would draw.
    reseeded = Sampler(load_hf(other_dir), sampler.tokenizer, seed=3)
    assert [s[0].token_ids for s in swapped.generate(prompts, max_new_tokens=6)] == \
        [s[0].token_ids for s in reseeded.generate(prompts, max_new_tokens=6)]
    got = [s[0].token_ids for s in swapped.generate(prompts, max_new_tokens=10, temperature=0.0, ignore_eos=True)]
    assert got == expected and got != before
    # The same jitted programs, each without a new trace.
    assert {**swapped._prefill_fns, **{("decode",) + k: f for k, f in swapped._decode_fns.items()}} == compiled
    assert {k: f._cache_size() for k, f in compiled.items()} == traces
    with pytest.raises(GenerateError, match="shapes and dtypes|structure"):
        swapped.set_params(load_hf(hf_dir, dtype="bfloat16"))


def test_inverse_cdf_draw_gives_each_token_its_softmax_mass():
    # V = 300 spans 3 blocks of 128 (the last one padded); a filtered (-inf) token must never be drawn.
    rng = np.random.default_rng(0)
    logits = rng.normal(size=300).astype(np.float32) * 2
    logits[[0, 130, 299]] = -np.inf
    M = 20000  # u on a regular grid of quantiles: token t is drawn for a fraction p_t of them, up to 1/M
    u = (np.arange(M) + 0.5) / M
    tokens = np.asarray(inverse_cdf_draw(jax.numpy.asarray(np.broadcast_to(logits, (M, 300))), jax.numpy.asarray(u)))
    p = np.exp(logits - logits.max())
    p /= p.sum()
    freq = np.bincount(tokens, minlength=300) / M
    assert np.abs(freq - p).max() <= 2.0 / M
    assert freq[[0, 130, 299]].sum() == 0


def test_first_argmax_is_argmax_with_ties_to_the_first():
    x = jax.numpy.asarray([[1.0, 3.0, 3.0, -2.0], [0.0, 0.0, 0.0, 0.0], [-np.inf, -1.0, 5.0, 5.0]])
    assert np.asarray(first_argmax(x)).tolist() == np.asarray(jax.numpy.argmax(x, -1)).tolist() == [1, 0, 2]


def test_decode_windows_cover_the_cache_in_a_few_growing_spans():
    assert decode_windows(32, 16) == [48]  # short generations: one window, one compiled loop
    assert decode_windows(32, 256) == [96, 160, 224, 288]
    assert decode_windows(256, 128) == [320, 384]
    assert decode_windows(1024, 1024)[-1] == 2048 and len(decode_windows(1024, 1024)) == 4


def test_long_greedy_generation_across_cache_windows_matches_one_full_forward(sampler):
    # 128 new tokens run in 2 cache windows (a cache grown between two compiled loops): every greedy token is
    # the argmax of a teacher-forced forward over prompt + tokens, and the log-probs match it.
    prompts = random_prompts([5, 12], seed=12)
    samples = sampler.generate(prompts, max_new_tokens=128, temperature=0.0, ignore_eos=True)
    for prompt, group in zip(prompts, samples):
        ids = group[0].token_ids
        assert len(ids) == 128
        logp = teacher_forced_logp(sampler.model, prompt, ids)
        np.testing.assert_allclose(group[0].logprobs, logp[np.arange(128), ids], atol=2e-4)
        assert (logp.argmax(-1) == np.asarray(ids)).all()


def test_heads_major_cache_prefill_then_decode_matches_full_forward(hf_dir):
    # The sampler's cache layout (keys [B, K, H, S], values [B, K, S, H]): prefill 6 tokens, then one token a step,
    # as the decode loop does.
    from sweet_jax.models import positions_from_mask

    model = load_hf(hf_dir)
    ids = np.asarray(random_prompts([11, 11], seed=13), np.int32)
    mask = np.ones_like(ids)
    mask[1, :3] = 0  # left padding in row 1
    full = np.asarray(model.hidden_states(ids, mask))
    slots = np.zeros((2, 16), np.int32)
    slots[:, :11] = mask
    positions = np.asarray(positions_from_mask(mask))
    cache = model.init_cache(2, 16)
    assert cache[0]["k_BKHS"].shape == (2, model.config.num_kv_heads, model.config.head_dim, 16)
    assert cache[0]["v_BKSH"].shape == (2, model.config.num_kv_heads, 16, model.config.head_dim)
    step = jax.jit(lambda m, ids, sm, pos, c, cp: m.hidden_states(ids, sm, pos, cache=c, cache_pos=cp))
    hidden, cache = step(model, ids[:, :6], slots, positions[:, :6], cache, 0)
    pieces = [np.asarray(hidden)]
    for t in range(6, 11):
        hidden, cache = step(model, ids[:, t:t + 1], slots, positions[:, t:t + 1], cache, t)
        pieces.append(np.asarray(hidden))
    cached = np.concatenate(pieces, axis=1)
    valid = mask.astype(bool)
    np.testing.assert_allclose(cached[valid], full[valid], atol=1e-5, rtol=1e-5)


def test_generate_requests_hands_each_compiled_batch_over_as_it_finishes(hf_dir, tokenizer):
    """on_batch gets every request once, batch by batch (<= max_batch_size sample rows each), with the samples the
    call returns: what the server answers early with."""
    sampler = Sampler(load_hf(hf_dir), tokenizer, max_batch_size=4)
    requests = [Request(p, SamplingParams(max_new_tokens=4, temperature=1.0, n=2, seed=i, ignore_eos=True))
                for i, p in enumerate(random_prompts([9, 5, 7], seed=3))]
    batches = []
    results = sampler.generate_requests(requests, on_batch=lambda idx, samples: batches.append((idx, samples)))
    assert [idx for idx, _ in batches] == [[1, 2], [0]]  # sorted by prompt length, 2 requests x n=2 rows a batch
    for idx, samples in batches:
        assert [[s.token_ids for s in results[i]] for i in idx] == [[s.token_ids for s in g] for g in samples]


def test_chunked_decoding_gives_the_tokens_and_logprobs_of_the_whole_loop(sampler):
    """Streaming runs the compiled decode loop in pieces (1, 2, 4, ... then every chunk_steps steps): the same
    tokens and log-probs, bit for bit, as one loop; each report is a prefix of the final sample."""
    prompts = random_prompts([5, 12, 30], seed=7)
    requests = [Request(p, SamplingParams(max_new_tokens=40, temperature=1.0, n=2, seed=i, ignore_eos=i != 1))
                for i, p in enumerate(prompts)] + [Request(prompts[0], SamplingParams(max_new_tokens=9,
                                                                                       temperature=0.0))]
    whole = sampler.generate_requests(requests)
    reports = []
    chunked = sampler.generate_requests(requests, chunk_steps=8,
                                        on_chunk=lambda idx, partial: reports.append((idx, partial)))
    for a, b in zip(whole, chunked):
        assert [s.token_ids for s in a] == [s.token_ids for s in b]
        assert [s.logprobs for s in a] == [s.logprobs for s in b]
        assert [(s.text, s.finish_reason) for s in a] == [(s.text, s.finish_reason) for s in b]
    lengths = [len(partial[0][0].token_ids) for _, partial in reports]
    assert lengths[:4] == [1, 2, 4, 8] and lengths[4] == 16 and len(reports) >= 6
    for idx, partial in reports:
        for i, samples in zip(idx, partial):
            for got, final in zip(samples, chunked[i]):
                assert final.token_ids[:len(got.token_ids)] == got.token_ids
                assert final.logprobs[:len(got.logprobs)] == got.logprobs
                assert got.text is None and got.finish_reason in (None, final.finish_reason)


def test_chunked_decoding_keeps_stop_strings(sampler, tokenizer):
    """With stop strings the text checks happen at the same steps, chunked or not."""
    prompt = sampler.encode("The sum of two")
    params = SamplingParams(max_new_tokens=48, temperature=1.0, seed=11, stop=("e",), n=3)
    whole = sampler.generate_requests([Request(prompt, params)])[0]
    chunked = sampler.generate_requests([Request(prompt, params)], chunk_steps=4, on_chunk=lambda *a: None)[0]
    assert [(s.text, s.token_ids, s.logprobs, s.finish_reason) for s in whole] == \
        [(s.text, s.token_ids, s.logprobs, s.finish_reason) for s in chunked]
    assert any(s.finish_reason == "stop" and "e" not in s.text for s in whole)


def test_top_logprobs_are_the_models_best_tokens_with_the_sampled_ones_logprob(sampler):
    """SamplingParams.top_logprobs: per token the N most likely tokens of the model's (temperature 1) distribution,
    best first; the sampled token's log-prob is unchanged, and a greedy token is the first alternative."""
    prompt = random_prompts([11], seed=5)[0]
    plain = sampler.generate_requests([Request(prompt, SamplingParams(max_new_tokens=6, temperature=0.0))])[0][0]
    ranked = sampler.generate_requests([Request(prompt, SamplingParams(max_new_tokens=6, temperature=0.0,
                                                                       top_logprobs=3))])[0][0]
    assert plain.top_logprobs is None and ranked.token_ids == plain.token_ids
    np.testing.assert_allclose(ranked.logprobs, plain.logprobs, rtol=1e-6)
    assert len(ranked.top_logprobs) == len(ranked.token_ids)
    for token, lp, top in zip(ranked.token_ids, ranked.logprobs, ranked.top_logprobs):
        assert len(top) == 3 and top[0][0] == token
        np.testing.assert_allclose(top[0][1], lp, rtol=1e-5)
        assert top[0][1] >= top[1][1] >= top[2][1]
    # The alternatives are the teacher-forced distribution's top 3.
    logp = teacher_forced_logp(sampler.model, prompt, ranked.token_ids)
    for t, top in enumerate(ranked.top_logprobs):
        assert [i for i, _ in top] == np.argsort(-logp[t])[:3].tolist()
        np.testing.assert_allclose([v for _, v in top], np.sort(logp[t])[::-1][:3], atol=1e-4)
    with pytest.raises(GenerateError, match="top_logprobs"):
        SamplingParams(top_logprobs=21).check()


def test_a_cancelled_request_stops_at_the_next_chunk_and_the_others_are_unchanged(sampler):
    prompts = random_prompts([6, 7], seed=9)
    params = SamplingParams(max_new_tokens=64, temperature=1.0, seed=2, ignore_eos=True)
    requests = [Request(p, params) for p in prompts]
    whole = sampler.generate_requests(requests)
    stop_first = {"now": False}

    def report(idx, partial):
        stop_first["now"] = len(partial[0][0].token_ids) >= 4

    got = sampler.generate_requests(requests, chunk_steps=8, on_chunk=report,
                                    cancelled=lambda i: i == 0 and stop_first["now"])
    assert got[0][0].finish_reason == "cancelled" and len(got[0][0].token_ids) == 4
    assert got[0][0].token_ids == whole[0][0].token_ids[:4]
    assert got[1][0].token_ids == whole[1][0].token_ids and got[1][0].logprobs == whole[1][0].logprobs
    skipped = sampler.generate_requests(requests, cancelled=lambda i: i == 1)
    assert skipped[1] == [] and skipped[0][0].token_ids == whole[0][0].token_ids


def compaction_requests(seed=0):
    """Rows that end at very different steps: eos-stopped sampled rows, short budgets, one long greedy row."""
    prompts = random_prompts([5, 12, 30, 9], seed=seed)
    return [Request(prompts[0], SamplingParams(max_new_tokens=20, temperature=1.0, n=5, seed=1)),
            Request(prompts[1], SamplingParams(max_new_tokens=3, temperature=1.0, n=2, seed=2, ignore_eos=True)),
            Request(prompts[2], SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)),
            Request(prompts[3], SamplingParams(max_new_tokens=11, temperature=1.0, top_k=5, n=3, seed=3,
                                               ignore_eos=True, top_logprobs=2))]


def assert_same_samples(got, expected):
    """The same tokens, texts, finish reasons and top alternatives; log-probs to float32 rounding (a matmul over
    fewer rows may sum in another order)."""
    assert [[(s.token_ids, s.text, s.finish_reason) for s in g] for g in got] == \
        [[(s.token_ids, s.text, s.finish_reason) for s in g] for g in expected]
    for g, e in zip(got, expected):
        for a, b in zip(g, e):
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
            assert (a.top_logprobs is None) == (b.top_logprobs is None)
            for top_a, top_b in zip(a.top_logprobs or [], b.top_logprobs or []):
                assert [i for i, _ in top_a] == [i for i, _ in top_b]
                np.testing.assert_allclose([v for _, v in top_a], [v for _, v in top_b], rtol=0, atol=1e-5)


def test_compacted_decoding_gives_the_samples_of_the_whole_batch_and_runs_fewer_rows(hf_dir, tokenizer):
    """Every 4 steps the rows still decoding move into a smaller batch: the same tokens, top alternatives and
    finish reasons as the batch decoded whole, log-probs to float rounding, for fewer row-steps run."""
    model = load_hf(hf_dir)
    whole_sampler = Sampler(model, tokenizer, compact_every=0)
    compact_sampler = Sampler(model, tokenizer, compact_every=4, min_compact_rows=1)
    shrinks = []
    take = compact_sampler._take_fn
    compact_sampler._take_fn = lambda carry, rows, index, idle: (shrinks.append(index.shape[0]),
                                                                  take(carry, rows, index, idle))[1]
    requests = compaction_requests()
    costs.reset()
    whole = whole_sampler.generate_requests(requests)
    whole_row_steps = costs.snapshot()["sample_new_padded_tokens"]
    costs.reset()
    compacted = compact_sampler.generate_requests(requests)
    compact_row_steps = costs.snapshot()["sample_new_padded_tokens"]
    assert_same_samples(compacted, whole)
    assert shrinks and shrinks == sorted(shrinks, reverse=True) and shrinks[-1] == 1, shrinks  # the greedy row alone
    lengths = [len(s.token_ids) for group in whole for s in group]
    assert max(lengths) == 40 and min(lengths) <= 3
    assert whole_row_steps == 16 * 40   # 11 sample rows bucketed to 16, until the longest row ends
    assert compact_row_steps < whole_row_steps // 2, (compact_row_steps, whole_row_steps)
    assert costs.snapshot()["sample_new_tokens"] == sum(lengths)


def test_compaction_keeps_streamed_reports_stop_strings_and_cancellation(hf_dir, tokenizer):
    """Reports, stop-string checks and a cancelled request across compactions: the samples of the uncompacted
    loop, and each report a prefix of its final sample."""
    model = load_hf(hf_dir)
    samplers = [Sampler(model, tokenizer, compact_every=every, min_compact_rows=1, stop_check_every=8)
                for every in (0, 4)]
    prompt = samplers[0].encode("The sum of two")
    requests = compaction_requests(seed=4) + [Request(prompt, SamplingParams(max_new_tokens=48, temperature=1.0,
                                                                             seed=11, stop=("e",), n=3))]
    runs = []
    for sampler in samplers:
        reports, seen = [], {"steps": 0}

        def report(idx, partial, reports=reports, seen=seen):
            reports.append((idx, partial))
            seen["steps"] = max(len(s.token_ids) for group in partial for s in group)

        got = sampler.generate_requests(requests, chunk_steps=4, on_chunk=report,
                                        cancelled=lambda i, seen=seen: i == 2 and seen["steps"] >= 6)
        runs.append((got, reports))
        for idx, partial in reports:
            for i, samples in zip(idx, partial):
                for part, final in zip(samples, got[i]):
                    assert final.token_ids[:len(part.token_ids)] == part.token_ids
    (whole, whole_reports), (compacted, compact_reports) = runs
    assert_same_samples(compacted, whole)
    assert len(compact_reports) == len(whole_reports)
    assert compacted[2][0].finish_reason == "cancelled" and 6 <= len(compacted[2][0].token_ids) < 40
    assert any(s.finish_reason == "stop" and "e" not in s.text for s in compacted[4])


def test_sharded_compaction_gives_the_unsharded_samples(hf_dir, sampler):
    from sweet_jax.sharding import make_mesh

    mesh = make_mesh((2, 2, 2))
    sharded = Sampler(load_hf(hf_dir, mesh=mesh), sampler.tokenizer, mesh=mesh, compact_every=4,
                      min_compact_rows=1)
    whole = Sampler(sampler.model, sampler.tokenizer, compact_every=0)
    requests = compaction_requests(seed=5)
    assert_same_samples(sharded.generate_requests(requests), whole.generate_requests(requests))


def dialogue_turns(sampler, seed):
    """Four dialogues of two turns: a shared system prompt and a task each, then each first sample and a user
    reply appended (the rollout's next-turn prompts)."""
    rng = np.random.default_rng(seed)
    system = rng.integers(10, 256, 40).tolist()
    first = [system + rng.integers(10, 256, n).tolist() for n in (30, 45, 52, 61)]
    kwargs = dict(max_new_tokens=12, temperature=1.0, n=2, seed=5, ignore_eos=True)
    replies = sampler.generate(first, **kwargs)
    second = [p + g[0].token_ids + rng.integers(10, 256, 7 + i).tolist()
              for i, (p, g) in enumerate(zip(first, replies))]
    return first, second, kwargs


@pytest.mark.parametrize("matmul", ["auto", "xla_bf16"])
def test_a_dialogues_next_turn_prefills_only_its_new_tokens_with_the_same_samples(tmp_path, matmul):
    """With the prompt cache, turn 2 starts from turn 1's stored K/V: its prefill runs only the reply and the new
    user message (a narrower width, fewer positions) and gives the samples of the whole prefill, and its greedy
    tokens are transformers'. With bf16 matmuls too: both prefills trace under the sampler's matmuls (the split
    activations that keep its tokens those of float32)."""
    hf_dir = make_hf_llama(tmp_path, "llama31", vocab_size=256, seed=3)
    model = load_hf(hf_dir, config_overrides={"cpu_matmul": matmul})
    plain = Sampler(model, min_shared_prefix=16)
    cached = Sampler(model, min_shared_prefix=16, prompt_cache_mb=64, min_cached_prefix=16)
    first, second, kwargs = dialogue_turns(plain, seed=0)
    assert_same_samples(cached.generate(first, **kwargs), plain.generate(first, **kwargs))
    assert len(cached.prompt_cache.entries) == 4
    costs.reset()
    want = plain.generate(second, **kwargs)
    plain_positions = costs.snapshot()["sample_prompt_padded_tokens"]
    costs.reset()
    got = cached.generate(second, **kwargs)
    cached_positions = costs.snapshot()["sample_prompt_padded_tokens"]
    assert cached.prompt_cache.hits == 4
    assert [[s.token_ids for s in g] for g in got] == [[s.token_ids for s in g] for g in want]
    for g, w, prompt in zip(got, want, second):
        for s, t in zip(g, w):
            np.testing.assert_allclose(s.logprobs, t.logprobs, rtol=0, atol=2e-5)
            if matmul == "auto":   # float32 here; a bf16 forward rounds the activations the sampler splits
                np.testing.assert_allclose(s.logprobs, teacher_forced_logprobs(model, prompt, s.token_ids),
                                           atol=2e-4)
    assert cached_positions == 4 * 32 and plain_positions == 32 + 4 * 96, (cached_positions, plain_positions)
    greedy = cached.generate(second, max_new_tokens=10, temperature=0.0)   # turn 2 stored too: a third turn's hit
    assert [s[0].token_ids for s in greedy] == hf_greedy(hf_dir, second, max_new_tokens=10, pad_id=0)


def test_the_prompt_cache_keeps_the_longest_prefix_within_its_bytes_and_forgets_other_weights(hf_dir, tokenizer):
    from sweet_jax.sampling.generate import PromptCache

    store = PromptCache(max_bytes=3000)
    k, v = np.ones((2, 1, 4, 10), np.float32), np.ones((2, 1, 10, 4), np.float32)   # 640 bytes a prompt
    store.put(list(range(10)), k, v)
    store.put(list(range(20)), np.ones((2, 1, 4, 20), np.float32), np.ones((2, 1, 20, 4), np.float32))
    assert store.longest(list(range(30)), minimum=1)[0] == 20
    assert store.longest(list(range(20)), minimum=1)[0] == 10     # a proper prefix only: one token left to run
    assert store.longest(list(range(20)), minimum=11) is None
    assert store.longest([0, 1, 2, 9] + list(range(4, 30)), minimum=1) is None   # the tokens must match
    for start in (100, 200, 300):                                  # over the bytes: the least recently used leaves
        store.put(list(range(start, start + 10)), k, v)
    assert store.bytes <= 3000 and store.longest(list(range(30)), minimum=1)[0] == 10
    store.put(list(range(400, 410)), k, v)
    assert store.longest(list(range(30)), minimum=1)[0] == 10       # used last: kept; range(100, 110) left
    assert store.longest(list(range(100, 120)), minimum=1) is None
    sampler = Sampler(load_hf(hf_dir), tokenizer, prompt_cache_mb=8, min_cached_prefix=4)
    sampler.generate([sampler.encode("The sum of two numbers")], max_new_tokens=4, temperature=0.0)
    assert sampler.prompt_cache.entries
    sampler.set_params(load_hf(hf_dir))                            # another policy: its own K/V
    assert not sampler.prompt_cache.entries and sampler.prompt_cache.bytes == 0


@pytest.mark.parametrize("prompt_cache", [False, True])
def test_identical_prompts_of_a_batch_are_prefilled_once_with_the_samples_each_gets_alone(hf_dir, tokenizer,
                                                                                          prompt_cache):
    """An evaluation plays each task twice (the offline stage four times): a batch's identical prompts run one
    prefill row, read by each request's own sample rows, and every request samples what it samples alone; with
    the prompt cache, a dialogue's repeated next turn too (one row on its stored K/V)."""
    model = load_hf(hf_dir)
    sampler = Sampler(model, tokenizer, min_shared_prefix=0, prompt_cache_mb=64 if prompt_cache else 0,
                      min_cached_prefix=16)
    alone = Sampler(model, tokenizer, min_shared_prefix=0)
    a, b, c = random_prompts([40, 29, 35], seed=21)
    if prompt_cache:   # turn 1 stored; the batch is turn 2 of each dialogue
        sampler.generate([a, b, c], max_new_tokens=4, temperature=0.0)
        a, b, c = (p + random_prompts([9], seed=30 + i)[0] for i, p in enumerate((a, b, c)))
    prompts, ns = [a, b, a, a, c, b], [1, 1, 2, 1, 1, 1]
    requests = [Request(p, SamplingParams(max_new_tokens=10, temperature=1.0, n=n, seed=40 + j, ignore_eos=True))
                for j, (p, n) in enumerate(zip(prompts, ns))]
    costs.reset()
    got = sampler.generate_requests(requests)
    counted = costs.snapshot()
    assert counted["sample_prompt_repeated_tokens"] == 2 * len(a) + len(b)
    assert counted["sample_prompt_padded_tokens"] == 4 * (16 if prompt_cache else 40)   # 3 distinct rows of 4
    if prompt_cache:
        assert counted["sample_prompt_reused_tokens"] == 40 + 29 + 35
    assert_same_samples(got, [alone.generate_requests([r])[0] for r in requests])


def test_sharded_prompt_cache_gives_the_unsharded_samples(hf_dir, sampler):
    from sweet_jax.sharding import make_mesh

    mesh = make_mesh((2, 2, 2))
    sharded = Sampler(load_hf(hf_dir, mesh=mesh), sampler.tokenizer, mesh=mesh, min_shared_prefix=16,
                      prompt_cache_mb=64, min_cached_prefix=16)
    plain = Sampler(sampler.model, sampler.tokenizer, min_shared_prefix=16)
    first, second, kwargs = dialogue_turns(plain, seed=2)
    sharded.generate(first, **kwargs)
    got, want = sharded.generate(second, **kwargs), plain.generate(second, **kwargs)
    assert sharded.prompt_cache.hits == 4
    assert [[s.token_ids for s in g] for g in got] == [[s.token_ids for s in g] for g in want]


def test_the_pipeline_keeps_its_sampler_between_stages_but_not_the_last_policy_s_prompt_cache(hf_dir, tmp_path):
    """A run's in-process sampler is reused by every rollout stage (its compiled programs); the K/V its prompt cache
    holds are the policy's that just played, which no later stage reads: they go when the stage ends."""
    import importlib.util
    import pathlib
    from sweet_jax.pipeline import stages
    path = pathlib.Path(__file__).parent.parent / "configs" / "pipeline.py"
    spec = importlib.util.spec_from_file_location("pipeline_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("demo")
    config.model.tokenizer, config.policy.prompt_cache_mb = str(hf_dir), 16
    run = stages.Run(config, tmp_path)
    with run.policy_sampler(str(hf_dir), tmp_path, seed=0) as sampler:
        sampler.generate(random_prompts([40, 45]), max_new_tokens=2, temperature=0.0)   # prompts cached
        assert sampler.prompt_cache.bytes > 0
    assert run.sampler is sampler and sampler.prompt_cache.bytes == 0 and not sampler.prompt_cache.entries
    with run.policy_sampler(str(hf_dir), tmp_path, seed=0) as again:
        assert again is sampler   # the next stage swaps the parameters into the same sampler
