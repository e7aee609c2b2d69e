"""The update's causal attention (workers/models/cpu/training_attention.py): the flash forward, a backward of
large matmuls. Its output is sdpa's bit for bit; its gradients are as close to float64's as sdpa's
own backward (flash) is; it takes only what it computes; and a bfloat16 LoRA update runs on it
with a gradient as close to the float32 model's as the update on sdpa."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.models.cpu import cpu_kernels, training_attention
from workers.models.loading import load_model
from workers.models.lora import apply_lora
from workers.training.sequences import TrainSequence, collate, micro_batches, token_logprobs


@pytest.fixture(scope="module", autouse=True)
def kernel():  # noqa: ANN201
    assert cpu_kernels.load() is not None, "the kernels did not build (a C++ compiler and ninja are needed)"


def inputs(batch: int, heads: int, kv_heads: int, length: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    def draw(h: int, scale: float) -> torch.Tensor:  # noqa: E306
        # as transformers hands them over: a transposed view of the projection's [batch, length, heads, dim]
        return (scale * torch.randn(batch, length, h, 64, generator=generator)).bfloat16().transpose(1, 2)
    return draw(heads, 2.0), draw(kv_heads, 2.0), draw(kv_heads, 1.0), draw(heads, 1.0)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


@pytest.mark.parametrize("batch, heads, kv_heads, length", [(3, 9, 3, 97), (2, 4, 4, 64), (1, 4, 2, 5), (4, 9, 3, 230)])
def test_output_is_sdpas_and_gradients_as_close_to_float64_as_sdpas(batch, heads, kv_heads, length):
    query, key, value, grad = inputs(batch, heads, kv_heads, length, seed=length)
    group = heads // kv_heads

    def run(attention) -> tuple[torch.Tensor, ...]:  # noqa: ANN001
        q, k, v = (x.detach().requires_grad_() for x in (query, key, value))
        out = attention(q, k, v)
        out.backward(grad)
        return out.detach(), q.grad, k.grad, v.grad

    ours = run(lambda q, k, v: training_attention.causal_attention(q, k, v, 0.125))
    sdpa = run(lambda q, k, v: F.scaled_dot_product_attention(
        q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), is_causal=True, scale=0.125))
    exact = run(lambda q, k, v: F.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1), is_causal=True,
        scale=0.125))
    assert torch.equal(ours[0], sdpa[0])  # the same flash kernel forward
    for got, flash, want in zip(ours[1:], sdpa[1:], exact[1:]):
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        assert relative_error(got, want) < max(1.5 * relative_error(flash, want), 0.006)


def test_it_takes_only_what_it_computes():
    query, key, _, _ = inputs(2, 4, 2, 8, seed=0)
    query.requires_grad_()
    assert training_attention.applies(query, key, None)
    with torch.no_grad():
        assert not training_attention.applies(query, key, None)  # sampling: no gradient to make fast
    assert not training_attention.applies(query, key, torch.ones(2, 1, 8, 8, dtype=torch.bool))  # a mask: sdpa
    assert not training_attention.applies(query[:, :, :1], key, None)  # a query shorter than its keys
    assert not training_attention.applies(query.float(), key.float(), None)
    assert not training_attention.applies(query, key, None, dropout=0.1)


def rows(count: int, seed: int) -> list[TrainSequence]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        length = 40 + 9 * i
        ids = torch.randint(10, 40000, (length,), generator=generator).tolist()
        out.append(TrainSequence(ids, [0] * 12 + [1] * (length - 12), [-2.0] * length, 1.0 - 0.4 * i))
    return out


def lora_gradient(policy, sequences: list[TrainSequence]) -> torch.Tensor:  # noqa: ANN001
    policy.zero_grad(set_to_none=True)
    for group in micro_batches(sequences, 4096):
        batch = collate(group, 0, torch.device("cpu"))
        (token_logprobs(policy, batch, 1.0) * batch.loss_mask * batch.advantages).sum().backward()
    return torch.cat([p.grad.flatten() for p in policy.parameters() if p.requires_grad]).double()


def test_a_bfloat16_update_runs_on_it_as_close_to_float32_as_on_sdpa(monkeypatch):
    calls = []
    original = training_attention.causal_attention
    monkeypatch.setattr(training_attention, "causal_attention", lambda *a: calls.append(a[0].shape) or original(*a))
    reference = apply_lora(load_model("tiny-smollm2", dtype="float32"), rank=4, alpha=8)
    for name, parameter in reference.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.05, generator=torch.Generator().manual_seed(1))
    policy = apply_lora(load_model("tiny-smollm2", dtype="bfloat16"), rank=4, alpha=8)
    policy.load_state_dict({k: v for k, v in reference.state_dict().items() if "lora" in k}, strict=False)
    sequences = rows(4, seed=3)
    want = lora_gradient(reference, sequences)
    assert not calls  # float32: sdpa
    on_ours = lora_gradient(policy, sequences)
    assert calls and all(shape[-2] > 1 for shape in calls)
    calls.clear()
    monkeypatch.setattr(training_attention, "applies", lambda *a, **k: False)
    on_sdpa = lora_gradient(policy, sequences)
    assert not calls
    error = lambda got: float((got - want).norm() / want.norm())  # noqa: E731
    assert error(on_ours) < max(1.5 * error(on_sdpa), 0.02)
    assert float(torch.nn.functional.cosine_similarity(on_ours, want, dim=0)) > 0.99


def test_a_score_matrix_past_the_bound_is_left_to_flash(monkeypatch):
    query, key, _, _ = inputs(2, 4, 2, 8, seed=0)
    query.requires_grad_()
    monkeypatch.setattr(training_attention, "MAX_SCORES", 2 * 4 * 8 * 8)
    assert training_attention.applies(query, key, None)
    monkeypatch.setattr(training_attention, "MAX_SCORES", 2 * 4 * 8 * 8 - 1)
    assert not training_attention.applies(query, key, None)
