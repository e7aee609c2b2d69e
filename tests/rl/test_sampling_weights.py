"""The weights the engine samples on (models.sampling_weights, EngineConfig.sampling_weights).
Merged LoRA: inside the block the adapted model runs without its adapter path and computes what it
computed unmerged (to float32 rounding). Packed bf16 linear layers: bit-identical tokens and
log-probs. Afterwards the original weight tensors and forwards are back, bit for bit."""

from __future__ import annotations

import asyncio
import threading

import torch

from tests.rl.tool_server import tool_server
from workers.engine.generation import GenerationRequest, generate_batch
from workers.models.cpu.cpu_speedups import merged_lora_weights, packed_linear_weights
from workers.models.loading import load_model
from workers.models.lora import apply_lora
from workers.engine.prompting import ChatFormatter
from workers.engine.rollout import EngineConfig, RolloutEngine, RolloutSpec
from workers.engine.toolcalls import ToolSchema
from workers.engine.tools_client import ToolClient

SEARCH = ToolSchema("search", "Search", {"type": "object", "properties": {"query": {"type": "string"}}})


def trained_policy(dtype: str = "float32"):  # noqa: ANN201
    """tiny-smollm2 with LoRA adapters whose B is not zero (as after some training)."""
    loaded = load_model("tiny-smollm2", dtype=dtype)
    torch.manual_seed(0)  # LoRA's A matrices: the same adapters whatever ran before
    policy = apply_lora(loaded, rank=4, alpha=8).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return loaded, policy


def adapter_calls(policy) -> list[int]:  # noqa: ANN001
    """A counter of forward calls into the adapters' A matrices (the unmerged path)."""
    calls = [0]
    for name, module in policy.named_modules():
        if name.endswith("lora_A.default"):
            module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def base_weights(policy) -> dict[str, torch.Tensor]:  # noqa: ANN001
    return {name: p.data for name, p in policy.named_parameters() if name.endswith("base_layer.weight")}


def test_merged_weights_compute_the_adapted_model_and_are_put_back():
    loaded, policy = trained_policy()
    ids = torch.tensor([list(range(100, 140))])
    calls = adapter_calls(policy)
    originals = {name: (w.data_ptr(), w.clone()) for name, w in base_weights(policy).items()}
    with torch.no_grad():
        with policy.disable_adapter():
            base = policy(input_ids=ids).logits
        adapted = policy(input_ids=ids).logits
        unmerged_calls = calls[0]
        with merged_lora_weights(loaded.model) as merged:
            inside = policy(input_ids=ids).logits
        after = policy(input_ids=ids).logits
    layers = loaded.model.config.num_hidden_layers
    assert merged == 4 * layers  # q, k, v and o projections of every layer
    assert unmerged_calls == 4 * layers and calls[0] == 2 * unmerged_calls  # none inside the block
    assert (adapted - base).abs().max() > 1e-2  # the adapters change the model...
    assert (inside - adapted).abs().max() < 1e-4  # ...and the merged weights carry that change
    assert torch.equal(after, adapted)
    for name, weight in base_weights(policy).items():
        pointer, values = originals[name]
        assert weight.data_ptr() == pointer and torch.equal(weight, values)
    with policy.disable_adapter(), merged_lora_weights(loaded.model) as merged:
        assert merged == 0  # the base model is what runs: nothing to merge


def test_the_engine_samples_on_merged_weights_with_the_unmerged_models_tokens():
    loaded, policy = trained_policy()
    calls = adapter_calls(policy)
    originals = {name: w.clone() for name, w in base_weights(policy).items()}
    specs = [RolloutSpec(i, [{"role": "user", "content": "revenue " * (2 * i + 1)}], [SEARCH], {}, seed=i)
             for i in range(4)]

    def sample(merge: bool) -> tuple[list, int]:
        calls[0] = 0
        config = EngineConfig(max_tokens_per_turn=12, max_tokens_per_rollout=12, sampling_weights=merge)

        async def go():  # noqa: ANN202
            async with ToolClient([{"name": "search", "server_url": url}], allowlist=["127.0.0.1"]) as client:
                engine = RolloutEngine(loaded.model, loaded.tokenizer, ChatFormatter(loaded.tokenizer), client, config)
                return await engine.run(specs)

        return asyncio.run(go()), calls[0]

    with tool_server() as (url, _):
        merged, merged_calls = sample(True)
        unmerged, unmerged_calls = sample(False)
    assert merged_calls == 0 and unmerged_calls > 0, (merged_calls, unmerged_calls)
    assert [r.finish_reason for r in merged] == [r.finish_reason for r in unmerged]
    assert [r.token_ids for r in merged] == [r.token_ids for r in unmerged]
    for a, b in zip(merged, unmerged):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    assert all(torch.equal(w, originals[name]) for name, w in base_weights(policy).items())


def test_packed_bf16_linear_layers_sample_the_same_tokens_and_logprobs():
    import pytest

    loaded, policy = trained_policy("bfloat16")
    requests = [GenerationRequest(list(range(100 + i, 140 + 9 * i)), max_new_tokens=8, seed=i) for i in range(4)]

    def sample():  # noqa: ANN202
        return [(o.token_ids, o.logprobs) for o in generate_batch(policy, requests, pad_token_id=0, temperature=1.0)]

    plain = sample()
    with merged_lora_weights(loaded.model), packed_linear_weights(loaded.model) as packed:
        if not packed:
            pytest.skip("no oneDNN bf16 on this CPU: nothing is packed")
        inside = sample()
    with merged_lora_weights(loaded.model):
        merged_only = sample()
    layers = loaded.model.config.num_hidden_layers
    assert packed == 7 * layers + 1  # q, k, v, o, gate, up, down of every layer, and the output layer
    assert inside == merged_only  # packing changes nothing, bit for bit
    assert sample() == plain  # and everything is put back
    assert not any("forward" in m.__dict__ for m in loaded.model.modules())


def test_projections_fed_one_input_share_a_matmul_and_each_still_answers_alone():
    import pytest

    loaded = load_model("tiny-smollm2", dtype="bfloat16")
    attention, mlp = loaded.model.model.layers[0].self_attn, loaded.model.model.layers[0].mlp
    x = torch.randn(3, 5, loaded.model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    other = x.flip(0)
    with torch.inference_mode():
        expected = {name: torch.nn.functional.linear(x, getattr(attention, name).weight)
                    for name in ("q_proj", "k_proj", "v_proj")}
        expected_gate_other = torch.nn.functional.linear(other, mlp.gate_proj.weight)
        with packed_linear_weights(loaded.model) as packed:
            if not packed:
                pytest.skip("no oneDNN bf16 on this CPU: nothing is packed")
            in_order = {name: getattr(attention, name)(x) for name in ("q_proj", "k_proj", "v_proj")}
            v_alone = attention.v_proj(x)  # its output was handed out: computed again
            gate_other, up_x = mlp.gate_proj(other), mlp.up_proj(x)  # different inputs: no mix-up
            q_x = attention.q_proj(x)  # k's and v's outputs for x now wait in this thread...
            in_thread = {}
            worker = threading.Thread(target=lambda: in_thread.update(
                q=attention.q_proj(other), k=attention.k_proj(other)))  # ...another runs the model meanwhile
            worker.start()
            worker.join()
            k_x = attention.k_proj(x)
        for name, out in in_order.items():
            assert torch.equal(out, expected[name]), name
        assert torch.equal(v_alone, expected["v_proj"])
        assert torch.equal(gate_other, expected_gate_other)
        assert torch.equal(up_x, torch.nn.functional.linear(x, mlp.up_proj.weight))
        assert torch.equal(q_x, expected["q_proj"]) and torch.equal(k_x, expected["k_proj"])
        assert torch.equal(in_thread["k"], torch.nn.functional.linear(other, attention.k_proj.weight))
        assert torch.equal(in_thread["q"], torch.nn.functional.linear(other, attention.q_proj.weight))


def test_the_cpu_speedups_are_neither_built_nor_applied_for_a_model_off_the_cpu(monkeypatch):
    """The CPU unit (our kernels, packed weights, fused norms and rotary, the lean decode step, the
    registered attention) is for CPUs only: for a model on another device (here the meta device,
    which has no kernels of its own either) nothing is compiled, registered or patched."""
    import pytest

    from workers.models.cpu import cpu_kernels
    from workers.models.cpu.cpu_speedups import sampling_weights
    from workers.models.loading import ATTENTION, packed_decode_attention

    def no_build() -> None:
        pytest.fail("the CPU kernels were asked for a model that is not on the CPU")

    model = load_model("tiny-smollm2", dtype="bfloat16").model.to("meta")
    model.set_attn_implementation("sdpa")
    monkeypatch.setattr(cpu_kernels, "load", no_build)
    packed_decode_attention(model)
    assert model.config._attn_implementation == "sdpa"
    with sampling_weights(model) as counts:
        assert counts == {"merged_lora_layers": 0, "packed_linear_layers": 0, "fused_rms_norms": 0,
                          "fused_rotary_layers": 0, "lean_decode_layers": 0}
        assert not any("forward" in module.__dict__ for module in model.modules())
    assert ATTENTION != model.config._attn_implementation


def test_on_a_gpu_rollouts_sample_without_the_cpu_unit(monkeypatch):
    """Where a GPU is lent: a model loaded on CUDA samples real rollouts with transformers' own
    attention, and the CPU kernels are never built for it."""
    import pytest

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from workers.models.cpu import cpu_kernels
    from workers.models.loading import ATTENTION

    monkeypatch.setattr(cpu_kernels, "load", lambda: pytest.fail("CPU kernels built for a CUDA model"))
    loaded = load_model("tiny-smollm2", device="cuda")
    assert loaded.model.config._attn_implementation != ATTENTION
    with tool_server() as (url, _):
        async def go():  # noqa: ANN202
            async with ToolClient([{"name": "search", "server_url": url}], allowlist=["127.0.0.1"]) as client:
                engine = RolloutEngine(loaded.model, loaded.tokenizer, ChatFormatter(loaded.tokenizer), client,
                                       EngineConfig(max_tokens_per_turn=8, max_tokens_per_rollout=8))
                return await engine.run([RolloutSpec(i, [{"role": "user", "content": "hi"}], [SEARCH], {}, seed=i)
                                         for i in range(4)])

        records = asyncio.run(go())
    assert all(r.completion_tokens > 0 and len(r.logprobs) == len(r.token_ids) for r in records)
