"""The model registry: built-in models from PyPI packages, the safetensors conversion cache,
local directories, Hub ids without network, LoRA / full training modes, device and dtype.

Converting SmolLM2 from GGUF takes ~20-30 s on 2 cores, so it happens once per session into a
temporary cache shared by the tests (the `model_cache` fixture)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import REPO, free_port
from workers.models.loading import load_model
from workers.models.lora import apply_lora, count_parameters, training_mode
from workers.models.registry import (
    ATTENTION_PROJECTIONS,
    CACHE_MARKER,
    MLP_PROJECTIONS,
    SMOLLM2,
    TINY_SEED,
    TINY_SMOLLM2,
    LoadedModel,
    ModelNotAvailable,
    UnknownModel,
    list_models,
    packaged_gguf_path,
)

SAMPLE_TEXT = "The weather in Paris is 21°C; call get_weather(city) to check."


@dataclass
class ModelCache:
    root: Path
    first_load_s: float
    smollm2: LoadedModel


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> ModelCache:
    """A cache into which SmolLM2 was converted from its GGUF once, timed."""
    root = tmp_path_factory.mktemp("model-cache")
    started = time.perf_counter()
    loaded = load_model(SMOLLM2, cache_dir=root)
    return ModelCache(root, time.perf_counter() - started, loaded)


@pytest.fixture(scope="session")
def tiny(model_cache: ModelCache) -> LoadedModel:
    return load_model(TINY_SMOLLM2, cache_dir=model_cache.root)


def prompt_batch(tokenizer, texts: list[str]) -> dict[str, torch.Tensor]:
    return tokenizer(texts, return_tensors="pt", padding=True)


# --- tiny model -------------------------------------------------------------------------------


def test_tiny_model_builds_in_seconds_with_smollm2_tokenizer_and_fixed_weights(
    tmp_path: Path, model_cache: ModelCache, tiny: LoadedModel
) -> None:
    # A fresh cache without SmolLM2 in it: the tiny model takes its tokenizer from the GGUF.
    started = time.perf_counter()
    fresh = load_model(TINY_SMOLLM2, cache_dir=tmp_path)
    assert time.perf_counter() - started < 30

    config = fresh.model.config
    assert type(fresh.model).__name__ == "LlamaForCausalLM"
    assert (config.hidden_size, config.num_hidden_layers) == (64, 2)
    assert config.vocab_size == model_cache.smollm2.model.config.vocab_size
    smol_tokenizer = model_cache.smollm2.tokenizer
    assert fresh.tokenizer(SAMPLE_TEXT).input_ids == smol_tokenizer(SAMPLE_TEXT).input_ids
    assert len(fresh.tokenizer) == len(smol_tokenizer)
    # Built twice, in two caches, the weights are the same.
    fresh_weights, cached_weights = fresh.model.state_dict(), tiny.model.state_dict()
    assert fresh_weights.keys() == cached_weights.keys()
    assert all(torch.equal(fresh_weights[key], cached_weights[key]) for key in fresh_weights)


def test_tiny_model_generates_with_left_padding(tiny: LoadedModel) -> None:
    model, tokenizer = tiny
    assert tokenizer.padding_side == "left" and tokenizer.pad_token is not None
    batch = prompt_batch(tokenizer, ["Hi", "What is the capital of France?"])
    assert batch["attention_mask"][0, 0] == 0  # the short prompt is padded on the left
    output = model.generate(**batch, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert output.shape == (2, batch["input_ids"].shape[1] + 6)


def test_interrupted_conversion_is_redone_not_used(model_cache: ModelCache, tiny: LoadedModel) -> None:
    entry = model_cache.root / TINY_SMOLLM2
    # What a crash mid-conversion could leave: an entry without its validity marker, holding
    # garbage, and a temporary directory. (A new file, not the old one truncated in place: the
    # `tiny` fixture's weights are memory-mapped from it.)
    (entry / CACHE_MARKER).unlink()
    (entry / "model.safetensors").unlink()
    (entry / "model.safetensors").write_bytes(b"truncated")
    leftover = model_cache.root / f".tmp-{TINY_SMOLLM2}-crashed"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"partial")

    reloaded = load_model(TINY_SMOLLM2, cache_dir=model_cache.root)

    assert (entry / CACHE_MARKER).is_file()
    assert not leftover.exists()
    expected = tiny.model.state_dict()
    assert all(torch.equal(tensor, expected[key]) for key, tensor in reloaded.model.state_dict().items())


def test_outdated_cache_entry_is_rebuilt(model_cache: ModelCache, tiny: LoadedModel) -> None:
    marker_path = model_cache.root / TINY_SMOLLM2 / CACHE_MARKER
    marker = json.loads(marker_path.read_text())
    marker["fingerprint"]["seed"] = -1  # as if built by an older release with other settings
    marker_path.write_text(json.dumps(marker))

    load_model(TINY_SMOLLM2, cache_dir=model_cache.root)

    assert json.loads(marker_path.read_text())["fingerprint"]["seed"] == TINY_SEED


def test_two_processes_converting_at_once_convert_once(model_cache: ModelCache, tiny: LoadedModel) -> None:
    shutil.rmtree(model_cache.root / TINY_SMOLLM2)  # unlinked, so `tiny`'s mapped weights stay valid
    code = (
        "import logging, sys; logging.basicConfig(level=logging.INFO); "
        "from workers.models.registry import ensure_tiny_cached; from pathlib import Path; "
        "ensure_tiny_cached(Path(sys.argv[1]))"
    )
    workers = [
        subprocess.Popen([sys.executable, "-c", code, str(model_cache.root)], cwd=REPO, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    logs = [worker.communicate(timeout=120)[1] for worker in workers]

    assert [worker.returncode for worker in workers] == [0, 0], logs
    assert sum(log.count(f"converting {TINY_SMOLLM2}") for log in logs) == 1
    assert (model_cache.root / TINY_SMOLLM2 / CACHE_MARKER).is_file()


def test_threads_loading_at_once_get_intact_models(model_cache: ModelCache, tiny: LoadedModel) -> None:
    with ThreadPoolExecutor(max_workers=2) as pool:
        loads = list(pool.map(lambda _: load_model(TINY_SMOLLM2, cache_dir=model_cache.root), range(2)))
    for loaded in loads:
        assert torch.equal(loaded.model.lm_head.weight, tiny.model.lm_head.weight)
        assert not any(p.is_meta for p in loaded.model.parameters())


# --- SmolLM2 from its GGUF ---------------------------------------------------------------------


def test_smollm2_is_converted_once_and_then_loads_from_cache(model_cache: ModelCache) -> None:
    entry = model_cache.root / SMOLLM2
    assert (entry / "model.safetensors").is_file() and (entry / CACHE_MARKER).is_file()

    started = time.perf_counter()
    cached = load_model(SMOLLM2, cache_dir=model_cache.root)
    cached_load_s = time.perf_counter() - started

    print(f"\nSmolLM2 first load (GGUF conversion): {model_cache.first_load_s:.1f} s, cached: {cached_load_s:.1f} s")
    assert cached_load_s < model_cache.first_load_s / 3
    assert cached.path == str(entry)
    assert model_cache.smollm2.model.lm_head.weight.data_ptr() == model_cache.smollm2.model.model.embed_tokens.weight.data_ptr()


def test_cached_smollm2_computes_the_same_logits_as_the_gguf(model_cache: ModelCache) -> None:
    gguf = packaged_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    batch = prompt_batch(model_cache.smollm2.tokenizer, [SAMPLE_TEXT])
    with torch.no_grad():
        expected = reference(**batch).logits
        actual = model_cache.smollm2.model(**batch).logits
    assert torch.allclose(actual, expected, atol=1e-4, rtol=1e-4)


def test_smollm2_answers_a_chat_question(model_cache: ModelCache) -> None:
    model, tokenizer = model_cache.smollm2
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    output = model.generate(**prompt, max_new_tokens=20, do_sample=False)
    reply = tokenizer.decode(output[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert reply.strip()


def test_list_models_describes_the_builtins(model_cache: ModelCache) -> None:
    models = {entry["name"]: entry for entry in list_models(model_cache.root)}
    assert models[SMOLLM2]["available"] and models[SMOLLM2]["cached"]
    assert models[SMOLLM2]["source"].endswith(".gguf")
    assert models[TINY_SMOLLM2]["kind"] == "tiny"


# --- other sources and errors --------------------------------------------------------------------


def test_loads_a_saved_model_directory(tmp_path: Path, tiny: LoadedModel) -> None:
    tiny.model.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)

    loaded = load_model(str(tmp_path))

    assert loaded.source.kind == "local_dir"
    assert loaded.tokenizer.padding_side == "left"
    assert torch.equal(loaded.model.model.embed_tokens.weight, tiny.model.model.embed_tokens.weight)


@pytest.mark.parametrize("name", ["no-such-model", "", "./missing/../dir", "a/b/c"])
def test_unknown_name_is_a_clear_error(name: str) -> None:
    with pytest.raises(UnknownModel, match=SMOLLM2 if name else "non-empty"):
        load_model(name)


def test_directory_without_a_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(UnknownModel, match="config.json"):
        load_model(str(tmp_path))


def test_hub_id_fails_fast_when_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    with pytest.raises(ModelNotAvailable, match="hf download example-org/example-model"):
        load_model("example-org/example-model")
    assert time.perf_counter() - started < 5


def test_hub_id_fails_fast_when_the_hub_is_unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    started = time.perf_counter()
    with pytest.raises(ModelNotAvailable, match="example-org/example-model"):
        load_model("example-org/example-model")
    assert time.perf_counter() - started < 5


def test_resolving_names_does_not_import_torch() -> None:
    # The API validates model names; it must not pay for importing torch.
    code = (
        "import sys; from workers.models.registry import resolve_model, list_models; "
        "resolve_model('SmolLM2-135M-Instruct'); list_models(); print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


# --- device and dtype ----------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU defaults")
def test_cpu_defaults_to_float32(model_cache: ModelCache, tiny: LoadedModel) -> None:
    for loaded in (tiny, model_cache.smollm2):
        assert loaded.device.type == "cpu" and loaded.dtype == torch.float32
        assert {p.dtype for p in loaded.model.parameters()} == {torch.float32}
    with pytest.raises(ModelNotAvailable, match="CUDA"):
        load_model(TINY_SMOLLM2, device="cuda", cache_dir=model_cache.root)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_defaults_to_bfloat16(model_cache: ModelCache) -> None:
    loaded = load_model(TINY_SMOLLM2, cache_dir=model_cache.root)
    assert loaded.device.type == "cuda" and loaded.dtype == torch.bfloat16
    assert next(loaded.model.parameters()).device.type == "cuda"


def test_explicit_dtype_overrides_and_bad_dtype_is_refused(model_cache: ModelCache) -> None:
    loaded = load_model(TINY_SMOLLM2, device="cpu", dtype="bfloat16", cache_dir=model_cache.root)
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="invalid dtype"):
        load_model(TINY_SMOLLM2, dtype="float7", cache_dir=model_cache.root)


# --- training modes ------------------------------------------------------------------------------


def test_lora_trains_only_adapter_weights(model_cache: ModelCache) -> None:
    loaded = load_model(TINY_SMOLLM2, cache_dir=model_cache.root)
    base_q_proj = loaded.model.model.layers[0].self_attn.q_proj.weight.detach().clone()

    policy = apply_lora(loaded, rank=4, alpha=8)

    trainable = {name for name, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    assert {name.split(".")[-4] for name in trainable} == set(ATTENTION_PROJECTIONS)
    lora_before = {name: p.detach().clone() for name, p in policy.named_parameters() if p.requires_grad}

    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    batch = prompt_batch(loaded.tokenizer, [SAMPLE_TEXT])
    policy(**batch, labels=batch["input_ids"]).loss.backward()
    optimizer.step()

    changed = [name for name, p in policy.named_parameters() if p.requires_grad and not torch.equal(p, lora_before[name])]
    assert changed
    assert torch.equal(policy.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight, base_q_proj)


def test_lora_can_target_the_mlp_and_refuses_bad_settings(model_cache: ModelCache) -> None:
    loaded = load_model(TINY_SMOLLM2, cache_dir=model_cache.root)
    with pytest.raises(ValueError, match="rank"):
        apply_lora(loaded, rank=0, alpha=8)
    with pytest.raises(ValueError, match="no_such_proj"):
        apply_lora(loaded, rank=4, alpha=8, target_modules=["no_such_proj"])

    policy = apply_lora(loaded, rank=4, alpha=8, target_modules=ATTENTION_PROJECTIONS + MLP_PROJECTIONS)

    targeted = {name.split(".")[-4] for name, p in policy.named_parameters() if p.requires_grad}
    assert targeted == set(ATTENTION_PROJECTIONS + MLP_PROJECTIONS)


def test_full_mode_trains_every_parameter(model_cache: ModelCache) -> None:
    loaded = load_model(TINY_SMOLLM2, cache_dir=model_cache.root)
    for parameter in loaded.model.parameters():
        parameter.requires_grad_(False)

    policy = training_mode(loaded, "full")

    trainable, total = count_parameters(policy)
    assert policy is loaded.model and trainable == total > 0
    with pytest.raises(ValueError, match="'lora' or 'full'"):
        training_mode(loaded, "qlora")


# --- memory -------------------------------------------------------------------------------------

FRAGMENTING_CHURN = """
import json, threading, torch
from workers.models.loading import release_freed_memory

def rss_mb():
    return next(int(l.split()[1]) // 1024 for l in open("/proc/self/status") if l.startswith("VmRSS"))

def churn():
    big = torch.ones(4 << 20); del big  # a freed 16 MB block: glibc raises its mmap threshold to 16 MB
    kept, temporary = [], []
    for i in range(200):  # 1-7 MB blocks, now carved from a heap arena...
        temporary.append(torch.ones((1 + i % 7) << 18))
        kept.append(torch.ones(16))  # ...each followed by a small live block, so the heap cannot shrink
    del temporary
    return kept

before = rss_mb()
kept = []
worker = threading.Thread(target=lambda: kept.append(churn()))  # the trainer's updates run in a thread
worker.start(); worker.join()
freed = rss_mb()
released = release_freed_memory()
print(json.dumps({"before": before, "freed": freed, "after": rss_mb(), "released": released}))
"""


def test_release_freed_memory_returns_what_glibc_keeps_after_a_step() -> None:
    """The trainer's guard against a CPU training process growing by gigabytes per step: buffers
    of changing sizes, freed in a thread, stay in glibc's arena (resident) until released."""
    result = subprocess.run([sys.executable, "-c", FRAGMENTING_CHURN], cwd=REPO, capture_output=True, text=True,
                            timeout=120, check=True)
    mb = json.loads(result.stdout.strip().splitlines()[-1])
    assert mb["freed"] > mb["before"] + 500  # ~800 MB freed by torch, still resident
    assert mb["released"] == 1 and mb["after"] < mb["before"] + 100
