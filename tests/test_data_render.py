"""Chat rendering: per-turn token spans decode back to each reply, for Llama 3 / 3.1 and Llama 2 templates."""
import numpy as np
import pytest

from sweet_jax.data import (INFO_PLACEMENTS, LLAMA31_CHAT_TEMPLATE, LengthStats, Turn, build_llama2_tokenizer,
                            build_llama3_tokenizer, demo_paths, fit_all, fit_length, load_tokenizer, render_dialogue,
                            render_prerendered, render_prompt, reply_from_tokens)
from sweet_jax.data.tokenizers import TokenizerError, default_training_text

GT = "def double(x):\n    return 2 * x"
DIALOGUE = [
    {"role": "user", "content": "Write a function double(x). It should work on numbers."},
    {"role": "assistant", "content": "What type is x, an int or a float?"},
    {"role": "user", "content": "Either one."},
    {"role": "assistant", "content": "Should strings raise an error?"},
    {"role": "user", "content": "No, you can ignore strings."},
    {"role": "assistant", "content": "Is zero special?"},
    {"role": "user", "content": "No."},
    {"role": "assistant", "content": "I WANT TO ANSWER:\ndef double(x):\n    return x * 2"},
]
REPLIES = [m["content"] for m in DIALOGUE if m["role"] == "assistant"]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama3")
    build_llama3_tokenizer(out, default_training_text(max_files=8), vocab_size=600)
    return out


@pytest.fixture(scope="module", params=["llama3", "llama31", "llama2"])
def tok(request, bpe_dir, tmp_path_factory):
    if request.param == "llama2":
        return build_llama2_tokenizer(tmp_path_factory.mktemp("llama2"), default_training_text(max_files=8),
                                      vocab_size=400)
    tok = load_tokenizer(bpe_dir)
    if request.param == "llama31":  # always-present system block with dates; our system message goes inside it
        tok.chat_template = LLAMA31_CHAT_TEMPLATE
    return tok


def eot_text(tok):
    return "<|eot_id|>" if "<|eot_id|>" in tok.get_vocab() else tok.eos_token


@pytest.mark.parametrize("placement", [None, *INFO_PLACEMENTS])
def test_each_turn_span_decodes_to_its_reply_plus_end_token(tok, placement):
    info = GT if placement else None
    r = render_dialogue(tok, DIALOGUE, info=info, info_placement=placement or "system")
    assert r.input_ids.dtype == np.int32 and r.turn_ids.shape == r.input_ids.shape
    assert r.num_turns == 4
    for k, reply in enumerate(REPLIES, start=1):
        span = np.nonzero(r.turn_ids == k)[0]
        ids = r.input_ids[span]
        assert tok.decode(ids[:-1]) == reply
        assert tok.convert_ids_to_tokens(int(ids[-1])) == eot_text(tok)
        # Between the reply and its end token the template puts at most whitespace (Llama 2: ' </s>').
        assert tok.decode(r.input_ids[span[0]:span[-1] + 1]) in (reply + eot_text(tok), reply + " " + eot_text(tok))


def test_header_tokens_are_never_in_a_turn(tok):
    r = render_dialogue(tok, DIALOGUE)
    before_first = tok.decode(r.input_ids[:np.nonzero(r.turn_ids)[0][0]])
    assert before_first.rstrip().endswith("<|end_header_id|>" if "<|eot_id|>" in tok.get_vocab() else "[/INST]")
    # Every non-reply token decodes to template or user text only.
    rest = tok.decode(r.input_ids[r.turn_ids == 0])
    for reply in REPLIES:
        assert reply not in rest
    assert all(m["content"] in rest for m in DIALOGUE if m["role"] == "user")


def test_reply_tokens_are_the_generation_time_tokens(tok):
    # Prompt tokens followed by the reply tokenized alone + end token: what a sampler sees and produces.
    prompt = render_prompt(tok, DIALOGUE[:-1])
    reply = tok(REPLIES[-1], add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids(eot_text(tok))]
    sampled = reply_from_tokens(prompt, reply)
    rendered = render_dialogue(tok, DIALOGUE, label="last")
    if "<|eot_id|>" in tok.get_vocab():  # Llama 2 renders a space before </s>, which a sampler need not emit
        np.testing.assert_array_equal(sampled.input_ids, rendered.input_ids)
        np.testing.assert_array_equal(sampled.turn_ids, rendered.turn_ids)
    np.testing.assert_array_equal(sampled.input_ids[:len(prompt.input_ids)], rendered.input_ids[:len(prompt.input_ids)])
    assert sampled.reply_starts[:-1] == rendered.reply_starts[:-1]  # earlier replies, for truncation
    assert set(np.unique(rendered.turn_ids)) == {0, 1}


@pytest.mark.parametrize("placement", INFO_PLACEMENTS)
def test_info_goes_before_the_task_statement(tok, placement):
    r = render_dialogue(tok, DIALOGUE, info=GT, info_placement=placement)
    text = tok.decode(r.input_ids)
    info = f"In light that the final answer is: {GT}."
    assert text.index(info) < text.index(DIALOGUE[0]["content"])
    if placement == "raw_prefix":
        assert text.startswith(info)
    plain = render_dialogue(tok, DIALOGUE)
    assert len(r) > len(plain) and r.num_turns == plain.num_turns


def test_custom_info_template(tok):
    r = render_dialogue(tok, DIALOGUE, info=GT, info_template="Reference solution:\n{ground_truth}")
    assert "Reference solution:\n" + GT in tok.decode(r.input_ids)


def official_turns(tok, system_prompt):
    """Official-style turns: each assistant turn holds the templated prompt it saw (with the agent's system
    prompt, which is not part of the dialogue) and its raw output."""
    turns, msgs = [], [{"role": "system", "content": system_prompt}]
    for m in DIALOGUE:
        if m["role"] == "assistant":
            prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            turns.append(Turn("assistant", m["content"], input=prompt, output=m["content"]))
        else:
            turns.append(Turn("user", m["content"]))
        msgs.append(m)
    return turns


def test_prerendered_official_turns_match_message_rendering(tok):
    system = "You are an agent. Ask questions, then answer with I WANT TO ANSWER:."
    turns = official_turns(tok, system)
    pre = render_prerendered(tok, turns, info=GT)
    ref = render_dialogue(tok, [{"role": "system", "content": system}] + DIALOGUE, info=GT,
                          info_placement="raw_prefix")
    for k, reply in enumerate(REPLIES, start=1):
        assert tok.decode(pre.input_ids[pre.turn_ids == k][:-1]) == reply
    if "<|eot_id|>" not in tok.get_vocab():
        return  # Llama 2's prompt ends at [/INST] and the raw output has no leading space: one token differs
    np.testing.assert_array_equal(pre.input_ids, ref.input_ids)
    np.testing.assert_array_equal(pre.turn_ids, ref.turn_ids)
    assert pre.reply_starts == ref.reply_starts


def test_prerendered_turns_whose_replies_hold_output_markers(tok):
    """Replies written as "thoughts OUTPUT: reply", recorded by the environment as the official files do:
    `output` is the raw reply, `content` (what later prompts show) only the text after the marker; the last
    reply also quotes "OUTPUT:" in its code. Each span is the reply as the model wrote it at that point: the
    text after the marker for earlier replies (that is what the dialogue holds), the raw output for the last."""
    from sweet_jax.envs import ColBenchEnv
    from sweet_jax.data.schema import Trajectory

    env = ColBenchEnv({"problem_description": DIALOGUE[0]["content"], "ground_truth": GT, "test_cases": {}})
    raw = ["I should ask about types. OUTPUT: What type is x, an int or a float?",
           "Strings next.OUTPUT:Should strings raise an error?",
           "I know enough. OUTPUT: I WANT TO ANSWER:\ndef double(x):\n    print('OUTPUT: doubling')\n    return x * 2"]
    for k, reply in enumerate(raw):
        prompt = tok.apply_chat_template(env.messages(), tokenize=False, add_generation_prompt=True)
        if not env.act(reply, prompt=prompt):
            env.observe(["Either one.", "No, you can ignore strings."][k])
    trajectory = Trajectory.from_json(env.trajectory(reward=1.0))
    assert trajectory.prerendered
    r = render_prerendered(tok, trajectory.dialogue_history, info=GT)
    assert r.num_turns == 3
    last = trajectory.dialogue_history[-1].output  # the environment cuts the raw reply at a second "OUTPUT:"
    assert last.startswith("I know enough. OUTPUT: I WANT TO ANSWER:") and last.endswith("print('")
    want = ["What type is x, an int or a float?", "Should strings raise an error?", last]
    for k, text in enumerate(want, start=1):
        assert tok.decode(r.input_ids[r.turn_ids == k][:-1]).strip() == text
    assert tok.convert_ids_to_tokens(int(r.input_ids[r.turn_ids == 3][-1])) == eot_text(tok)


def test_truncation_drops_earliest_turns_and_equals_rendering_the_shorter_dialogue(tok):
    full = render_dialogue(tok, DIALOGUE, info=GT)
    shorter = render_dialogue(tok, DIALOGUE[:1] + DIALOGUE[5:], info=GT)  # replies 1 and 2 dropped
    fitted, dropped = fit_length(full, len(shorter))
    assert dropped == 2
    np.testing.assert_array_equal(fitted.input_ids, shorter.input_ids)
    np.testing.assert_array_equal(fitted.turn_ids, shorter.turn_ids)  # renumbered 1..2
    assert fitted.reply_starts == shorter.reply_starts
    text = tok.decode(fitted.input_ids)
    assert GT in text and DIALOGUE[0]["content"] in text and REPLIES[0] not in text


def test_length_policy_drop_and_counts(tok):
    r = render_dialogue(tok, DIALOGUE)
    last_only = render_dialogue(tok, DIALOGUE[:1] + DIALOGUE[7:])
    assert fit_length(r, len(r))[0] is r
    assert fit_length(r, len(r) - 1, overflow="drop") == (None, 0)
    assert fit_length(r, len(last_only) - 1) == (None, 0)  # even the last turn alone does not fit
    stats = LengthStats()
    kept = [fit_all((r,), m, stats=stats) for m in (len(r), len(r) - 1, len(last_only) - 1)]
    assert [k is not None for k in kept] == [True, True, False]
    assert (stats.total, stats.kept, stats.truncated, stats.dropped, stats.turns_dropped) == (3, 2, 1, 1, 1)


def test_policy_example_truncation_keeps_the_candidate(tok):
    prompt = render_prompt(tok, DIALOGUE[:-1], info=GT)
    reply = tok(REPLIES[-1], add_special_tokens=False)["input_ids"]
    seq = reply_from_tokens(prompt, reply)
    fitted, dropped = fit_length(seq, len(seq) - 10)
    assert dropped >= 1 and fitted.turn_ids.max() == 1
    np.testing.assert_array_equal(fitted.input_ids[fitted.turn_ids == 1], reply)
    assert GT in tok.decode(fitted.input_ids)


def test_demo_tokenizer_has_llama3_chat_template():
    tok = load_tokenizer(demo_paths().tokenizer)
    r = render_dialogue(tok, DIALOGUE, info=GT)
    assert tok.decode(r.input_ids[r.turn_ids == 4]) == REPLIES[-1] + "<|eot_id|>"
    assert 2000 <= len(tok) <= 8192 and tok.pad_token_id is not None


def test_tokenizer_without_chat_template_is_refused(tmp_path, tok):
    tok.save_pretrained(tmp_path)
    tok2 = load_tokenizer(tmp_path)
    tok2.chat_template = None
    tok2.save_pretrained(tmp_path / "plain")
    for f in (tmp_path / "plain").glob("chat_template*"):
        f.unlink()
    import json
    cfg = json.loads((tmp_path / "plain" / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (tmp_path / "plain" / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerError, match="no chat template"):
        load_tokenizer(tmp_path / "plain")
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")


def counting_templates(tok, monkeypatch):
    """The number of chat-template renders, and how many characters they produced."""
    from sweet_jax.data import render
    counts = {"calls": 0, "chars": 0}
    original = render._template

    def counted(*args, **kwargs):
        text = original(*args, **kwargs)
        counts["calls"] += 1
        counts["chars"] += len(text)
        return text
    monkeypatch.setattr(render, "_template", counted)
    return counts


def long_dialogue(turns: int) -> list[dict]:
    out = [DIALOGUE[0]]
    for k in range(turns):
        out += [{"role": "assistant", "content": f"Question {k}: is {k} special?"}, {"role": "user", "content": "No."}]
    return out + [DIALOGUE[-1]]


def test_rendering_work_is_linear_in_the_number_of_turns(tok, monkeypatch):
    """Two renders of the dialogue whatever its length (one rendered each reply's prefix: quadratic)."""
    work = {}
    for turns in (5, 50):
        counts = counting_templates(tok, monkeypatch)
        render_dialogue(tok, long_dialogue(turns))
        work[turns] = counts["chars"]
        assert counts["calls"] <= 3
    assert work[50] < 12 * work[5]  # 10x the turns, about 10x the characters


def test_the_linear_spans_are_the_prefix_renders_spans(tok):
    from sweet_jax.data import render
    for dialogue in (DIALOGUE, long_dialogue(12), [dict(m, content=f"  {m['content']}\n") for m in DIALOGUE]):
        msgs = [dict(m) for m in dialogue]
        full = render._template(tok, msgs, add_generation_prompt=False)
        assistant = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        assert render._reply_spans_by_sentinels(tok, msgs, assistant, full) == \
            render._reply_spans_by_prefixes(tok, msgs, assistant, full)


def test_a_template_that_rewrites_replies_falls_back_to_the_prefix_renders_and_its_error(bpe_dir):
    from sweet_jax.data import RenderError
    tok = load_tokenizer(bpe_dir)
    tok.chat_template = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                         "{{ m['content'] | upper if m['role'] == 'assistant' else m['content'] }}<|eot_id|>"
                         "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>"
                         "\n\n{% endif %}")
    with pytest.raises(RenderError, match="rewrites replies"):
        render_dialogue(tok, DIALOGUE)


@pytest.mark.parametrize("template, bound", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x", "ran past 1 s"),
    ("{% for m in messages %}{% for i in range(100000) %}{% for j in range(100000) %}{{ m['content'] }}"
     "{% endfor %}{% endfor %}{% endfor %}", "wrote .* characters"),
])
def test_a_hostile_chat_template_is_stopped_at_its_time_or_size_bound(bpe_dir, monkeypatch, template, bound):
    from sweet_jax.data import tokenizers
    monkeypatch.setattr(tokenizers, "TEMPLATE_SECONDS", 1.0)
    monkeypatch.setattr(tokenizers, "TEMPLATE_MAX_CHARS", 1 << 20)
    tok = load_tokenizer(bpe_dir)
    tok.chat_template = template
    with pytest.raises(tokenizers.TemplateBoundError, match=bound):
        render_dialogue(tok, DIALOGUE)


@pytest.mark.parametrize("template, bound", [
    ("{{ 10 ** (10 ** 8 * messages | length) % 7 }}", r"ran past 1 s"),  # minutes of C code, no line to stop at
    ("{{ 'a' * 2 * 10 ** 9 }}", r"ran out of its 1024 MiB"),        # 2 GB in one C call
    ("{{ 'x' | center(3 * 10 ** 9) }}", r"ran out of its 1024 MiB"),
])
def test_a_template_that_hangs_or_grows_in_c_code_is_stopped_and_the_next_render_is_honest(bpe_dir, monkeypatch,
                                                                                           template, bound):
    """The template runs in its own process (tokenizers._template_worker): killed past TEMPLATE_SECONDS, its data
    limited to TEMPLATE_MEMORY_BYTES, where the trainer's process could only wait or swap. The renderer restarts."""
    from sweet_jax.data import tokenizers
    monkeypatch.setattr(tokenizers, "TEMPLATE_SECONDS", 1.0)
    tok = load_tokenizer(bpe_dir)
    honest = tok.apply_chat_template(DIALOGUE, tokenize=False, add_generation_prompt=False)
    tok.chat_template, original = template, tok.chat_template
    with pytest.raises(tokenizers.TemplateBoundError, match=bound):
        render_dialogue(tok, DIALOGUE)
    tok.chat_template = original
    assert tokenizers.apply_chat_template(tok, DIALOGUE, add_generation_prompt=False) == honest


def test_a_template_that_raises_is_a_render_error_naming_its_message(bpe_dir):
    from sweet_jax.data import RenderError
    tok = load_tokenizer(bpe_dir)
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(RenderError, match=r"chat template failed on this dialogue: .*TemplateError: roles must alt"):
        render_dialogue(tok, DIALOGUE)
