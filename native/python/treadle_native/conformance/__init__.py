"""The chat-rendering conformance corpus, shipped so that users can run it on their own model.

- ``corpus``: deterministic conversations (``cases(dialect, n)``) covering plain turns,
  system prompts, tools, tool calls, reasoning, unicode, whitespace and long texts, plus
  each dialect's hand-written quirk cases; ``dialects`` says what each template accepts.
- ``bridging``: bridge coverage against a full re-render.
- ``check``: ``treadle check-template MODEL_DIR`` -- which renderer a model folder gets
  and why, and a sweep of the corpus against transformers on that folder.

Pure Python; ``check`` needs transformers (imported only when it runs).
"""
