"""The lean decode step (workers.models.cpu.lean_decode): inside models.sampling_weights decode steps run
without transformers' modules and give the model's own tokens and log-probs, bit for bit; where
it does not apply the model runs as it is; it is gone after the block."""

from __future__ import annotations

import pytest

from tests.rl.test_sampling_weights import trained_policy
from workers.models.cpu import cpu_kernels, lean_decode
from workers.engine.generation import GenerationRequest, generate_batch
from workers.models.cpu.cpu_speedups import sampling_weights
from workers.models.loading import native_bf16_cpu

# Rows of different lengths: left padding, so the step's attention has a mask.
REQUESTS = [GenerationRequest(context_ids=list(range(100, 100 + n)), max_new_tokens=12, seed=i)
            for i, n in enumerate([5, 9, 17, 9])]
# The lean step runs on the weights packed for oneDNN's bfloat16 kernels: without them, nothing is packed.
needs_onednn_bf16 = pytest.mark.skipif(not native_bf16_cpu(), reason="no oneDNN bf16 on this CPU: nothing is packed")


def outputs(policy) -> list[tuple[list[int], list[float]]]:  # noqa: ANN001
    return [(o.token_ids, o.logprobs) for o in generate_batch(policy, REQUESTS, pad_token_id=0, temperature=1.0)]


@needs_onednn_bf16
def test_lean_steps_sample_the_models_tokens_and_logprobs_bit_for_bit():
    assert cpu_kernels.load() is not None, "the CPU kernels build here (scripts/test.sh builds them)"
    loaded, policy = trained_policy("bfloat16")
    with sampling_weights(policy) as counts:
        lean = lean_decode.decoder_for(policy)
        assert lean is not None and counts["lean_decode_layers"] == loaded.model.config.num_hidden_layers
        steps = [0]
        original = lean.step
        lean.step = lambda *args: (steps.__setitem__(0, steps[0] + 1), original(*args))[1]
        lean_tokens = outputs(policy)
        lean_decode.register(policy, None)  # the same weights, each step through the model's forward
        model_tokens = outputs(policy)
    assert steps[0] == 11  # 12 tokens: one from the prefill, eleven decode steps, all lean
    assert lean_tokens == model_tokens
    assert lean_decode.decoder_for(policy) is None


def test_no_lean_decoder_where_its_step_would_not_be_the_models():
    _, policy = trained_policy("float32")  # nothing packed for oneDNN in float32
    with sampling_weights(policy) as counts:
        assert counts["lean_decode_layers"] == 0 and lean_decode.decoder_for(policy) is None
        assert len(outputs(policy)) == len(REQUESTS)
    _, policy = trained_policy("bfloat16")
    policy.get_base_model().set_attn_implementation("sdpa")  # transformers' own: not our decode attention
    with sampling_weights(policy) as counts:
        assert counts["lean_decode_layers"] == 0 and lean_decode.decoder_for(policy) is None


def run_joining_and_leaving(policy) -> dict[int, tuple[list[int], list[float]]]:  # noqa: ANN001
    """Rows of different lengths and budgets; two more join after three steps; rows leave as they end."""
    from workers.engine.generation import DecodeBatch

    budgets = [3, 12, 7]
    first = [(i, GenerationRequest(context_ids=list(range(300, 300 + 4 + 3 * i)), max_new_tokens=n, seed=i))
             for i, n in enumerate(budgets)]
    later = [(10 + i, GenerationRequest(context_ids=list(range(400, 420 + 5 * i)), max_new_tokens=6, seed=10 + i))
             for i in range(2)]
    batch = DecodeBatch(policy, pad_token_id=0, temperature=1.0)
    done = dict(batch.add(first))
    for _ in range(3):
        done.update(batch.step())
    done.update(batch.add(later))
    while len(batch):
        done.update(batch.step())
    return {key: (out.token_ids, out.logprobs) for key, out in done.items()}


@needs_onednn_bf16
def test_lean_steps_follow_rows_joining_and_leaving_bit_for_bit():
    _, policy = trained_policy("bfloat16")
    with sampling_weights(policy):
        lean = lean_decode.decoder_for(policy)
        assert lean is not None
        on_lean = run_joining_and_leaving(policy)
        lean_decode.register(policy, None)
        on_model = run_joining_and_leaving(policy)
    assert sorted(on_lean) == [0, 1, 2, 10, 11]
    assert [len(on_lean[k][0]) for k in (0, 1, 2, 10, 11)] == [3, 12, 7, 6, 6]
    assert on_lean == on_model
