"""The output layer gets a contiguous input during sampling (models.contiguous_head_input): the
same tokens as the path without it, log-probs equal to float32 rounding (another matmul kernel sums
in another order; in bfloat16 they are bit-identical, benchmarks/engine)."""

from __future__ import annotations

from workers.engine.generation import GenerationRequest, generate_batch
from workers.models.loading import HEAD_HOOK, contiguous_head_input, load_model
from workers.models.lora import apply_lora


def test_sampling_is_unchanged_and_the_head_sees_contiguous_input():
    loaded = load_model("tiny-smollm2")
    policy = apply_lora(loaded, rank=4, alpha=8).eval()
    head = loaded.model.get_output_embeddings()
    assert hasattr(head, HEAD_HOOK)  # load_model installs it
    seen: list[bool] = []
    probe = head.register_forward_pre_hook(lambda _m, args: seen.append(args[0].is_contiguous()))
    batch = [GenerationRequest(context_ids=list(range(100, 130 + 7 * i)), max_new_tokens=6, seed=i) for i in range(4)]

    def sample():  # noqa: ANN202
        return [(o.token_ids, o.logprobs) for o in generate_batch(policy, batch, pad_token_id=0, temperature=1.0)]

    with_hook = sample()
    assert seen and all(seen)  # the prefill's last-position slice arrives contiguous
    getattr(head, HEAD_HOOK).remove()
    delattr(head, HEAD_HOOK)
    seen.clear()
    without = sample()
    assert not seen[0]  # without it, the prefill hands the head a strided view
    assert [tokens for tokens, _ in with_hook] == [tokens for tokens, _ in without]
    for (_, new), (_, old) in zip(with_hook, without):
        assert max(abs(a - b) for a, b in zip(new, old)) < 1e-4
    contiguous_head_input(loaded.model)
    contiguous_head_input(loaded.model)  # once only
    probe.remove()
    assert len(head._forward_pre_hooks) == 1
