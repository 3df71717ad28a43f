"""The one prompt validator: the engine, the ``LLM`` facade and the OpenAI server all check prompts here."""

from __future__ import annotations

from typing import Sequence

from ..errors import RequestError


class PromptError(RequestError):
    """A prompt that cannot be served. ``code``: "empty", "invalid_token" or "context_length_exceeded"."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


def check_prompt_ids(ids: Sequence, vocab_size: int | None, max_model_len: int, what: str = "the prompt") -> list[int]:
    """``ids`` as a list if it is a servable prompt: not empty, every entry an int token id in
    ``[0, vocab_size)`` (only ``>= 0`` when ``vocab_size`` is None), shorter than ``max_model_len`` (room for
    one generated token). Raises :class:`PromptError` naming ``what`` otherwise."""
    ids = list(ids)
    if not ids:
        raise PromptError(f"{what} is empty", "empty")
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or t < 0 or (vocab_size is not None and t >= vocab_size):
            raise PromptError(f"{what} holds {t!r}, not a token id in [0, {vocab_size})", "invalid_token")
    if len(ids) >= max_model_len:
        raise PromptError(f"{what} has {len(ids)} tokens; max_model_len is {max_model_len} "
                          f"(the prompt must leave room for at least one generated token)", "context_length_exceeded")
    return ids
