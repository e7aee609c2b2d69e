"""Micro-batches are grouped by length (less padding), and the update's gradient is the same as with
arrival-order groups: the loss is a mean over all the step's sequences."""

from __future__ import annotations

import math
import random

import torch

from workers.models.loading import load_model
from workers.models.lora import apply_lora
from workers.methods.reinforcement.update import LossSettings, micro_batch_loss
from workers.training.sequences import TrainSequence, collate, feedable_prefix, micro_batches, token_logprobs


def sequences(n: int = 12) -> list[TrainSequence]:
    rng = random.Random(4)
    out = []
    for _ in range(n):
        prompt, sampled = rng.randint(5, 40), rng.randint(3, 40)
        ids = [rng.randrange(10, 40000) for _ in range(prompt + sampled)]
        out.append(TrainSequence(ids, [0] * prompt + [1] * sampled, [-2.0] * len(ids), rng.uniform(-1, 1)))
    return out


def padding(groups: list[list[TrainSequence]]) -> int:
    return sum(len(g) * max(len(s.token_ids) for s in g) - sum(len(s.token_ids) for s in g) for g in groups)


def test_groups_by_length_hold_every_sequence_once_with_less_padding():
    batch = sequences()
    grouped, arrival = micro_batches(batch, 160), micro_batches(batch, 160, by_length=False)
    assert sorted(id(s) for g in grouped for s in g) == sorted(id(s) for s in batch)
    assert all(len(g) * max(len(s.token_ids) for s in g) <= 160 or len(g) == 1 for g in grouped)
    assert padding(grouped) < padding(arrival)


def test_the_gradient_does_not_depend_on_the_grouping():
    loaded = load_model("tiny-smollm2")
    policy = apply_lora(loaded, rank=4, alpha=8)
    settings = LossSettings(loss="grpo", clip_epsilon=0.2, kl_coef=0.0, temperature=1.0, token_budget=128)
    batch = sequences()

    def gradient(by_length: bool) -> list[torch.Tensor]:
        policy.zero_grad(set_to_none=True)
        for group in micro_batches(batch, 160, by_length=by_length):
            collated = collate(group, 0, torch.device("cpu"))
            loss, _ = micro_batch_loss(token_logprobs(policy, collated, 1.0), collated, settings, len(batch), None)
            loss.backward()
        return [p.grad.clone() for p in policy.parameters() if p.requires_grad]

    for sorted_grad, arrival_grad in zip(gradient(True), gradient(False)):
        assert torch.allclose(sorted_grad, arrival_grad, rtol=1e-4, atol=1e-7)
    assert any(g.abs().sum() > 0 for g in gradient(True))


def grouped_sequences(prompts: int = 3, group: int = 4) -> list[TrainSequence]:
    """Rollouts as a step makes them: `group` per prompt, each the prompt's tokens then its own
    (sampled tokens, a tool result, more sampled tokens)."""
    rng = random.Random(7)
    out = []
    for _ in range(prompts):
        prompt = [rng.randrange(10, 40000) for _ in range(rng.randint(50, 70))]
        for _ in range(group):
            parts = [(rng.randint(3, 20), 1), (rng.randint(0, 15), 0), (rng.randint(0, 10), 1)]
            mask = [0] * len(prompt) + [flag for n, flag in parts for _ in range(n)]
            ids = prompt + [rng.randrange(10, 40000) for _ in range(len(mask) - len(prompt))]
            out.append(TrainSequence(ids, mask, [-2.0] * len(ids), rng.uniform(-1, 1)))
    rng.shuffle(out)
    return out


def test_a_prompts_rollouts_share_one_micro_batch_and_feed_their_prompt_once():
    loaded = load_model("tiny-smollm2")
    policy = apply_lora(loaded, rank=4, alpha=8)
    settings = LossSettings(loss="grpo", clip_epsilon=0.2, kl_coef=0.0, temperature=1.0, token_budget=128)
    batch = grouped_sequences()
    fed: list[int] = []
    counter = loaded.model.get_input_embeddings().register_forward_hook(lambda _m, args, _o: fed.append(args[0].numel()))

    def gradient(shared: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        policy.zero_grad(set_to_none=True)
        fed.clear()
        total = torch.zeros(())
        for group in micro_batches(batch, 400, by_prompt=shared):
            collated = collate(group, 0, torch.device("cpu"), share_prefix=shared)
            loss, _ = micro_batch_loss(token_logprobs(policy, collated, 1.0), collated, settings, len(batch), None)
            loss.backward()
            total = total + loss.detach()
        return total, [p.grad.clone() for p in policy.parameters() if p.requires_grad]

    shared_loss, shared_grad = gradient(True)
    shared_fed = sum(fed)
    plain_loss, plain_grad = gradient(False)
    counter.remove()
    groups = micro_batches(batch, 400)
    assert len(groups) == 3 and all(feedable_prefix(g) for g in groups) and all(len({tuple(s.token_ids[:20]) for s in g}) == 1 for g in groups)
    # Each group's prompt (short of the position predicting the first sampled token) is fed once,
    # then every row's rest: not each row's whole sequence.
    prompts = [g[0].loss_mask.index(1) - 1 for g in groups]
    assert shared_fed == sum(p + len(g) * (max(len(s.token_ids) for s in g) - p) for p, g in zip(prompts, groups))
    assert shared_fed < sum(fed)
    assert torch.allclose(shared_loss, plain_loss, rtol=1e-5, atol=1e-7)
    for a, b in zip(shared_grad, plain_grad):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    assert any(g.abs().sum() > 0 for g in shared_grad)


def test_a_short_shared_prompt_is_fed_with_each_row():
    """Feeding a prompt once costs a forward of its own and smaller micro-batches; below
    SHARE_WHEN_SPARED of the tokens spared, rows are batched whole by length, across prompts."""
    rng = random.Random(3)
    prompt = [rng.randrange(10, 40000) for _ in range(10)]
    rows = [TrainSequence(prompt + [rng.randrange(10, 40000) for _ in range(40)], [0] * 10 + [1] * 40,
                          [-2.0] * 50, 0.5) for _ in range(4)]
    assert feedable_prefix(rows) == 0 and collate(rows, 0, torch.device("cpu")).prefix_ids is None
    assert feedable_prefix(grouped_sequences()[:1] * 4) > 0


def test_a_rows_log_probs_do_not_depend_on_the_padding_after_it():
    """Rows are right-padded and attention is causal: a row's log-probs in a micro-batch with longer
    rows are its log-probs alone (float32), so the update needs no padding mask."""
    policy = apply_lora(load_model("tiny-smollm2", dtype="float32"), rank=4, alpha=8)
    batch = sequences(5)
    together = collate(batch, 0, torch.device("cpu"))
    assert together.prefix_ids is None and (together.attention_mask == 0).any()
    with torch.no_grad():
        padded = token_logprobs(policy, together, 1.0)
        for row, sequence in enumerate(batch):
            alone = collate([sequence], 0, torch.device("cpu"))
            want = token_logprobs(policy, alone, 1.0)[0][alone.loss_mask[0]]
            got = padded[row][together.loss_mask[row]]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_truncated_importance_sampling_weights_each_token_by_its_capped_ratio():
    """Log-probs from a sampler that computed the policy differently (vLLM, another precision): the
    plain ratio against them makes the PPO clip bind and the token gets no gradient; truncated
    importance sampling takes the ratio against the trainer's own log-probs and weights the token by
    min(p_trainer / p_sampler, cap) instead."""
    from workers.training.sequences import Collated

    gap = torch.tensor([[math.log(1.5), math.log(3.0), 0.0, -math.log(2.0)]])  # log p_trainer - log p_sampler
    trainer = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])

    def gradient(cap: float | None) -> torch.Tensor:
        new = trainer.clone().requires_grad_(True)
        batch = Collated(input_ids=torch.zeros(1, 5, dtype=torch.long), attention_mask=torch.ones(1, 5),
                         positions=torch.arange(4), loss_mask=torch.ones(1, 4, dtype=torch.bool),
                         sampling_logprobs=trainer - gap, advantages=torch.tensor([[1.0]]))
        settings = LossSettings("grpo", 0.2, 0.0, 1.0, 128, importance_cap=cap)
        loss, _ = micro_batch_loss(new, batch, settings, n_sequences=1)
        loss.backward()
        return -new.grad[0] * 4  # per token, the mean's 1/4 undone

    on_policy = torch.ones(4)  # d(ratio * A)/d logp at ratio 1, A = 1
    plain, tis = gradient(None), gradient(2.0)
    assert torch.allclose(plain, torch.tensor([0.0, 0.0, 1.0, 0.5]))  # ratios 1.5 and 3 clipped away
    assert torch.allclose(tis, on_policy * torch.tensor([1.5, 2.0, 1.0, 0.5]))  # 3 capped at 2
