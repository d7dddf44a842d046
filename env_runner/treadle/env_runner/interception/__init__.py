"""The interception server: the model's APIs in front of rollouts, in every dialect.

A harness that is a separate program (a CLI agent, an SDK script) talks to "the model"
over HTTP; every request lands in its rollout's ModelSession, so each turn is rendered,
generated and recorded token-exactly into the rollout's message graph like an in-process
harness's, whatever API the program speaks. One server per env runner serves every
rollout it runs, told apart by the URL:

    POST /rollouts/{rollout_id}/v1/chat/completions   OpenAI Chat Completions   openai_chat.py
    POST /rollouts/{rollout_id}/v1/responses          OpenAI Responses          openai_responses.py
    POST /rollouts/{rollout_id}/v1/messages           Anthropic Messages        anthropic.py
    GET  /rollouts/{rollout_id}/v1/models             OpenAI's list (Anthropic's with anthropic-version)

each non-streaming or ``"stream": true`` (the turn is generated whole, then replayed as the
dialect's SSE events). OpenAI SDKs take ``.../rollouts/{id}/v1`` as base URL, Anthropic's
``.../rollouts/{id}``; ``Endpoint.env()`` gives both, with the key.

How the env runner wires it (one server for the process, started before rollouts run):

    server = InterceptionServer(host="127.0.0.1", port=0)
    await server.start()                      # InterceptionServer.current() now returns it
    rc = RolloutContext(..., services={"interception": server})
    ...
    await server.stop()                       # on shutdown

A harness serves one rollout for the time of its program (CommandHarness does this):

    async with server.serving(rollout_id, session, unix_socket=None) as ep:
        ep.env()                              # OPENAI_/ANTHROPIC_ BASE_URL and API_KEY
        ...                                   # run the program
    if ep.error is not None:                  # Truncated / TurnError the program saw
        raise ep.error

``register``/``listen_unix``/``unregister`` are the same steps one by one. With
``unix_socket`` the rollout is also served on its own unix socket, and a request coming
through that socket may only reach that rollout (a sandboxed program cannot talk to
another rollout's session).

Keys. Every rollout has its own secret (``ep.api_key``, 256 random bits, made at
``register``): each request must carry it as ``Authorization: Bearer <key>`` (what OpenAI
clients send for ``OPENAI_API_KEY``, Anthropic's for ``ANTHROPIC_AUTH_TOKEN``) or
``x-api-key`` (Anthropic's ``ANTHROPIC_API_KEY``), on TCP and on the unix socket alike.
Without it -- no key, a guess, another rollout's key -- the answer is 401 in the dialect's
error shape and the session is never touched; refusals are counted
(``rejected_requests``, the metric ``treadle.interception.unauthorized``) and logged once
per rollout.

Limits and errors, in each dialect's error shape (OpenAI: ``{"error": {"message", "type",
"param", "code"}}``; Anthropic: ``{"type": "error", "error": {"type", "message"}}``), the
message one line, so that the SDKs raise their typed errors (``BadRequestError``,
``AuthenticationError``, ``NotFoundError``, ...): an unknown rollout is 404, one whose
endpoint closed 404 "has ended", a missing or wrong key 401, a malformed body or a
sampling parameter out of range 400, a body over ``MAX_BODY_BYTES`` 413, a body nesting
deeper than ``MAX_BODY_DEPTH`` or holding NaN/Infinity 400 (parsing.py). A body is read
whole only from a caller with the rollout's key. Refused bodies are counted
(``bad_requests``, the metric ``treadle.interception.bad_requests`` by code and dialect)
and do not end the rollout. max_tokens is a wish: a call samples at most the rollout's
per-call budget (its sampling.max_tokens), the room left under its max_total_tokens and
the model's context length. A limit of the rollout (``Truncated``: turns, tokens, wall
time) ends it: the truncation is kept on the endpoint and in ``state.info["truncated"] =
(truncation, message)``, and this and every later request get HTTP 400 "the rollout
ended". A failed model call (``TurnError``) is 502 and kept likewise
(``state.info["turn_error"] = (error_kind, message)``).

Retries are idempotent: a request byte-identical to a recent (or running) one of the
rollout gets the same turn and records nothing new (server.py says how it is recognised).

This package does not run programs (harnesses/command.py does) and knows nothing of sandboxes
beyond serving a unix socket.
"""

# the dialects register themselves on import; the server serves every registered one
from treadle.env_runner.interception import anthropic, openai_chat, openai_responses
from treadle.env_runner.interception.dialect import DIALECTS, Call, Dialect, register
from treadle.env_runner.interception.parsing import (
    MAX_BODY_BYTES,
    MAX_BODY_DEPTH,
    RequestError,
    json_depth,
    load_body,
)
from treadle.env_runner.interception.server import RETRY_MEMORY, Endpoint, InterceptionServer

__all__ = [
    "DIALECTS",
    "MAX_BODY_BYTES",
    "MAX_BODY_DEPTH",
    "RETRY_MEMORY",
    "Call",
    "Dialect",
    "Endpoint",
    "InterceptionServer",
    "RequestError",
    "anthropic",
    "json_depth",
    "load_body",
    "openai_chat",
    "openai_responses",
    "register",
]
