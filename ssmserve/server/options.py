"""ServerOptions: the HTTP server's limits and switches (the engine's are in EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class ServerOptions:
    """What one request may ask for, and what the server allows. Validated on construction.

    Every limit is refused with a 400 that names it and the flag that raises it.
    """

    # Samples per request (`n`); OpenAI's own limit.
    max_n: int = 128
    # Prompts in one completions request (`prompt` as a list).
    max_prompts_per_request: int = 1024
    # Stop strings per request, and characters per stop string: every generated token is
    # checked against each of them on the engine's thread.
    max_stop_strings: int = 64
    max_stop_string_length: int = 1024
    # Request bodies larger than this get 413.
    max_request_body_bytes: int = 16 * 1024 * 1024
    # Threads that tokenize prompts and render chat templates, off the event loop.
    tokenizer_pool_size: int = 2
    # Chat templates sent in requests are refused unless this is set; then they are
    # rendered in a sandbox, for at most `chat_template_timeout` seconds.
    trust_request_chat_template: bool = False
    chat_template_timeout: float = 2.0
    # GET /tokenizer_info (vLLM's, used by lm-eval's remote tokenizer).
    enable_tokenizer_info_endpoint: bool = False
    # On SIGTERM, seconds in-flight requests get before they are cut and the server exits.
    shutdown_timeout: float = 30.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool):
                continue
            if not value > 0:
                flag = "--" + f.name.replace("_", "-")
                raise ValueError(f"{f.name} ({flag}) must be positive, got {value}")
