"""The chat-template renderer's child process (sweet_jax.data.tokenizers.apply_chat_template), run as a script so
that it imports only transformers' template code, never sweet_jax or jax. A chat template is untrusted code from
the model files: here it runs under a data-size limit (argv[1] bytes, RLIMIT_DATA) and is killed by the parent
past its wall-clock bound, so a template that loops in C (a huge power, a string repeated 10**10 times) ends in
bounded time and memory, which no check inside the trainer's process can promise.

Protocol: one JSON request a line on stdin {"template", "messages", "add_generation_prompt", "tokens",
"max_chars"}; one JSON answer a line on stdout: {"text"} or {"bound": "size"|"memory", "chars"} or {"error"}.
"""
import json
import resource
import sys

_TEMPLATE_CODE = "<template>"  # the co_filename of the Python code jinja2 compiles a template into


class _TooBig(Exception):
    pass


def render(request, render_jinja_template, normalize) -> dict:
    written = [0]
    max_chars = request["max_chars"]

    def in_template(frame, event, arg):
        if event == "return" and isinstance(arg, str):  # the template's code yields its output piece by piece
            written[0] += len(arg)
            if written[0] > max_chars:
                raise _TooBig()
        return in_template

    def on_call(frame, event, arg):
        if frame.f_code.co_filename != _TEMPLATE_CODE:
            return None
        frame.f_trace_lines = False   # only its returns: the pieces it yields
        return in_template

    sys.settrace(on_call)
    try:
        rendered, _ = render_jinja_template(
            conversations=[normalize(request["messages"])],
            tools=None, documents=None, chat_template=request["template"], return_assistant_tokens_mask=False,
            continue_final_message=False, add_generation_prompt=request["add_generation_prompt"],
            **request["tokens"])
        text = rendered[0]
    except _TooBig:
        return {"bound": "size", "chars": written[0]}
    except MemoryError:
        return {"bound": "memory"}
    except RecursionError:
        return {"error": "RecursionError: the template recursed too deeply"}
    except Exception as e:  # raise_exception and friends: the parent names the template and the cause
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        sys.settrace(None)
    if len(text) > max_chars:
        return {"bound": "size", "chars": len(text)}
    return {"text": text}


def main() -> None:
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    from transformers.utils import chat_template_utils   # after the memory limit: the import counts against it

    # what tokenizer.apply_chat_template does before it renders: messages' None values dropped
    normalize = getattr(chat_template_utils, "_normalize_chat_messages",
                        lambda messages: [{k: v for k, v in m.items() if v is not None} for m in messages])

    out = sys.stdout
    print(json.dumps({"ready": True}), file=out, flush=True)
    for line in sys.stdin:
        try:
            answer = render(json.loads(line), chat_template_utils.render_jinja_template, normalize)
            text = json.dumps(answer, ensure_ascii=False)
        except MemoryError:
            text = json.dumps({"bound": "memory"})
        out.write(text + "\n")
        out.flush()


if __name__ == "__main__":
    main()
