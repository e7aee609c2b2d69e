"""The continuous-batching generator (workers/engine/generation.py::DecodeBatch) computes what generating
each request on its own computes, while feeding fewer tokens: a group's shared prompt is prefilled
once, a kept cache spares a turn its context, rows leave when done and join mid-run. In float32 the
tokens are the same and log-probs agree to float32 rounding (another batch shape sums in another
order); benchmarks/engine measures the speed."""

from __future__ import annotations

import pytest

from workers.engine.generation import DecodeBatch, GenerationRequest, generate_batch
from workers.models.loading import load_model

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model():  # noqa: ANN201
    return load_model("tiny-smollm2", dtype="float32").model.eval()


def contexts(n: int) -> list[list[int]]:
    return [list(range(100 + 3 * i, 140 + 11 * i)) for i in range(n)]


def alone(model, request: GenerationRequest, temperature: float):  # noqa: ANN001, ANN201
    plain = GenerationRequest(request.context_ids, request.max_new_tokens, request.seed)
    return generate_batch(model, [plain], pad_token_id=0, temperature=temperature)[0]


def assert_same(got, want) -> None:  # noqa: ANN001
    assert got.token_ids == want.token_ids and got.finish == want.finish
    assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) < TOLERANCE


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_shared_prompt_is_prefilled_once_and_every_row_samples_its_own_tokens(model, temperature):
    shared = contexts(1)[0]
    requests = [GenerationRequest(shared, max_new_tokens=4 + 3 * k, seed=k) for k in range(4)]
    requests += [GenerationRequest(c, max_new_tokens=6, seed=9) for c in contexts(3)[1:]]
    batch = DecodeBatch(model, pad_token_id=0, temperature=temperature)
    outputs = dict(batch.add(list(enumerate(requests))))
    sizes = []
    while batch:
        sizes.append(len(batch))
        outputs.update(batch.step())
    assert batch.prefill_tokens == sum(len(c) for c in contexts(3))  # the shared prompt counted once
    for row, request in enumerate(requests):
        assert_same(outputs[row], alone(model, request, temperature))
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] < len(requests)  # finished rows left the batch
    if temperature > 0:  # four seeds on one prompt: not four copies of one sample
        assert len({tuple(outputs[k].token_ids[:4]) for k in range(4)}) > 1


def test_rows_with_their_own_sampling_settings_sample_as_they_would_alone(model):
    """Served requests bring their own temperature and top-p into one running batch: a greedy row
    takes the argmax, a sampled row draws as it would in a batch of its own settings."""
    settings = [(0.0, 1.0), (1.0, 1.0), (0.7, 0.9), (1.0, 1.0)]
    requests = [GenerationRequest(c, max_new_tokens=6, seed=3 + i, temperature=t, top_p=p)
                for i, (c, (t, p)) in enumerate(zip(contexts(4), settings))]
    outputs = dict(zip(range(4), generate_batch(model, requests, pad_token_id=0, temperature=1.0)))
    for row, (request, (temperature, top_p)) in enumerate(zip(requests, settings)):
        plain = GenerationRequest(request.context_ids, request.max_new_tokens, request.seed)
        want = generate_batch(model, [plain], pad_token_id=0, temperature=temperature, top_p=top_p)[0]
        assert_same(outputs[row], want)
    assert outputs[1].token_ids != outputs[3].token_ids  # own seeds, one setting: still their own samples


def test_a_kept_cache_gives_the_next_turn_what_a_full_prefill_gives(model):
    first = [GenerationRequest(c, max_new_tokens=5 + i, seed=i, keep_cache=True) for i, c in enumerate(contexts(3))]
    turn1 = generate_batch(model, first, pad_token_id=0, temperature=1.0)
    tool_result = list(range(300, 320))
    second = []
    for i, (request, out) in enumerate(zip(first, turn1)):
        assert out.cache.length == len(request.context_ids) + len(out.token_ids) - 1  # the last token is unfed
        second.append(GenerationRequest(request.context_ids + out.token_ids + tool_result[:6 + 5 * i], 8, seed=50 + i,
                                        prefix=out.cache))
    batch = DecodeBatch(model, pad_token_id=0, temperature=0.0)
    outputs = dict(batch.add(list(enumerate(second))))
    while batch:
        outputs.update(batch.step())
    assert batch.prefill_tokens == sum(len(r.context_ids) - r.prefix.length for r in second)
    for row, request in enumerate(second):
        assert_same(outputs[row], alone(model, request, 0.0))


def test_rows_joining_a_running_batch_decode_as_they_would_alone(model):
    requests = [GenerationRequest(c, max_new_tokens=9, seed=i) for i, c in enumerate(contexts(4))]
    seen: list[tuple[int, int]] = []
    batch = DecodeBatch(model, pad_token_id=0, temperature=1.0, on_token=lambda key, token: seen.append((key, token)))
    outputs = dict(batch.add([(0, requests[0]), (1, requests[1])]))
    for _ in range(3):
        outputs.update(batch.step())
    outputs.update(batch.add([(2, requests[2]), (3, requests[3])]))  # a wider and a narrower context join
    assert len(batch) == 4
    while batch:
        outputs.update(batch.step())
    for row, request in enumerate(requests):
        assert_same(outputs[row], alone(model, request, 1.0))
        assert [token for key, token in seen if key == row] == outputs[row].token_ids  # streamed as drawn


def test_decoding_rows_of_different_lengths_packs_query_heads_and_matches_plain_sdpa(model, monkeypatch):
    """models.packed_decode_attention: one-token queries with a padding mask run as one sdpa call
    per layer on [rows, kv heads, query heads per kv head, dim], never on K and V copied per query
    head; the tokens and log-probs are plain sdpa's. (With the decode kernel off: where it is built,
    the packed queries go to it instead, tests/rl/test_cpu_kernels.py.)"""
    import torch

    from workers.models.cpu import cpu_kernels
    from workers.models.loading import ATTENTION

    monkeypatch.setenv(cpu_kernels.DISABLE, "0")

    requests = [GenerationRequest(c, max_new_tokens=5, seed=i) for i, c in enumerate(contexts(4))]
    assert model.config._attn_implementation == ATTENTION  # load_model installs it
    calls: list[tuple[tuple[int, ...], bool]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, **kwargs):  # noqa: ANN001, ANN003, ANN202
        calls.append((tuple(query.shape), attn_mask is not None))
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    packed = generate_batch(model, requests, pad_token_id=0, temperature=1.0)
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    decoding = [(shape, masked) for shape, masked in calls if shape[2] != max(len(c) for c in contexts(4))]
    assert decoding and all(shape[1:3] == (kv_heads, heads // kv_heads) and masked for shape, masked in decoding)
    model.set_attn_implementation("sdpa")
    try:
        plain = generate_batch(model, requests, pad_token_id=0, temperature=1.0)
    finally:
        model.set_attn_implementation(ATTENTION)
    for got, want in zip(packed, plain):
        assert_same(got, want)


def test_a_random_weight_model_under_a_schema_writes_json_that_fits_it():
    """Structured outputs (workers/engine/constraints.py): whatever the weights, every sampled token keeps
    the text inside the schema, and the row stops once the value is complete; an unconstrained row
    of the same batch samples freely."""
    import json

    import jsonschema

    from workers.engine.constraints import Constraint, json_grammar

    loaded = load_model("tiny-smollm2", dtype="float32")
    schema = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 999},
                                               "unit": {"enum": ["usd", "eur"]}},
              "required": ["answer", "unit"], "additionalProperties": False}
    response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    grammar = json_grammar(response_format)
    rows = [GenerationRequest(contexts(1)[0], max_new_tokens=40, seed=seed,
                              constraint=Constraint(grammar, loaded.tokenizer))
            for seed in range(3)]
    free = GenerationRequest(contexts(1)[0], max_new_tokens=12, seed=0)
    outputs = generate_batch(loaded.model.eval(), [*rows, free], pad_token_id=0, temperature=1.0)
    for output in outputs[:3]:
        text = loaded.tokenizer.decode(output.token_ids, skip_special_tokens=True)
        assert output.finish == "stop", text
        jsonschema.validate(json.loads(text), schema)
    assert len(outputs[3].token_ids) == 12  # random weights, no constraint: no stop, no JSON
