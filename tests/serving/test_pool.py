"""The inference server's model pool generates on the weights the rollout engine samples on
(models.sampling_weights), prepared once per model and kept across batches; switching models,
loading and evicting put the weights and adapters back as they were loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workers.inference.pool import ModelPool
from workers.engine.generation import GenerationRequest, generate_batch
from workers.models.cpu.cpu_speedups import sampling_weights
from workers.models.loading import load_model
from workers.models.lora import apply_lora

TINY = "tiny-smollm2"
REQUESTS = [GenerationRequest(context_ids=list(range(200, 200 + n)), max_new_tokens=10, seed=i)
            for i, n in enumerate([6, 11, 8])]


def generated(module) -> list[tuple[list[int], list[float]]]:  # noqa: ANN001
    return [(o.token_ids, o.logprobs) for o in generate_batch(module, REQUESTS, pad_token_id=0, temperature=1.0)]


def save_adapter(directory: Path, seed: int) -> Path:
    """A LoRA checkpoint of tiny-smollm2 whose adapters change what it generates."""
    torch.manual_seed(seed)
    policy = apply_lora(load_model(TINY, dtype="bfloat16"), rank=4, alpha=8)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.3)
    policy.save_pretrained(str(directory))
    return directory


def engine_output(adapter: Path | None) -> list[tuple[list[int], list[float]]]:
    """What the rollout engine samples for the model: a fresh load, on its sampling weights."""
    from peft import PeftModel

    model = load_model(TINY, dtype="bfloat16").model
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).eval()
    with sampling_weights(model):
        return generated(model)


def base_state(pool: ModelPool) -> dict[str, torch.Tensor]:
    model = pool._bases[TINY].loaded.model
    return {name.replace(".base_layer", ""): tensor.clone() for name, tensor in model.state_dict().items()
            if "lora" not in name}  # the base's own weights, under their names before LoRA wrapped them


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return save_adapter(root / "a", 1), save_adapter(root / "b", 2)


def test_a_served_model_is_prepared_once_and_samples_what_the_engine_samples(adapters):
    pool = ModelPool(bases=[TINY], capacity=2, dtype="bfloat16")
    served = pool.get(TINY, str(adapters[0]))
    outputs = []
    for _ in range(2):
        module = pool.prepared(served)
        outputs.append(generated(module))
    assert pool.stats.preparations == 1
    assert outputs[0] == outputs[1] == engine_output(adapters[0])
    assert outputs[0] != engine_output(None)  # the adapter is applied


def test_switching_loading_and_evicting_put_the_loaded_weights_back(adapters):
    pool = ModelPool(bases=[TINY], capacity=1, dtype="bfloat16")
    pool.get(TINY, None)
    loaded = base_state(pool)
    # As the engine backend does, each run of a model asks the pool for it.
    module = pool.prepared(pool.get(TINY, str(adapters[0])))
    assert generated(module) == engine_output(adapters[0])
    module = pool.prepared(pool.get(TINY, None))  # the adapter unmerged, adapters off
    assert generated(module) == engine_output(None)
    module = pool.prepared(pool.get(TINY, str(adapters[0])))
    merged = generated(module)
    module = pool.prepared(pool.get(TINY, str(adapters[1])))  # evicts the first while it is prepared
    assert generated(module) == engine_output(adapters[1]) != merged
    assert pool.stats.preparations == 4 and pool.stats.evictions == 1
    pool.unprepare()
    after = base_state(pool)
    assert after.keys() == loaded.keys() and all(torch.equal(after[k], loaded[k]) for k in loaded)
    linears = [m for m in pool._bases[TINY].loaded.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and not any("forward" in m.__dict__ for m in linears)  # no packed forwards left
