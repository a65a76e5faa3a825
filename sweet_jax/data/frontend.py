"""ColBench frontend-design tasks: the JSONL format, the image-URL rewrite, and HTML extraction from a reply.

A task is one JSON object a line: `problem_description` (a short idea of the page, what the user asks for) and
`ground_truth` (the HTML of the page the user has in mind); other fields are kept. The official rows (derived
from WebSight v0.2) have the same two fields and load as they are. Tasks load as `schema.Task` (no test cases;
the hidden information is the ground-truth HTML), so trajectories, pairs and ranking treat both tracks alike.

Pictures: WebSight pages point at random-picture services (source.unsplash.com/random/WxH/..., picsum.photos).
Every such URL is rewritten to the one local placeholder picture at the same size, `placeholder_url(w, h)`, which
the renderer serves; pages have no network, so any other picture shows as missing.
"""
from __future__ import annotations

import re

from sweet_jax.data.loading import Loaded, load_rows
from sweet_jax.data.schema import DataError, Task

PLACEHOLDER_HOST = "placeholder.invalid"
MAX_PLACEHOLDER_SIDE = 4096


def placeholder_url(width: int, height: int) -> str:
    """The local placeholder picture of this size (served by sweet_jax.envs.browser.PageServer)."""
    return f"http://{PLACEHOLDER_HOST}/{int(width)}x{int(height)}.png"


_PICTURE_URLS = re.compile(
    r"https?://source\.unsplash\.com/random/(?P<w1>\d+)x(?P<h1>\d+)(?:/\?[\w=,&%+-]*)?"
    r"|https?://picsum\.photos/(?:id/\d+/)?(?P<w2>\d+)/(?P<h2>\d+)")


def rewrite_image_urls(html: str) -> str:
    """Random-picture URLs -> the local placeholder at the same width x height."""
    def local(match: re.Match) -> str:
        width = match.group("w1") or match.group("w2")
        height = match.group("h1") or match.group("h2")
        return placeholder_url(width, height)
    return _PICTURE_URLS.sub(local, html)


def _first_element(text: str, tag: str) -> str | None:
    """The first `<tag...>...</tag>` of text, as the regex `<tag.*?>.*?</tag>` (DOTALL) finds it, in linear time.

    The regex's leftmost match starts at the first `<tag` that has a `>` after it and a closing tag after that;
    a later `<tag` would find its `>` and closing tag no earlier, so trying the first one is enough.
    """
    start = text.find(f"<{tag}")
    if start < 0:
        return None
    open_end = text.find(">", start + len(tag) + 1)
    if open_end < 0:
        return None
    close = text.find(f"</{tag}>", open_end + 1)
    if close < 0:
        return None
    return text[start:close + len(tag) + 3]


def extract_html(reply: str) -> str | None:
    """The page in an agent's reply: its first <html ...>...</html>, else its first <body ...>...</body>, with
    picture URLs rewritten to the local placeholder; None when the reply holds neither."""
    html = _first_element(reply, "html") or _first_element(reply, "body")
    return rewrite_image_urls(html) if html is not None else None


def frontend_task_from_json(obj, where: str = "") -> Task:
    task = Task.from_json(obj, where=where)
    if "<" not in task.ground_truth or not task.ground_truth.strip():
        raise DataError("must be the HTML of the page (no tag found)", where=where, field="ground_truth")
    if task.test_cases:
        raise DataError("a frontend task has no test cases (is this a backend task file?)", where=where,
                        field="test_cases")
    truth = rewrite_image_urls(task.ground_truth)
    return Task(task.problem_description, truth, {}, truth, task.extra)


def load_frontend_tasks(path, *, skip_bad: bool = False) -> Loaded:
    """Frontend tasks from JSONL (this project's demo set or the official WebSight-derived rows)."""
    return load_rows(path, frontend_task_from_json, skip_bad=skip_bad, what="frontend tasks")
