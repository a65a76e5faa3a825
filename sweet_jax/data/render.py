"""Chat rendering with the tokenizer's own template: token ids plus a turn id for every token.

turn_ids[t] = 0 when token t is not part of an assistant reply, k >= 1 when it belongs to the k-th reply
(the reply's text tokens and its end-of-turn token, never the role header). How it is done: the template is
rendered over message prefixes to find where each reply's text sits in the full string, the full string is
tokenized once with character offsets, and tokens are assigned to replies by offset. Every reply span is then
checked: decoding it must give back the reply text (else RenderError). Works for any template that renders
prefixes as prefixes (Llama 3 / 3.1, Llama 2, ...).

Training-time information for the critic (c, the reference solution) is a template placed before the
dialogue; `info_placement` says where:
- "system" (default): a system message at the start (merged into an existing system message);
- "first_user": prefixed to the first user message (before the task statement);
- "raw_prefix": raw text before the whole rendered string, as the official code does.
Official pre-rendered turns (assistant `input`/`output` strings) are used verbatim: the text is the last
assistant turn's `input` + `output` + the template's end-of-turn; their info always goes as "raw_prefix".

Length policy (`fit_length`): a sequence over max_len either loses its earliest whole turns after the task
statement (reply k and the user message after it; the info, the task statement and the last turns stay), is
dropped, or (`cut_right`, the official trainer's) is cut after max_len tokens with its last token replaced by
eos; `LengthStats` counts all three and is logged by the callers.

Mask styles (`MASK_STYLES`): "turns" (default) labels each reply's text tokens and its end-of-turn token, as
above. "official" is the OpenRLHF fork's critic mask, built by `render_official_text` from the one string the
official code trains on (info + the last turn's `input` + `output`): the string loses trailing newlines and
gains " " + eos unless it ends with eos, and every token from right after each assistant header
(`<|start_header_id|>assistant<|end_header_id|>`, so the "\n\n" the template puts there is labelled) up to and
including the next eos is labelled.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import numpy as np

from sweet_jax.data.schema import Trajectory, Turn
from sweet_jax.data.tokenizers import TokenizerError, apply_chat_template, end_of_turn_ids
from sweet_jax.errors import SweetJaxError

log = logging.getLogger(__name__)

OFFICIAL_INFO_TEMPLATE = "In light that the final answer is: {ground_truth}."
OUTPUT_MARKER = "OUTPUT:"  # ColBench: an agent reply's text after this marker is what enters the dialogue
INFO_PLACEMENTS = ("system", "first_user", "raw_prefix")
MASK_STYLES = ("turns", "official")
OVERFLOWS = ("truncate", "drop", "cut_right")
# The fork's --response_template for Llama 3: labels start right after it.
RESPONSE_TEMPLATE = "<|start_header_id|>assistant<|end_header_id|>"


class RenderError(SweetJaxError):
    """The dialogue cannot be rendered into exact per-turn token spans."""


@dataclasses.dataclass(frozen=True)
class Rendered:
    """One token sequence: input_ids int32 [T], turn_ids int32 [T] (0 = not a trained reply token)."""
    input_ids: np.ndarray
    turn_ids: np.ndarray
    reply_starts: tuple[int, ...] = ()  # token index where each assistant reply begins (labelled or not)
    eos_id: int | None = None  # the tokenizer's eos: what overflow="cut_right" writes over the last token

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_turns(self) -> int:
        return int(self.turn_ids.max(initial=0))


@dataclasses.dataclass
class LengthStats:
    """What the length policy did; always reported (returned and logged), never silent."""
    total: int = 0
    kept: int = 0
    truncated: int = 0
    dropped: int = 0
    turns_dropped: int = 0
    tokens_cut: int = 0  # overflow="cut_right": tokens cut off the right end

    def add(self, other: "LengthStats") -> "LengthStats":
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def log(self, what: str = "sequences", max_len: int | None = None) -> None:
        level = logging.WARNING if self.truncated or self.dropped else logging.INFO
        log.log(level, "%s: %d in, %d kept (%d truncated by dropping %d early turns or cutting %d tokens off the "
                "right), %d dropped as longer than max_len=%s", what, self.total, self.kept, self.truncated,
                self.turns_dropped, self.tokens_cut, self.dropped, max_len)


def info_text(ground_truth: str, template: str = OFFICIAL_INFO_TEMPLATE) -> str:
    try:
        return template.format(ground_truth=ground_truth)
    except (KeyError, IndexError) as e:
        raise RenderError(f"info template {template!r} must use only the field {{ground_truth}} ({e})") from None


def place_info(messages: Sequence[dict], info: str, placement: str) -> tuple[list[dict], str]:
    """Return (messages, raw text prefix) with the info text placed as configured."""
    msgs = [dict(m) for m in messages]
    if placement == "raw_prefix":
        return msgs, info
    if placement == "system":
        if msgs and msgs[0]["role"] == "system":
            msgs[0]["content"] = info + "\n\n" + msgs[0]["content"]
        else:
            msgs.insert(0, {"role": "system", "content": info})
        return msgs, ""
    if placement == "first_user":
        for m in msgs:
            if m["role"] == "user":
                m["content"] = info + "\n\n" + m["content"]
                return msgs, ""
        raise RenderError("info_placement='first_user' but the dialogue has no user message")
    raise RenderError(f"info_placement must be one of {INFO_PLACEMENTS}, got {placement!r}")


def _template(tokenizer, messages, *, add_generation_prompt: bool) -> str:
    if not messages:
        return ""
    try:
        return apply_chat_template(tokenizer, messages, add_generation_prompt=add_generation_prompt)
    except TokenizerError:
        raise
    except Exception as e:  # jinja raise_exception and friends: say which template and why
        raise RenderError(f"the tokenizer's chat template failed on this dialogue: {type(e).__name__}: {e}") from e


def _end_of_turn_text(tokenizer) -> str:
    """The text the template writes after an assistant reply (Llama 3: <|eot_id|>, Llama 2: ' </s>')."""
    sentinel = "SENTINELREPLY"
    text = _template(tokenizer, [{"role": "user", "content": "u"}, {"role": "assistant", "content": sentinel}],
                     add_generation_prompt=False)
    return text[text.index(sentinel) + len(sentinel):]


def end_of_turn_token(tokenizer) -> int:
    """The end-of-turn token id the chat template writes after an assistant reply (Llama 3: <|eot_id|>)."""
    ids = tokenizer(_end_of_turn_text(tokenizer), add_special_tokens=False)["input_ids"]
    eot = end_of_turn_ids(tokenizer)
    found = [int(i) for i in ids if int(i) in eot]
    if not found:
        raise RenderError("the chat template writes no end-of-turn token after an assistant reply")
    return found[0]


def _tokenize(tokenizer, text: str):
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError as e:
        raise TokenizerError("rendering needs a fast (tokenizers-backed) tokenizer with offsets; load it with "
                             "sweet_jax.data.load_tokenizer") from e
    return np.asarray(enc["input_ids"], np.int32), enc["offset_mapping"]


def _spans_to_rendered(tokenizer, text: str, spans: Sequence[tuple[int, int, int]]) -> Rendered:
    """spans: (char_start, char_end, turn label) of each assistant reply's text in `text`, in order."""
    ids, offsets = _tokenize(tokenizer, text)
    turn_ids = np.zeros(len(ids), np.int32)
    eot = end_of_turn_ids(tokenizer)
    starts = np.array([s for s, _ in offsets], np.int64)
    ends = np.array([e for _, e in offsets], np.int64)
    # Offsets in order (fast tokenizers): a reply's tokens are found by bisection, not a pass over all tokens.
    ordered = bool(np.all(np.diff(starts) >= 0) and np.all(np.diff(ends) >= 0))
    reply_starts = []
    for k, (a, b, label) in enumerate(spans, start=1):
        # Content tokens: those overlapping [a, b); empty replies have none.
        if b <= a:
            inside = np.zeros(0, np.int64)
        elif ordered:
            inside = np.arange(np.searchsorted(ends, a, side="right"), np.searchsorted(starts, b, side="left"))
            inside = inside[(starts[inside] < b) & (ends[inside] > a)]  # zero-width tokens in between
        else:
            inside = np.nonzero((starts < b) & (ends > a))[0]
        after = int(np.searchsorted(starts, b, side="left")) if len(inside) == 0 else int(inside[-1]) + 1
        first = int(inside[0]) if len(inside) else after
        # Its end-of-turn token: the first end token after the text, with only whitespace in between.
        end_tok = after
        while end_tok < len(ids) and ids[end_tok] not in eot and not text[starts[end_tok]:ends[end_tok]].strip():
            end_tok += 1
        if end_tok >= len(ids) or ids[end_tok] not in eot:
            raise RenderError(f"reply {k}: no end-of-turn token after its text; the chat template must close "
                              "assistant turns with eos / <|eot_id|>")
        lo, hi = (int(starts[first]), int(ends[inside[-1]])) if len(inside) else (a, a)
        if text[lo:a].strip() or text[b:hi].strip():
            raise RenderError(f"reply {k}: a token straddles the reply boundary ({text[lo:hi]!r}); the "
                              "tokenizer merges reply text with the template around it")
        if label:
            turn_ids[inside] = label
            turn_ids[end_tok] = label
        reply_starts.append(first)
        if len(inside):
            decoded = tokenizer.decode(ids[inside].tolist(), skip_special_tokens=False)
            if decoded.strip() != text[a:b].strip():
                raise RenderError(f"reply {k}: decoding its tokens gives {decoded[:80]!r}, not the reply text "
                                  f"{text[a:b][:80]!r}")
    return Rendered(ids, turn_ids, tuple(reply_starts), tokenizer.eos_token_id)


def render_dialogue(tokenizer, messages: Sequence[dict], *, info: str | None = None,
                    info_template: str = OFFICIAL_INFO_TEMPLATE, info_placement: str = "system",
                    label: str = "all") -> Rendered:
    """Render a message list [{'role', 'content'}] with the tokenizer's chat template.

    info: training-time information (the ground truth) for the critic, formatted with info_template and
    placed by info_placement; None for the policy. label: "all" (reply k gets turn id k) or "last" (only
    the final reply, with turn id 1: a policy candidate after its prompt).
    """
    if label not in ("all", "last"):
        raise RenderError(f"label must be 'all' or 'last', got {label!r}")
    msgs, prefix = place_info(messages, info_text(info, info_template), info_placement) if info is not None \
        else ([dict(m) for m in messages], "")
    full = _template(tokenizer, msgs, add_generation_prompt=False)
    assistant = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if not assistant:
        raise RenderError("the dialogue has no assistant reply to label")
    spans = _reply_spans_by_sentinels(tokenizer, msgs, assistant, full)
    if spans is None:  # a template that rewrites replies: the prefix renders say where (quadratic in turns)
        spans = _reply_spans_by_prefixes(tokenizer, msgs, assistant, full)
    labels = [k for k in range(1, len(spans) + 1)] if label == "all" else [0] * (len(spans) - 1) + [1]
    off = len(prefix)
    return _spans_to_rendered(tokenizer, prefix + full, [(a + off, b + off, lab) for (a, b), lab in zip(spans, labels)])


SENTINEL = "\u2063SWEETJAX-REPLY-{}\u2063"  # invisible separators: no template or dialogue writes these


def _reply_spans_by_sentinels(tokenizer, msgs, assistant, full) -> list[tuple[int, int]] | None:
    """(start, end) of each reply's stripped text in `full` from one more render, linear in the dialogue: the
    dialogue with every reply replaced by a sentinel; putting the replies back in must give `full` exactly
    (else None: the template changes replies, and the caller falls back to the prefix renders)."""
    marked = [dict(m) for m in msgs]
    for k, i in enumerate(assistant):
        marked[i]["content"] = SENTINEL.format(k)
    skeleton = _template(tokenizer, marked, add_generation_prompt=False)
    for strip in (True, False):  # templates that trim replies (Llama 3), then those that keep them as written
        pieces, spans, cursor, length = [], [], 0, 0
        for k, i in enumerate(assistant):
            at = skeleton.find(SENTINEL.format(k), cursor)
            if at < 0:
                return None
            text = msgs[i]["content"].strip() if strip else msgs[i]["content"]
            pieces.append(skeleton[cursor:at])
            length += at - cursor
            lead = len(text) - len(text.lstrip())
            spans.append((length + lead, length + lead + len(text.strip())))
            pieces.append(text)
            length += len(text)
            cursor = at + len(SENTINEL.format(k))
        pieces.append(skeleton[cursor:])
        if "".join(pieces) == full:
            return spans
    return None


def _reply_spans_by_prefixes(tokenizer, msgs, assistant, full) -> list[tuple[int, int]]:
    """(start, end) of each reply's stripped text in `full`: reply k starts after the render of the dialogue
    before it with the generation header (one render per reply, so quadratic in the number of turns)."""
    spans, cursor = [], 0
    for k, i in enumerate(assistant, start=1):
        before = _template(tokenizer, msgs[:i], add_generation_prompt=True)
        if not full.startswith(before):
            raise RenderError(f"reply {k}: the chat template does not render the dialogue before it as a prefix "
                              "of the whole; per-turn spans cannot be found")
        cursor = max(cursor, len(before))
        content = msgs[i]["content"].strip()
        a = full.find(content, cursor)
        if a < 0 or full[cursor:a].strip():
            raise RenderError(f"reply {k}: its text is not where the template should put it (the template "
                              "rewrites replies?)")
        spans.append((a, a + len(content)))
        cursor = a + len(content)
    return spans


def _reply_forms(turn: Turn, last: bool) -> list[str]:
    """The texts a pre-rendered reply can appear as. The last one is its raw `output`, verbatim. An earlier one
    appears in later prompts as the dialogue recorded it: `output`, or, when the agent wrote "OUTPUT:" (its
    `output` is then "thoughts OUTPUT: reply"), only the reply: `content` / the text after the marker."""
    forms = [turn.output.strip()]
    if not last:
        forms.append(turn.content.strip())
        if OUTPUT_MARKER in turn.output:
            forms.append(turn.output.split(OUTPUT_MARKER)[1].strip())
    return list(dict.fromkeys(forms))


def render_prerendered(tokenizer, turns: Sequence[Turn], *, info: str | None = None,
                       info_template: str = OFFICIAL_INFO_TEMPLATE, label: str = "all") -> Rendered:
    """Render official turns: the last assistant turn's `input` + `output` (+ end-of-turn), info as raw prefix.

    Reply k sits right after its own `input` when that is a prefix of the whole text (the usual case); it is
    the first of its forms (_reply_forms) found there, so "OUTPUT:" or a repeated phrase inside a reply does
    not mislead the search."""
    replies = [t for t in turns if t.role == "assistant"]
    if not replies or any(t.input is None or t.output is None for t in replies):
        raise RenderError("pre-rendered rendering needs `input` and `output` on every assistant turn")
    last = replies[-1]
    prefix = info_text(info, info_template) if info is not None else ""
    body = last.input + last.output
    spans, cursor = [], 0
    for k, t in enumerate(replies, start=1):
        forms = _reply_forms(t, last=k == len(replies))
        if body.startswith(t.input) and len(t.input) >= cursor:
            at = len(body) - len(body[len(t.input):].lstrip())  # the template may put whitespace first
            found = next(((at, f) for f in forms if body.startswith(f, at)), None)
        else:  # inconsistent prompts (e.g. a history cut short): the first form found after the previous reply
            found = min(((a, f) for f in forms if (a := body.find(f, cursor)) >= 0), default=None)
        if found is None:
            raise RenderError(f"reply {k}: its `output` ({t.output[:60]!r}) is not found after its `input` in the "
                              "last turn's `input` + `output`; the turns' pre-rendered strings are inconsistent")
        a, text = found
        spans.append((a, a + len(text)))
        cursor = a + len(text)
    # Make every reply end with the template's end-of-turn text: inner ones already do, the last one does not.
    text = prefix + body + _end_of_turn_text(tokenizer)
    labels = list(range(1, len(spans) + 1)) if label == "all" else [0] * (len(spans) - 1) + [1]
    off = len(prefix)
    return _spans_to_rendered(tokenizer, text, [(a + off, b + off, lab) for (a, b), lab in zip(spans, labels)])


def render_trajectory(tokenizer, trajectory: Trajectory, *, with_info: bool = False,
                      info_template: str = OFFICIAL_INFO_TEMPLATE, info_placement: str = "system",
                      use_prerendered: bool = True, mask_style: str = "turns",
                      max_len: int | None = None) -> Rendered:
    """A trajectory with every reply labelled; with_info adds the task's ground truth (critic's c).

    mask_style="official": the fork's sequence and mask (render_official_text) over `official_text`, cut from
    the right at max_len when given (training leaves the cut to fit_length's cut_right, which gives the same
    tokens and mask, and counts it)."""
    info = trajectory.task.ground_truth if with_info else None
    if mask_style == "official":
        return render_official_text(tokenizer, official_text(tokenizer, trajectory, info=info,
                                                             info_template=info_template), max_len=max_len)
    if mask_style != "turns":
        raise RenderError(f"mask_style must be one of {MASK_STYLES}, got {mask_style!r}")
    if use_prerendered and trajectory.prerendered:
        return render_prerendered(tokenizer, trajectory.dialogue_history, info=info, info_template=info_template)
    return render_dialogue(tokenizer, trajectory.messages(), info=info, info_template=info_template,
                           info_placement=info_placement)


def official_text(tokenizer, trajectory: Trajectory, *, info: str | None = None,
                  info_template: str = OFFICIAL_INFO_TEMPLATE) -> str:
    """The one string the official code trains the critic on: info (raw prefix) + the last assistant turn's
    `input` + `output`. A message-form trajectory gets the same shape from the chat template: the dialogue
    before the last reply with the generation header, then the reply."""
    prefix = info_text(info, info_template) if info is not None else ""
    if trajectory.prerendered:
        last = [t for t in trajectory.dialogue_history if t.role == "assistant"][-1]
        return prefix + last.input + last.output
    messages = trajectory.messages()
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None:
        raise RenderError("the dialogue has no assistant reply to label")
    return prefix + _template(tokenizer, messages[:last], add_generation_prompt=True) + messages[last]["content"]


def render_official_text(tokenizer, text: str, *, max_len: int | None = None,
                         response_template: str = RESPONSE_TEMPLATE, label: str = "all") -> Rendered:
    """One string as the OpenRLHF fork's reward/DPO dataset tokenizes and masks it.

    The string loses its trailing newlines and gains " " + eos unless it already ends with eos; it is tokenized
    without added special tokens (the templated text carries its own), cut after max_len tokens, and its last
    token set to eos (so a cut sequence still ends with eos). Labels: every token from right after an
    occurrence of response_template's tokens up to and including the first eos after it; occurrence k gets
    turn id k ("all") or only the last one gets 1 ("last"). An occurrence with no token after it (the cut
    fell inside the header) labels nothing.
    """
    if label not in ("all", "last"):
        raise RenderError(f"label must be 'all' or 'last', got {label!r}")
    eos, eos_id = tokenizer.eos_token, tokenizer.eos_token_id
    if eos is None or eos_id is None:
        raise RenderError("mask_style='official' needs a tokenizer with an eos_token")
    text = text.rstrip("\n")
    if not text.endswith(eos):
        text += " " + eos
    ids, _ = _tokenize(tokenizer, text)
    if max_len is not None and len(ids) > max_len:
        ids = ids[:max_len]
    ids = ids.copy()
    ids[-1] = eos_id
    header, _ = _tokenize(tokenizer, response_template)
    h = len(header)
    if h == 0:
        raise RenderError(f"response_template {response_template!r} tokenizes to nothing")
    spans = []
    for p in np.flatnonzero(ids == header[0]):
        start = int(p) + h
        if start >= len(ids) or not np.array_equal(ids[p:start], header):
            continue
        end = start + int(np.argmax(ids[start:] == eos_id))  # the last token is eos: always found
        spans.append((start, end))
    if not spans:
        raise RenderError(f"no assistant header {response_template!r} in the text: nothing to label")
    turn_ids = np.zeros(len(ids), np.int32)
    labelled = spans if label == "all" else spans[-1:]
    for k, (start, end) in enumerate(labelled, start=1):
        turn_ids[start:end + 1] = k
    return Rendered(ids, turn_ids, tuple(start for start, _ in spans), int(eos_id))


def render_official_score(tokenizer, prompt_text: str, reply: str, *, info: str | None = None,
                          info_template: str = OFFICIAL_INFO_TEMPLATE,
                          response_template: str = RESPONSE_TEMPLATE + "\n\n") -> Rendered:
    """The sequence the official ranking script scores a candidate on, with turn id 1 on the scored tokens.

    The script sends info + prompt + reply + an empty assistant header to vLLM, which adds a BOS in front of the
    already templated string (so a second BOS precedes the text's own); of the prompt's token log-probs it drops
    the last header's tokens and averages those after the last eos: the header of the reply's own turn (4
    tokens on Llama 3) and the reply, no end-of-turn. The trailing header is left out here (a causal model's
    earlier log-probs do not depend on it)."""
    prefix = info_text(info, info_template) if info is not None else ""
    ids, _ = _tokenize(tokenizer, prefix + prompt_text + reply + response_template)
    tail = len(_tokenize(tokenizer, response_template)[0])
    bos = tokenizer.bos_token_id
    ids = np.concatenate([np.array([] if bos is None else [bos], np.int32), ids[:len(ids) - tail]]).astype(np.int32)
    eos = np.flatnonzero(ids[1:] == tokenizer.eos_token_id)  # ids[0] has no log-prob: the script never sees it
    first = int(eos[-1]) + 2 if len(eos) else 1
    if first >= len(ids):
        raise RenderError("nothing to score: the candidate and its header are empty")
    turn_ids = np.zeros(len(ids), np.int32)
    turn_ids[first:] = 1
    return Rendered(ids, turn_ids, (first,), tokenizer.eos_token_id)


def render_prompt(tokenizer, messages: Sequence[dict], *, info: str | None = None,
                  info_template: str = OFFICIAL_INFO_TEMPLATE, info_placement: str = "system") -> Rendered:
    """The prompt o_t for sampling the next reply: `.input_ids` end with the assistant header.

    turn_ids are all 0; reply_starts locate its earlier replies, so the length policy can drop them later.
    """
    msgs, prefix = place_info(messages, info_text(info, info_template), info_placement) if info is not None \
        else ([dict(m) for m in messages], "")
    ids, _ = _tokenize(tokenizer, prefix + _template(tokenizer, msgs, add_generation_prompt=True))
    starts: tuple[int, ...] = ()
    if any(m["role"] == "assistant" for m in messages):
        # The dialogue without the generation header renders as a prefix of the prompt: same reply starts.
        starts = render_dialogue(tokenizer, messages, info=info, info_template=info_template,
                                 info_placement=info_placement).reply_starts
    return Rendered(ids, np.zeros_like(ids), starts, tokenizer.eos_token_id)


def reply_from_tokens(prompt, reply_ids) -> Rendered:
    """A sampled candidate as a sequence: prompt tokens (turn id 0) then reply tokens (turn id 1).

    prompt: a Rendered (from render_prompt) or token ids. reply_ids should end with the end-of-turn token
    when the sampler stopped on it (so the model learns to stop).
    """
    starts = prompt.reply_starts if isinstance(prompt, Rendered) else ()
    eos_id = prompt.eos_id if isinstance(prompt, Rendered) else None
    prompt_ids = np.asarray(prompt.input_ids if isinstance(prompt, Rendered) else prompt, np.int32)
    reply_ids = np.asarray(reply_ids, np.int32).reshape(-1)
    if reply_ids.size == 0:
        raise RenderError("empty reply: a candidate needs at least one token")
    return Rendered(np.concatenate([prompt_ids, reply_ids]),
                    np.concatenate([np.zeros_like(prompt_ids), np.ones_like(reply_ids)]),
                    tuple(starts) + (len(prompt_ids),), eos_id)


def fit_length(rendered: Rendered, max_len: int | None, *, overflow: str = "truncate") -> tuple[Rendered | None, int]:
    """Apply the length policy: (sequence or None if dropped, number of early turns dropped, or of tokens cut).

    overflow="truncate" drops the earliest whole turns after the task statement (reply j and the user message
    after it; tokens [start of reply 1, start of reply j+1) are cut, so the first header is reused) until the
    sequence fits, keeping at least the last reply; if even that does not fit the sequence is dropped.
    overflow="drop" drops any over-long sequence. overflow="cut_right" (the official trainer's) keeps the first
    max_len tokens and writes eos over the last one; a reply cut short keeps that eos as its end (labelled).
    """
    if overflow not in OVERFLOWS:
        raise SweetJaxError(f"overflow must be one of {OVERFLOWS}, got {overflow!r}")
    if max_len is None or len(rendered) <= max_len:
        return rendered, 0
    if overflow == "cut_right":
        if rendered.eos_id is None:
            raise SweetJaxError("overflow='cut_right' needs the sequence's eos id (render it with sweet_jax.data.render)")
        ids, turn_ids = rendered.input_ids[:max_len].copy(), rendered.turn_ids[:max_len].copy()
        ids[-1] = rendered.eos_id  # labelled when the cut falls inside a reply: that reply then ends there
        starts = tuple(s for s in rendered.reply_starts if s < max_len)
        return dataclasses.replace(rendered, input_ids=ids, turn_ids=turn_ids, reply_starts=starts), \
            len(rendered) - max_len
    starts = rendered.reply_starts
    if overflow == "drop" or len(starts) < 2:
        return None, 0
    T = len(rendered)
    for j in range(1, len(starts)):
        cut = starts[j] - starts[0]  # drop replies 1..j (and what follows each of them up to reply j+1)
        if T - cut <= max_len:
            keep = np.r_[0:starts[0], starts[j]:T]
            turn_ids = rendered.turn_ids[keep]
            # Renumber the labelled replies that remain to 1..K'.
            labels = np.unique(turn_ids[turn_ids > 0])
            remap = np.zeros(int(rendered.turn_ids.max(initial=0)) + 1, np.int32)
            remap[labels] = np.arange(1, len(labels) + 1, dtype=np.int32)
            new_starts = (starts[0],) + tuple(s - cut for s in starts[j + 1:])
            return Rendered(rendered.input_ids[keep], remap[turn_ids], new_starts, rendered.eos_id), j
    return None, 0


def fit_all(seqs: Sequence[Rendered], max_len: int | None, *, overflow: str = "truncate",
            stats: LengthStats | None = None) -> tuple[Rendered, ...] | None:
    """fit_length on the P sequences of one example; the example is dropped if any sequence is."""
    stats = stats if stats is not None else LengthStats()
    stats.total += 1
    out, cut = [], 0
    for s in seqs:
        fitted, n = fit_length(s, max_len, overflow=overflow)
        if fitted is None:
            stats.dropped += 1
            return None
        out.append(fitted)
        cut += n
    stats.kept += 1
    if cut:
        stats.truncated += 1
        if overflow == "cut_right":
            stats.tokens_cut += cut
        else:
            stats.turns_dropped += cut
    return tuple(out)
