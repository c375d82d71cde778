"""`ssmserve generate | serve | bench`."""

from __future__ import annotations

import argparse
import logging
import sys

from ssmserve import __version__
from ssmserve.config import EngineConfig, add_engine_args

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    model_default = "default: the model's generation_config.json, else %s"
    g.add_argument("--top-p", type=float, default=None, help=model_default % 1.0)
    g.add_argument("--top-k", type=int, default=None, help=model_default % "0 (off)")
    g.add_argument("--min-p", type=float, default=None, help=model_default % 0.0)
    g.add_argument(
        "--seed-sampling",
        dest="sampling_seed",
        type=int,
        default=None,
        help="per-request sampling seed",
    )
    g.add_argument("--n", type=int, default=1, help="completions per prompt")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--repetition-penalty", type=float, default=None, help=model_default % 1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)


def _sampling_params(args: argparse.Namespace, defaults: dict | None = None):
    """The flags' SamplingParams; filters and penalties left unset take `defaults` (the
    model's generation_config.json), else the built-in defaults."""
    from ssmserve.sampling_params import SamplingParams, with_defaults

    kwargs = dict(
        n=args.n,
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        temperature=args.temperature,
        seed=args.sampling_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
    )
    optional = {k: getattr(args, k) for k in ("top_p", "top_k", "min_p", "repetition_penalty")}
    kwargs.update(with_defaults(optional, defaults))
    return SamplingParams(**kwargs)


def run_generate(args: argparse.Namespace) -> int:
    from ssmserve.engine.engine import InvalidRequestError, LLMEngine

    try:
        _sampling_params(args)  # bad flags fail before the model loads
        engine = LLMEngine(EngineConfig.from_args(args, model=args.model))
        params = _sampling_params(args, engine.sampling_defaults)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    prompts = args.prompt or ["def fibonacci(n):"]
    out = sys.stdout
    for i, prompt in enumerate(prompts):
        try:
            engine.add_request(str(i), prompt, params)
        except InvalidRequestError as exc:
            print(f"error: prompt {i}: {exc}", file=sys.stderr)
            return 2
        # Stream: print each completion's new text as it arrives.
        shown = [0] * params.n
        if len(prompts) > 1 or params.n > 1:
            out.write(f"=== prompt {i} ===\n")
        out.write(prompt)
        out.flush()
        final = None
        while engine.has_unfinished_requests():
            for result in engine.step():
                final = result
                if params.n == 1:
                    text = result.outputs[0].text
                    out.write(text[shown[0] :])
                    out.flush()
                    shown[0] = len(text)
        if params.n > 1 and final is not None:
            for c in final.outputs:
                out.write(f"\n--- completion {c.index} ({c.finish_reason}) ---\n{prompt}{c.text}")
        out.write("\n")
        out.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ssmserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--log-level", default="WARNING", help=f"one of {', '.join(LOG_LEVELS)} (default WARNING)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete prompts, streaming to the terminal")
    gen.add_argument("prompt", nargs="*", help="prompt text (default: 'def fibonacci(n):')")
    gen.add_argument(
        "--model",
        default=None,
        help="checkpoint folder or cached hub id (default: the bundled model)",
    )
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=run_generate)

    from ssmserve.server.cli import add_serve_parser, run_serve

    serve = add_serve_parser(sub)
    serve.set_defaults(func=run_serve)

    from ssmserve.bench.cli import add_bench_parser

    add_bench_parser(sub)

    args = parser.parse_args(argv)
    if args.log_level.upper() not in LOG_LEVELS:
        print(
            f"error: --log-level must be one of {', '.join(LOG_LEVELS)}; got {args.log_level!r}",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
