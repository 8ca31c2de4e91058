"""InputBuffers (static, shared by eager and graph paths) and EagerRunner."""

from __future__ import annotations

import pytest
import torch

from execrt.core.batch import ForwardBatch, ForwardMode, LogitsOutput
from execrt.core.interfaces import AttentionStep
from execrt.core.runners import EagerRunner, InputBuffers

CPU = torch.device("cpu")


def batch(mode: ForwardMode, tokens: int, reqs: int) -> ForwardBatch:
    return ForwardBatch(
        mode=mode,
        input_ids=torch.arange(100, 100 + tokens),
        positions=torch.arange(tokens),
        req_pool_indices=torch.arange(1, reqs + 1),
        seq_lens=torch.full((reqs,), tokens // reqs),
        out_cache_loc=torch.arange(1, tokens + 1),
        seq_lens_cpu=[tokens // reqs] * reqs,
        prefix_lens_cpu=[0] * reqs,
        extend_lens_cpu=[tokens // reqs] * reqs,
    )


def tensors(x: ForwardBatch | InputBuffers) -> list[torch.Tensor]:
    s = x.static if isinstance(x, InputBuffers) else x
    return [s.input_ids, s.positions, s.out_cache_loc, s.req_pool_indices, s.seq_lens]


def test_buffers_have_fixed_addresses_and_sizes() -> None:
    buf = InputBuffers(max_bs=4, max_num_tokens=16, device=CPU)
    assert [t.numel() for t in tensors(buf)] == [16, 16, 16, 4, 4]
    assert buf.num_token_non_padded.numel() == 1
    ptrs = [t.data_ptr() for t in tensors(buf)]
    for tokens, reqs in ((12, 3), (4, 4), (16, 2)):
        loaded = buf.load(batch(ForwardMode.EXTEND, tokens, reqs))
        assert [t.data_ptr() for t in tensors(loaded)] == ptrs, "a view moved"
        assert loaded.input_ids.tolist() == list(range(100, 100 + tokens))
        assert loaded.num_token_non_padded_device is None  # an eager load is never padded


def test_buffers_refuse_batches_larger_than_their_limits() -> None:
    buf = InputBuffers(max_bs=2, max_num_tokens=8, device=CPU)
    with pytest.raises(ValueError, match="3 requests / 9 tokens exceeds the static buffers"):
        buf.load(batch(ForwardMode.EXTEND, 9, 3))
    with pytest.raises(ValueError, match="raise max_running_requests"):
        buf.load_padded(batch(ForwardMode.DECODE, 2, 2), padded_bs=4, seq_len_fill=1)
    with pytest.raises(ValueError, match="max_bs"):
        InputBuffers(max_bs=4, max_num_tokens=2, device=CPU)


def test_load_padded_applies_the_core_padding_rule_in_place() -> None:
    buf = InputBuffers(max_bs=8, max_num_tokens=8, device=CPU)
    fb = batch(ForwardMode.DECODE, 3, 3)
    padded = buf.load_padded(fb, padded_bs=6, seq_len_fill=1)
    assert padded.req_pool_indices.data_ptr() == buf.static.req_pool_indices.data_ptr()
    assert padded.req_pool_indices.tolist() == [1, 2, 3, 0, 0, 0]
    assert padded.out_cache_loc.tolist() == [1, 2, 3, 0, 0, 0]
    assert buf.num_token_non_padded.tolist() == [3]


def test_eager_runner_gets_only_what_it_uses() -> None:
    calls: list[str] = []

    class Backend:
        def plan(self, fb: ForwardBatch) -> str:
            calls.append(f"plan({fb.num_tokens})")
            return "planned"

    def model(fb: ForwardBatch, attn: AttentionStep) -> LogitsOutput:
        assert attn.out_cache_loc is fb.out_cache_loc and attn.mode is fb.mode
        calls.append(f"model({attn.meta})")
        return LogitsOutput(next_token_logits=fb.input_ids[:, None].float())

    buf = InputBuffers(max_bs=4, max_num_tokens=8, device=CPU)
    runner = EagerRunner(model, Backend(), buf)  # type: ignore[arg-type]
    out = runner.execute(batch(ForwardMode.EXTEND, 4, 2))
    assert calls == ["plan(4)", "model(planned)"]
    assert out.next_token_logits.flatten().tolist() == [100.0, 101.0, 102.0, 103.0]
