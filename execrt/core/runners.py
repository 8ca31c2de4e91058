"""Runners: how one forward executes, eagerly or by replaying a captured decode graph.

Both read the same static InputBuffers, so a graph captured once replays any later batch.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from execrt.core.batch import ForwardBatch, LogitsOutput, padded_decode_batch
from execrt.core.interfaces import AttentionStep, ShapeKey
from execrt.core.sampler import Sampler, SamplingBatchInfo
from execrt.core.step import ForwardMode, StepInputs

if TYPE_CHECKING:
    from execrt.core.interfaces import AttentionBackend, GraphBackend
    from execrt.core.model_spec import Model

logger = logging.getLogger(__name__)
#: Long operations report each step here; the CLI prints it (``execrt: graph capture: ...``).
progress = logging.getLogger("execrt.progress")
SLOW_CAPTURE_S = 2.0


class InputBuffers:
    """Static per-step input tensors; the eager and graph paths share their storage.

    ``static`` is a StepInputs whose token-axis tensors hold ``max_num_tokens`` entries and
    request-axis tensors ``max_bs``; ``num_token_non_padded`` holds one. ``load`` copies a
    batch into their prefixes and returns a ForwardBatch viewing them, so the addresses a
    captured graph reads stay fixed.
    """

    def __init__(self, max_bs: int, max_num_tokens: int, device: torch.device) -> None:
        if max_bs < 1 or max_num_tokens < max_bs:
            raise ValueError(
                f"input buffers: need 1 <= max_bs ({max_bs}) <= max_num_tokens ({max_num_tokens})"
            )
        self.max_bs = max_bs
        self.max_num_tokens = max_num_tokens
        self.device = device

        def zeros(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int64, device=device)

        t, b = max_num_tokens, max_bs
        self.static = StepInputs(
            ForwardMode.DECODE, zeros(t), zeros(t), zeros(b), zeros(b), zeros(t), [], [], []
        )
        self.num_token_non_padded = zeros(1)

    @staticmethod
    def bytes_for(max_bs: int, max_num_tokens: int) -> int:
        """Bytes the buffers of ``max_bs`` requests and ``max_num_tokens`` tokens take: three
        int64 per token, two per request and one."""
        return 8 * (3 * max_num_tokens + 2 * max_bs + 1)

    def check_fits(self, fb: StepInputs, rows: int | None = None) -> None:
        t, b = fb.num_tokens, fb.batch_size if rows is None else rows
        if t > self.max_num_tokens or b > self.max_bs:
            raise ValueError(
                f"input buffers: batch of {b} requests / {t} tokens exceeds the static buffers "
                f"({self.max_bs} / {self.max_num_tokens}); raise max_running_requests or "
                "max_prefill_tokens"
            )

    def load(self, fb: ForwardBatch) -> ForwardBatch:
        """Copy ``fb``'s inputs into the buffers' prefixes; the batch is not padded."""
        self.check_fits(fb)
        st = self.static

        def put(buf: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
            view = buf[: src.shape[0]]
            view.copy_(src, non_blocking=True)
            return view

        return dataclasses.replace(
            fb,
            input_ids=put(st.input_ids, fb.input_ids),
            positions=put(st.positions, fb.positions),
            req_pool_indices=put(st.req_pool_indices, fb.req_pool_indices),
            seq_lens=put(st.seq_lens, fb.seq_lens),
            out_cache_loc=put(st.out_cache_loc, fb.out_cache_loc),
        )

    def load_padded(self, fb: ForwardBatch, padded_bs: int, seq_len_fill: int) -> ForwardBatch:
        """A decode batch padded to ``padded_bs`` rows (the core padding rule), in place."""
        self.check_fits(fb, padded_bs)
        return padded_decode_batch(
            fb, padded_bs, seq_len_fill, self.static, self.num_token_non_padded
        )


class SamplingBuffers:
    """Static per-row sampling parameters (``max_bs`` rows) that a decode graph samples from.

    ``load`` copies a batch's rows into the prefixes without a host sync; rows from the batch
    size up to the bucket become greedy (temperature 0), so padding rows sample harmlessly.
    """

    def __init__(self, max_bs: int, device: torch.device) -> None:
        def zeros(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(max_bs, dtype=dtype, device=device)

        self.static = SamplingBatchInfo(
            temperatures=zeros(torch.float32),
            top_ks=zeros(torch.int64),
            top_ps=torch.ones(max_bs, dtype=torch.float32, device=device),
            seeds=zeros(torch.int64),
            steps=zeros(torch.int64),
            all_greedy=False,  # the tensors are always read: greedy rows have temperature 0
        )

    def view(self, bs: int) -> SamplingBatchInfo:
        """The first ``bs`` rows (what a graph of bucket ``bs`` reads)."""
        st = self.static
        return SamplingBatchInfo(
            st.temperatures[:bs], st.top_ks[:bs], st.top_ps[:bs], st.seeds[:bs], st.steps[:bs],
            all_greedy=False,
        )  # fmt: skip

    def load(self, info: SamplingBatchInfo | None, batch_size: int, padded_bs: int) -> None:
        """Copy ``info``'s ``batch_size`` rows in and make rows up to ``padded_bs`` greedy. An
        all-greedy batch (or none) holds no tensors: every row becomes greedy."""
        rows = 0
        if info is not None and not info.all_greedy:
            rows = info.temperatures.shape[0]
            if rows != batch_size:
                raise ValueError(
                    f"sampling buffers: {rows} rows of sampling parameters for a batch of "
                    f"{batch_size} requests"
                )
            st = self.static
            for name in ("temperatures", "top_ks", "top_ps", "seeds", "steps"):
                getattr(st, name)[:rows].copy_(getattr(info, name), non_blocking=True)
        if rows < padded_bs:
            self.static.temperatures[rows:padded_bs].zero_()


class EagerRunner:
    """Runs a batch without graphs: load inputs, plan attention, run the model."""

    def __init__(self, model: Model, attn_backend: AttentionBackend, buffers: InputBuffers) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.buffers = buffers

    @torch.inference_mode()
    def execute(self, fb: ForwardBatch) -> LogitsOutput:
        fb = self.buffers.load(fb)
        return self.model(fb, attention_step(self.attn_backend, self.attn_backend.plan(fb), fb))


def attention_step(backend: AttentionBackend, meta: Any, fb: ForwardBatch) -> AttentionStep:
    """What the model's attention layers receive for ``fb``, given the backend's plan."""
    return AttentionStep(backend, meta, fb.out_cache_loc, fb.mode)


# -- decode CUDA graphs ----------------------------------------------------------------------------
def capture_batch_sizes(max_bs: int, requested: tuple[int, ...] = ()) -> list[int]:
    """The buckets to capture: ``requested`` if given, else 1, 2, 4, 8, 12, 16, then steps of 8;
    never above ``max_bs``, and ``max_bs`` itself always included, so every decode batch up to
    it has a graph. Ascending, without duplicates."""
    if max_bs < 1:
        raise ValueError(f"graph runner: max batch size {max_bs} must be >= 1")
    if requested:
        bad = [b for b in requested if b < 1]
        if bad:
            raise ValueError(f"graph runner: capture batch sizes {bad} must be >= 1")
        sizes = {b for b in requested if b <= max_bs}
    else:
        sizes = {b for b in (1, 2, 4, 8, 12, *range(16, max_bs + 1, 8)) if b <= max_bs}
    return sorted(sizes | {max_bs})


class DecodeCudaGraphRunner:
    """Replays one captured decode forward per batch-size bucket.

    The graph backend owns the graphs; this runner organises shapes and inputs. Capture runs
    the model on a batch of padding rows written into the static ``InputBuffers`` (shared with
    EagerRunner); a step picks the smallest bucket >= its batch size, writes the real rows and
    the padding (the core rule, ``padded_decode_batch``) into the same buffers, re-plans the
    attention into its static buffers, replays and trims the outputs to the batch.

    Given a ``sampler`` (one with a capturable ``sample_fn``), each graph also samples from
    the logits with the parameters in static ``SamplingBuffers``: the output then carries the
    token ids (``LogitsOutput.next_token_ids``) beside the logits.
    """

    def __init__(
        self,
        model: Model,
        attn_backend: AttentionBackend,
        buffers: InputBuffers,
        graph_backend: GraphBackend,
        capture_bs: list[int],
        sampler: Sampler | None = None,
    ) -> None:
        if not capture_bs or max(capture_bs) > buffers.max_bs:
            raise ValueError(
                f"graph runner: capture sizes {capture_bs} must be non-empty and fit the input "
                f"buffers (max_bs {buffers.max_bs})"
            )
        self.model = model
        self.attn_backend = attn_backend
        self.buffers = buffers
        self.backend = graph_backend
        self.capture_bs = sorted(capture_bs)
        self.max_bs = self.capture_bs[-1]
        self.fill = int(attn_backend.graph_seq_len_fill_value)
        self._logged: set[str] = set()
        self.sampler = sampler
        self.sampling = None if sampler is None else SamplingBuffers(self.max_bs, buffers.device)
        attn_backend.init_graph_state(self.max_bs, self.max_bs)

    def bucket(self, batch_size: int) -> int:
        """The smallest captured batch size that holds ``batch_size`` rows."""
        return self.capture_bs[bisect.bisect_left(self.capture_bs, batch_size)]

    def can_run(self, fb: ForwardBatch) -> bool:
        """True for a decode batch a graph can hold; the first refusal of each kind is logged."""
        if not fb.mode.is_decode():
            reason = f"{fb.mode.name.lower()} batches run eagerly (graphs capture decode)"
        elif fb.batch_size > self.max_bs:
            reason = f"decode batch of {fb.batch_size} exceeds the largest graph ({self.max_bs})"
        elif fb.batch_size < 1:
            reason = "an empty batch runs eagerly"
        else:
            return True
        kind = reason.split(" ", 1)[0]
        if kind not in self._logged:
            self._logged.add(kind)
            logger.info("graph runner: falling back to eager: %s", reason)
        return False

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (smaller graphs reuse the largest one's pool).

        Once capture has taken ``SLOW_CAPTURE_S``, each bucket logs a line on the
        ``execrt.progress`` logger (the CLI shows it): a re-executing backend under the Triton
        interpreter captures for minutes; CUDA graphs stay quiet."""
        start, total = time.perf_counter(), len(self.capture_bs)
        with self.backend.capture_session():
            for done, bs in enumerate(reversed(self.capture_bs), 1):
                self.backend.capture(ShapeKey(bs), self._forward_fn(bs))
                elapsed = time.perf_counter() - start
                if elapsed >= SLOW_CAPTURE_S:
                    progress.info(
                        "graph capture: bucket %d of %d (batch size %d) done after %.0f s",
                        done,
                        total,
                        bs,
                        elapsed,
                    )

    def _forward_fn(self, bs: int) -> Callable[[], LogitsOutput]:
        fb = self._padding_batch(bs)
        step = attention_step(self.attn_backend, self.attn_backend.plan_graph(fb), fb)

        sampler, sampling = self.sampler, self.sampling
        if sampler is None or sampling is None:
            return lambda: self.model(fb, step)
        info = sampling.view(bs)

        def forward_and_sample() -> LogitsOutput:
            out = self.model(fb, step)
            ids = sampler.sample(out.next_token_logits, info)  # [bs] int64
            return dataclasses.replace(out, next_token_ids=ids)

        return forward_and_sample

    def _padding_batch(self, bs: int) -> ForwardBatch:
        """A decode batch of ``bs`` padding rows in the static buffers (what capture runs)."""
        empty = torch.zeros(0, dtype=torch.int64, device=self.buffers.device)
        fb = ForwardBatch(ForwardMode.DECODE, empty, empty, empty, empty, empty, [], [], [])
        return self.buffers.load_padded(fb, bs, self.fill)

    @torch.inference_mode()
    def execute(self, fb: ForwardBatch) -> LogitsOutput:
        bs = fb.batch_size
        key = ShapeKey(self.bucket(bs))
        padded = self.buffers.load_padded(fb, key.batch_size, self.fill)
        if self.sampling is not None:
            self.sampling.load(fb.sampling_info, bs, key.batch_size)
        self.attn_backend.plan_graph(padded)  # into the buffers the captured graph reads
        out: LogitsOutput = self.backend.replay(key)
        # The static outputs are overwritten by the next replay: callers consume them first
        # (a later step's work on the same stream, such as copying the ids in, is in order).
        ids = None if out.next_token_ids is None else out.next_token_ids[:bs]
        return LogitsOutput(next_token_logits=out.next_token_logits[:bs], next_token_ids=ids)

    def cleanup(self) -> None:
        """Drop every graph (the backend synchronises first). Idempotent."""
        self.backend.cleanup()

    def recapture(self) -> None:
        self.cleanup()
        self.capture()
