"""A request's lifecycle state: waiting -> running -> finished | aborted (and back to waiting on preemption)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from ..kv.blocks import SeqBlocks
from .sampling import SamplingParams, TokenLogprobs
from .tokenizer import IncrementalDetokenizer


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False)  # identity: the scheduler's `in` tests and removals must not compare every field
class Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    generator: torch.Generator | None = None
    arrival: float = field(default_factory=time.monotonic)
    seq: SeqBlocks = field(default_factory=SeqBlocks)
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # why an aborted request was aborted
    draft: list[int] = field(default_factory=list)  # MTP draft tokens to verify in the next step
    draft_probs: torch.Tensor | None = None  # the draft distribution (rejection sampling)
    _stop_hold: str = ""  # text held back because it may be the start of a stop string
    _stop_hit: bool = False

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_ids(self) -> int:
        """len(all_ids) without building the list."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """len(pending) without building the list (the scheduler asks every step for every request)."""
        return len(self.prompt_ids) + len(self.output_ids) - self.seq.num_tokens

    @property
    def pending(self) -> list[int]:
        """Tokens whose KV is not yet computed (the prompt, or after a preemption prompt + outputs, or the
        last sampled token). Built without copying the prompt when the prompt is computed (decode: a
        2048-token prompt copied 5 times per request per step cost ~2.5 ms of host time at batch 64)."""
        n, p = self.seq.num_tokens, len(self.prompt_ids)
        if n >= p:
            return self.output_ids[n - p:]
        return self.prompt_ids[n:] + self.output_ids

    @property
    def finished(self) -> bool:
        return self.status in (Status.FINISHED, Status.ABORTED)


@dataclass
class CompletionOutput:
    """One completion of a request, as vLLM's ``RequestOutput.outputs[i]``."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    cumulative_logprob: float | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What a request has produced so far; ``delta_*`` is what the last engine step added.

    ``outputs`` lists its completions as vLLM does (``outputs[i].text / .token_ids / .finish_reason``): one, or
    ``SamplingParams.n`` from :meth:`~ascend_dsv4.LLM.generate`. ``text``, ``token_ids``, ``finish_reason`` and
    ``logprobs`` are those of ``outputs[0]`` (kept as shortcuts).

    ``token_ids`` / ``logprobs`` are snapshots taken on first access: an output holds the request's own
    append-only lists and how many items it had (``out_ids`` / ``n_ids``, ``out_logprobs`` / ``n_logprobs``), so
    that an engine step does not copy every request's whole output (at batch 64 with 6,000-token outputs the copies
    and their frees cost the engine ~1.5 ms of host time a step: scripts/bench_results/engine_host_cpu_session8.txt;
    most outputs, the unfinished ones of ``LLM.generate``, are never read)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    out_ids: list[int] = field(repr=False)
    n_ids: int = field(repr=False)  # items of out_ids this output covers
    text: str
    delta_token_ids: list[int]
    delta_text: str
    finished: bool
    finish_reason: str | None
    out_logprobs: list[TokenLogprobs] = field(repr=False)
    n_logprobs: int = field(repr=False)
    num_cached_tokens: int = 0
    error: str | None = None  # set when the engine aborted the request itself (e.g. it can never fit the pools)
    more_outputs: list[CompletionOutput] = field(default_factory=list, repr=False)  # completions 1 .. n-1

    @property
    def token_ids(self) -> list[int]:
        return self._snapshot("_token_ids", self.out_ids, self.n_ids)

    @property
    def logprobs(self) -> list[TokenLogprobs]:
        return self._snapshot("_logprobs", self.out_logprobs, self.n_logprobs)

    def _snapshot(self, key: str, src: list, n: int) -> list:
        got = self.__dict__.get(key)
        if got is None:  # the first n items (the request only appends: they are the ones of this step)
            got = self.__dict__[key] = src[:n]
        return got

    @property
    def outputs(self) -> list[CompletionOutput]:
        return [self.as_completion(0)] + self.more_outputs

    def as_completion(self, index: int) -> CompletionOutput:
        """This output's own completion, numbered ``index``."""
        return CompletionOutput(index, self.text, self.token_ids, self.finish_reason, self.logprobs,
                                _cumulative(self.logprobs))


def _cumulative(lps: list[TokenLogprobs]) -> float | None:
    return sum(lp.logprob for lp in lps) if lps else None
