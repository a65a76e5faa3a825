"""Tokenizers: loading a checkpoint's own tokenizer, and building small ones with real chat templates.

Two template families are supported end to end (rendering, turn masks, generation):
- Llama 3: byte-level BPE with <|begin_of_text|> / <|start_header_id|> / <|end_header_id|> / <|eot_id|>.
- Llama 2: sentencepiece with "<s>[INST] ... [/INST] reply </s>".
The builders here train tiny versions of both (used by tests and by the bundled demo tokenizer).
"""
from __future__ import annotations

import atexit
import json
import os
import pathlib
import select
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from typing import Iterable, Iterator

import sentencepiece as spm
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from sweet_jax import lazy
from sweet_jax.errors import SweetJaxError


class TokenizerError(SweetJaxError):
    """The tokenizer cannot be used for chat rendering (missing files, no chat template, ...)."""


# A chat template comes with the model files, so it is untrusted: a template with nested loops hangs the first
# render, one that repeats a string fills memory, and one that computes 10 ** 10 ** 10 never returns to Python.
# Honest renders take milliseconds and a few hundred KB. So templates render in a child process
# (_template_worker.py): killed past TEMPLATE_SECONDS, its data limited to TEMPLATE_MEMORY_BYTES, its output to
# TEMPLATE_MAX_CHARS characters (counted as the template writes them).
TEMPLATE_SECONDS = 10.0
TEMPLATE_MAX_CHARS = 32 << 20
TEMPLATE_MEMORY_BYTES = 1 << 30
TEMPLATE_START_SECONDS = 120.0   # the child's start (importing transformers' template code: ~3 s on 2 busy cores)
_WORKER = pathlib.Path(__file__).with_name("_template_worker.py")


class TemplateBoundError(TokenizerError):
    """A chat template that ran past its time, size or memory bound."""


class TemplateFailed(RuntimeError):
    """A chat template that raised (its raise_exception, a wrong field): 'TypeName: message' from the child."""


class _TemplateRenderer:
    """The one child process that renders chat templates for this process: started on the first render, one
    request at a time, killed and restarted on the next render after a bound was hit."""

    def __init__(self):
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None

    def _start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                   TRANSFORMERS_VERBOSITY="error", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
        self.proc = subprocess.Popen([sys.executable, "-I", str(_WORKER), str(TEMPLATE_MEMORY_BYTES)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env=env, start_new_session=True)
        self.buffer, self.pid = b"", os.getpid()
        if self._read_line(time.monotonic() + TEMPLATE_START_SECONDS) is None:
            self.kill()
            raise TokenizerError(f"the chat-template renderer ({_WORKER.name}) did not start within "
                                 f"{TEMPLATE_START_SECONDS:g} s")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            for f in (self.proc.stdin, self.proc.stdout):
                f.close()
            self.proc = None

    def _read_line(self, deadline: float, max_bytes: int = 1 << 20) -> bytes | None:
        """One line from the child by `deadline`, at most max_bytes; None past either or when it died."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or len(self.buffer) > max_bytes or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return None
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line

    def render(self, request: dict, seconds: float) -> dict | None:
        """The child's answer, or None when it ran past `seconds` (or died: its memory limit) and was killed."""
        data = (json.dumps(request, ensure_ascii=False, default=str) + "\n").encode("utf-8")
        with self.lock:
            if self.proc is not None and self.pid != os.getpid():   # a forked child: the pipes are the parent's
                self.proc = None
            if self.proc is None or self.proc.poll() is not None:
                self.kill()
                self._start()
            try:
                self.proc.stdin.write(data)
                self.proc.stdin.flush()
            except BrokenPipeError:
                self.kill()
                return None
            line = self._read_line(time.monotonic() + seconds, max_bytes=6 * request["max_chars"] + 4096)
            if line is None:
                self.kill()
                return None
            return json.loads(line)


_renderer = _TemplateRenderer()
atexit.register(_renderer.kill)


def apply_chat_template(tokenizer, messages, *, add_generation_prompt: bool, seconds: float | None = None) -> str:
    """tokenizer.apply_chat_template(messages, tokenize=False), rendered in the template child process under
    TEMPLATE_SECONDS, TEMPLATE_MAX_CHARS and TEMPLATE_MEMORY_BYTES; past a bound a TemplateBoundError, a template
    that raises a TemplateFailed. The one way sweet_jax renders a chat template."""
    seconds = TEMPLATE_SECONDS if seconds is None else seconds
    messages = list(messages)
    if not messages:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    request = {"template": tokenizer.get_chat_template(None, None), "messages": messages,
               "add_generation_prompt": add_generation_prompt, "tokens": dict(tokenizer.special_tokens_map),
               "max_chars": TEMPLATE_MAX_CHARS}
    answer = _renderer.render(request, seconds)
    if answer is None or answer.get("bound") == "memory":
        why = (f"ran past {seconds:g} s (tokenizers.TEMPLATE_SECONDS) or past {TEMPLATE_MEMORY_BYTES >> 20} MiB "
               "(tokenizers.TEMPLATE_MEMORY_BYTES)" if answer is None else
               f"ran out of its {TEMPLATE_MEMORY_BYTES >> 20} MiB (tokenizers.TEMPLATE_MEMORY_BYTES)")
        raise TemplateBoundError(f"the tokenizer's chat template {why} on one dialogue; a template that does this is "
                                 "damaged or hostile: use the model's original tokenizer_config.json")
    if answer.get("bound") == "size":
        raise TemplateBoundError(f"the tokenizer's chat template wrote {answer['chars']} characters for one dialogue, "
                                 f"more than {TEMPLATE_MAX_CHARS} (tokenizers.TEMPLATE_MAX_CHARS); use the model's "
                                 "original tokenizer_config.json")
    if "error" in answer:
        raise TemplateFailed(answer["error"])
    return answer["text"]


# Llama 3 (3.0) instruct template: every message is header + trimmed content + <|eot_id|>.
LLAMA3_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Llama 3.1 instruct template without tool calling: a system block with the knowledge/today dates is always
# rendered first (the dialogue's own system message, if any, goes inside it).
LLAMA31_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if not date_string is defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\n' }}{{- 'Today Date: ' + date_string + '\n\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)

# Llama 2 chat template (system message folded into the first [INST] block).
LLAMA2_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)

LLAMA3_SPECIAL_TOKENS = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
    "<|finetune_right_pad_id|>",
)

# Llama 3's pre-tokenizer split pattern (contractions, words, numbers in groups of 3, punctuation, spaces).
LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def load_tokenizer(path, *, require_chat_template: bool = True):
    """Load a Hugging Face tokenizer from a local directory; it must carry a chat template (unless not
    require_chat_template: a server's plain completions need none)."""
    transformers = lazy.transformers()
    path = pathlib.Path(os.fspath(path))
    if not path.is_dir():
        raise TokenizerError(f"tokenizer directory {path} does not exist; pass the checkpoint or tokenizer "
                             "directory (holding tokenizer.json / tokenizer.model and tokenizer_config.json)")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # transformers raises many types here; the user needs the path and the cause.
        raise TokenizerError(f"could not load a tokenizer from {path}: {type(e).__name__}: {e}") from e
    if require_chat_template:
        check_chat_template(tokenizer, where=str(path))
    return tokenizer


def check_chat_template(tokenizer, *, where: str = "tokenizer"):
    if not getattr(tokenizer, "chat_template", None):
        raise TokenizerError(
            f"{where} has no chat template (tokenizer_config.json 'chat_template' or chat_template.jinja); "
            "sweet_jax renders dialogues with the model's own template: use an instruct checkpoint's tokenizer "
            "or set tokenizer.chat_template")


def check_vocab(vocab_size: int, tokenizer, *, model: str = "the model", where: str = "the tokenizer") -> None:
    """A model whose vocabulary is smaller than its tokenizer's would look up rows that do not exist (XLA clamps
    the index: wrong numbers, no error): refuse the pair, naming both sizes."""
    if int(vocab_size) < len(tokenizer):
        raise TokenizerError(f"{model} has a vocabulary of {int(vocab_size)} tokens but {where} has {len(tokenizer)}: "
                             "they do not belong together; use the model's own tokenizer (or a model trained with "
                             "this one)")


def end_of_turn_ids(tokenizer) -> frozenset[int]:
    """Token ids that close an assistant turn (eos and, for Llama 3, <|eot_id|>)."""
    ids = set()
    for tok in ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|im_end|>", getattr(tokenizer, "eos_token", None)):
        if tok is None:
            continue
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid >= 0:
            ids.add(tid)
    if not ids:
        raise TokenizerError("tokenizer has no end-of-turn token (eos_token / <|eot_id|>)")
    return frozenset(ids)


def pad_id(tokenizer) -> int:
    """Padding id: the tokenizer's pad token, else its eos (padding is masked out anyway)."""
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if isinstance(tid, int):
            return tid
    return 0


# ----------------------------------------------------------------------------------------------------
# Builders for small tokenizers with real chat templates.

def default_training_text(max_files: int = 80, extra_files: Iterable = ()) -> Iterator[str]:
    """Python sources from the standard library (deterministic order) plus any extra text files."""
    for f in extra_files:
        f = pathlib.Path(f)
        if f.exists():
            yield f.read_text(encoding="utf-8", errors="replace")
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.stat().st_size < 200_000)[:max_files]
    for f in files:
        yield f.read_text(encoding="utf-8", errors="replace")
    yield ENGLISH_SAMPLE


def build_llama3_tokenizer(out_dir, texts: Iterable[str], *, vocab_size: int = 2048,
                           chat_template: str = LLAMA3_CHAT_TEMPLATE):
    """Train a Llama-3-style byte-level BPE tokenizer on `texts` and save it as a HF tokenizer directory."""
    transformers = lazy.transformers()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(LLAMA3_SPECIAL_TOKENS), min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(list(LLAMA3_SPECIAL_TOKENS))
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
        pad_token="<|finetune_right_pad_id|>", clean_up_tokenization_spaces=False,
        model_max_length=131072)
    hf.chat_template = chat_template
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out_dir))
    _write_portable_config(out_dir, hf, "PreTrainedTokenizerFast")
    return load_tokenizer(out_dir)


def _write_portable_config(out_dir: pathlib.Path, hf, tokenizer_class: str):
    # transformers 5 writes the template to chat_template.jinja and no special_tokens_map.json; older
    # transformers and vLLM read both from the JSON files, so write them there too.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = hf.chat_template
    cfg["tokenizer_class"] = tokenizer_class
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    special = {k: str(getattr(hf, k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")
               if getattr(hf, k, None) is not None}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def build_llama2_tokenizer(out_dir, texts: Iterable[str], *, vocab_size: int = 512,
                           chat_template: str = LLAMA2_CHAT_TEMPLATE):
    """Train a Llama-2-style sentencepiece BPE (byte fallback) model and save it with a Llama 2 chat template."""
    transformers = lazy.transformers()
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = pathlib.Path(tmp) / "corpus.txt"
        corpus.write_text("\n".join(line for t in texts for line in t.splitlines() if line.strip()),
                          encoding="utf-8")
        spm.SentencePieceTrainer.train(
            input=str(corpus), model_prefix=str(pathlib.Path(tmp) / "tokenizer"), vocab_size=vocab_size,
            model_type="bpe", byte_fallback=True, character_coverage=1.0, split_digits=True,
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1, add_dummy_prefix=True,
            remove_extra_whitespaces=False, normalization_rule_name="identity",
            allow_whitespace_only_pieces=True, minloglevel=2, num_threads=1)
        (out_dir / "tokenizer.model").write_bytes((pathlib.Path(tmp) / "tokenizer.model").read_bytes())
    hf = transformers.LlamaTokenizer.from_pretrained(str(out_dir))
    hf.chat_template = chat_template
    hf.save_pretrained(str(out_dir))
    _write_portable_config(out_dir, hf, "LlamaTokenizer")
    return load_tokenizer(out_dir)


ENGLISH_SAMPLE = """\
You are a helpful programming assistant. Ask clarifying questions when the task is ambiguous, and when you
are ready, write the final answer. The user will explain what the function should do. Could you tell me
which inputs the function receives, what it should return, and how it should handle edge cases such as
empty lists, negative numbers, missing keys or invalid values? Thank you, that helps. I want to answer now.
The function takes a list of numbers and returns the sum of the even ones. If the list is empty it returns
zero. Please round the result to two decimal places. The discount applies only to orders above one hundred
dollars. Strings should be compared without case. Return None when the input is invalid. Yes, that is right.
No, the order does not matter. Sort the result in ascending order by name, then by age. The score is the
average of the three highest values. Ignore duplicates. Count the words in the sentence and return a
dictionary from each word to its number of occurrences.
"""

