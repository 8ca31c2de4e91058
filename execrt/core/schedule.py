"""The contract with the scheduling side: Req, SamplingParams (from ``sampling_params``) and
ScheduleBatch."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence, Set
from dataclasses import dataclass, field
from enum import Enum

import torch

from execrt.core.sampler import SamplingBatchInfo, TokenConstraint
from execrt.core.sampling_params import SamplingParams as SamplingParams  # re-exported
from execrt.core.staging import HostToDevice
from execrt.core.step import ForwardMode, StepInputs


class FinishReason(str, Enum):
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_new_tokens or the context limit
    ABORT = "abort"  # could not be served (e.g. KV cache too small for it alone)
    ERROR = "error"  # rejected at submission


@dataclass(eq=False)
class Req:
    """One generation request and its progress.

    Tokens ``fill_ids[:kv_len]`` have their K/V in the cache (or a launched step is computing
    it); ``KVMemory`` knows the slots. ``num_pending`` tokens were sampled on the device but
    are not in ``output_ids`` yet (overlap scheduling); ``scheduled_len`` counts them.
    ``cached_tokens``: prompt tokens whose K/V came from the prefix cache when the request
    was first prefilled (not computed for it).
    """

    rid: int
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    sampling_seed: int = 0
    output_ids: list[int] = field(default_factory=list)
    kv_len: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_retractions: int = 0
    num_pending: int = 0
    cached_tokens: int = 0
    #: The caller wants the logits of the prompt's rows (prompt log-probabilities): while set,
    #: the prefix cache serves none of its prompt (those rows must be computed).
    prompt_logits: bool = False
    #: What this request may draw next (``response_format``), set when it is queued.
    constraint: TokenConstraint | None = None

    #: ``output_counts``' tally and how many output tokens it has seen (kept, not recounted)
    _counts: Counter[int] = field(default_factory=Counter, init=False, repr=False)
    _counted: int = field(default=0, init=False, repr=False)
    _prompt_set: frozenset[int] | None = field(default=None, init=False, repr=False)

    @property
    def output_counts(self) -> Mapping[int, int]:
        """How often each token occurs in ``output_ids`` (tallied as tokens arrive)."""
        out = self.output_ids
        if len(out) < self._counted:  # never shrinks today; recount if it ever does
            self._counts, self._counted = Counter(), 0
        self._counts.update(out[self._counted :])
        self._counted = len(out)
        return self._counts

    @property
    def seen_tokens(self) -> Set[int]:
        """The distinct tokens of the prompt and the output so far."""
        if self._prompt_set is None:
            self._prompt_set = frozenset(self.origin_input_ids)
        return self._prompt_set | self.output_counts.keys()

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def last_token_id(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.origin_input_ids[-1]

    @property
    def seq_len(self) -> int:
        """Prompt plus the output tokens known on the host."""
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def scheduled_len(self) -> int:
        """Prompt plus every sampled token, including those still in flight."""
        return self.seq_len + self.num_pending

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class ScheduleBatch:
    """One scheduled step, as plain data: its requests, its ``StepInputs`` (where the tokens
    and their K/V go; ``KVMemory`` reserved them) and how each request samples.

    ``samples[i]`` says whether request ``i``'s sampled token is real: a prefill chunk that
    does not reach the end of the request's known tokens samples nothing.
    """

    reqs: list[Req]
    inputs: StepInputs
    sampling_info: SamplingBatchInfo
    samples: list[bool]
    return_full_logits: bool = False
    #: [R] int64 on the device: rows of an extend (indices into its tokens) whose logits are
    #: wanted beside each request's last; the model returns them as ``LogitsOutput.row_logits``.
    logit_rows: torch.Tensor | None = None

    @property
    def mode(self) -> ForwardMode:
        return self.inputs.mode

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    @classmethod
    def of(
        cls,
        reqs: Sequence[Req],
        inputs: StepInputs,
        stager: HostToDevice,
        stop_tokens: Callable[[Req], Collection[int]] | None = None,
    ) -> ScheduleBatch:
        """The batch of ``reqs`` over ``inputs``, with their sampling parameters staged;
        ``stop_tokens``: a request's EOS and stop tokens (what ``min_tokens`` holds back)."""
        samples = [s == r.scheduled_len for s, r in zip(inputs.seq_lens_cpu, reqs, strict=True)]
        # A decode's inputs are its rows' last tokens, those still in flight included.
        last_ids = inputs.input_ids if inputs.mode.is_decode() else None
        info = SamplingBatchInfo.from_reqs(reqs, stager.device, stager, stop_tokens, last_ids)
        return cls(list(reqs), inputs, info, samples)
