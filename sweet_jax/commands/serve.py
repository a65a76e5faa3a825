"""An OpenAI-compatible HTTP server over the sampler, batching concurrent requests (sweet_jax.sampling.server).

    python -m sweet_jax.serve --model HF_DIR_OR_WORKDIR --port 8000 [--host 127.0.0.1] [--tokenizer DIR]

--model is a Hugging Face checkpoint directory (config.json + safetensors), or a training workdir of
`python -m sweet_jax.train` (its latest readable checkpoint). Endpoints: GET /v1/models, POST /v1/chat/completions,
POST /v1/completions (with logprobs); the request fields, streaming, batching and compilation are described in
sweet_jax.sampling.server.
"""
from __future__ import annotations

import logging
import os
import time

from sweet_jax import cli
from sweet_jax.commands import launch
from sweet_jax.errors import SweetJaxError

log = logging.getLogger("sweet_jax.serve")


def main(argv: list[str] | None = None) -> None:
    parser = cli.ArgumentParser(prog="python -m sweet_jax.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True,
                        help="Hugging Face checkpoint directory, or a sweet_jax.train workdir (latest checkpoint)")
    parser.add_argument("--port", type=int, default=8000, help="0 = any free port (printed on start)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
    parser.add_argument("--served-model-name", default=None, help="id in /v1/models (default: directory name)")
    parser.add_argument("--dtype", default=None, help="parameter dtype, e.g. bfloat16 (default float32)")
    parser.add_argument("--mesh", default=None, help="data,fsdp,tensor mesh shape, e.g. 1,-1,1 (default: no mesh)")
    parser.add_argument("--max-batch-size", type=int, default=64, help="most sample rows decoded together")
    parser.add_argument("--batch-window-ms", type=float, default=10.0, help="how long to collect a batch")
    parser.add_argument("--warmup", action="store_true",
                        help="compile every prompt bucket's one-row program before serving (no first-request compile)")
    parser.add_argument("--warmup-max-prompt", type=int, default=1024, help="longest prompt bucket --warmup compiles")
    parser.add_argument("--prompt-cache-mb", type=int, default=0,
                        help="keep prompts' K/V on the host up to this many MB: a conversation's next request "
                             "prefills only its new tokens (0 = off; pays on a CPU)")
    args = parser.parse_args(argv)

    try:
        mesh_shape = tuple(int(x) for x in args.mesh.split(",")) if args.mesh else None
    except ValueError:
        raise SweetJaxError(f"--mesh {args.mesh!r}: expected three integers data,fsdp,tensor, e.g. 1,-1,1") from None
    cli.require_path("--model", args.model, directory=True)
    if args.tokenizer:
        cli.require_path("--tokenizer", args.tokenizer, directory=True)
    from sweet_jax.sampling.server import OpenAIApp, OpenAIServer, load_model_sampler  # after the flags (--help)
    sampler = load_model_sampler(args.model, tokenizer=args.tokenizer, dtype=args.dtype, mesh_shape=mesh_shape,
                                 max_batch_size=args.max_batch_size, prompt_cache_mb=args.prompt_cache_mb)
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    app = OpenAIApp(sampler, model_name=name, max_batch_size=args.max_batch_size,
                    batch_window_s=args.batch_window_ms / 1000)
    if args.warmup:
        t0 = time.perf_counter()
        shapes = app.warmup(max_prompt=args.warmup_max_prompt)
        log.info("warm-up: %d prompt buckets compiled in %.0f s", shapes, time.perf_counter() - t0)
    server = OpenAIServer(app, args.host, args.port)
    # One parseable line: scripts (and tests) started with --port 0 read the address from it.
    print(f"sweet_jax.serve: serving {name} on {server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()


define_flags = None  # main parses its own argv (cli.ArgumentParser)


HELP_CONFIGS = ()

if __name__ == "__main__":
    launch("serve")
