"""Our CPU kernels (workers/models/cpu/cpu_kernels.py).

Decode attention: what softmax(q k^T) v computes in float64, to float32 rounding in float32 and to
one rounding of the output in bfloat16, for the shapes decoding hands it (packed query heads,
views into a cache with spare room, a left-padding mask); a row's result never depends on its
batch; and generation decodes on it.

RMSNorm: transformers' LlamaRMSNorm, bit for bit in float32 and all but ~1e-5 of the values in
bfloat16; sampling (models.fused_rms_norms) runs every norm on it and puts the modules back.

Rotary: transformers' apply_rotary_pos_emb of a decode step's queries and keys, bit for bit."""

from __future__ import annotations

import pytest
import torch

from workers.models.cpu import cpu_kernels
from workers.engine.generation import GenerationRequest, generate_batch
from workers.models.loading import load_model


@pytest.fixture(scope="module")
def kernel():  # noqa: ANN201
    module = cpu_kernels.load()
    assert module is not None, "the kernel did not build (a C++ compiler and ninja are needed)"
    return module


def cache_like(rows: int, heads: int, length: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Keys or values as the cache holds them: the filled part of a buffer with spare room."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, heads, length + 37, dim, generator=generator).to(dtype)[:, :, :length]


def reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keep: torch.Tensor | None,
              scale: float) -> torch.Tensor:
    scores = torch.einsum("bhgd,bhld->bhgl", query.double(), key.double()) * scale
    if keep is not None:
        scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    return torch.einsum("bhgl,bhld->bhgd", torch.softmax(scores, dim=-1), value.double())


def left_padding(rows: int, length: int) -> torch.Tensor:
    keep = torch.ones(rows, length, dtype=torch.bool)
    for row in range(rows):
        keep[row, : 3 * row] = False  # row r starts 3r columns late, as a shorter context does
    return keep


SHAPES = [  # rows, kv heads, query heads per kv head, length, dim
    (16, 3, 3, 350, 64),  # SmolLM2-135M's decode step (the vectorised path)
    (4, 2, 2, 41, 16),  # tiny-smollm2's (the generic path)
    (3, 1, 7, 130, 64),  # more query heads per KV head than the vectorised path takes
    (2, 4, 1, 1, 64),  # one key
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("masked", [True, False])
def test_float32_equals_float64_attention_to_rounding(kernel, shape, masked):
    rows, heads, group, length, dim = shape
    query = cache_like(rows, heads, group, dim, torch.float32, 0).contiguous()
    key, value = (cache_like(rows, heads, length, dim, torch.float32, seed) for seed in (1, 2))
    keep = left_padding(rows, length) if masked and length > 3 * rows else None
    got = cpu_kernels.attend(query, key, value, None if keep is None else keep[:, None, None, :], dim ** -0.5)
    assert got is not None and got.shape == query.shape
    assert torch.allclose(got.double(), reference(query, key, value, keep, dim ** -0.5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", SHAPES[:3])
def test_bfloat16_output_is_rounded_once(kernel, shape):
    """From bf16 inputs the kernel accumulates in float32 and rounds the output once: within half a
    bf16 step (2^-8 relative) of the exact result. torch's sdpa rounds the probabilities as well."""
    rows, heads, group, length, dim = shape
    query = cache_like(rows, heads, group, dim, torch.bfloat16, 0).contiguous()
    key, value = (cache_like(rows, heads, length, dim, torch.bfloat16, seed) for seed in (1, 2))
    keep = left_padding(rows, length)
    got = cpu_kernels.attend(query, key, value, keep[:, None, None, :], dim ** -0.5)
    exact = reference(query, key, value, keep, dim ** -0.5)
    assert got.dtype == torch.bfloat16
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-5).all()


def test_a_row_gets_the_same_bits_alone_as_in_a_batch(kernel):
    rows, heads, group, length, dim = SHAPES[0]
    query = cache_like(rows, heads, group, dim, torch.bfloat16, 0).contiguous()
    key, value = (cache_like(rows, heads, length, dim, torch.bfloat16, seed) for seed in (1, 2))
    mask = left_padding(rows, length)[:, None, None, :]
    batch = cpu_kernels.attend(query, key, value, mask, 0.125)
    for row in (0, 5, 15):
        one = cpu_kernels.attend(query[row:row + 1].contiguous(), key[row:row + 1], value[row:row + 1],
                                      mask[row:row + 1].contiguous(), 0.125)
        assert torch.equal(one[0], batch[row])


def test_a_row_with_nothing_to_attend_gets_zeros_not_nan(kernel):
    query = torch.randn(2, 1, 3, 64)
    key, value = torch.randn(2, 1, 8, 64), torch.randn(2, 1, 8, 64)
    keep = torch.ones(2, 8, dtype=torch.bool)
    keep[1] = False
    out = cpu_kernels.attend(query, key, value, keep[:, None, None, :], 0.125)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and not out.isnan().any()


def test_what_the_kernel_does_not_take_is_left_to_sdpa(kernel, monkeypatch):
    query, key, value = torch.randn(1, 1, 2, 16), torch.randn(1, 1, 4, 16), torch.randn(1, 1, 4, 16)
    additive = torch.zeros(1, 1, 1, 4)  # a float mask: another mask form
    assert cpu_kernels.attend(query, key, value, additive, 0.25) is None
    assert cpu_kernels.attend(query.half(), key.half(), value.half(), None, 0.25) is None
    assert cpu_kernels.attend(query, key.transpose(-1, -2).contiguous().transpose(-1, -2), value, None,
                                   0.25) is None  # keys not contiguous in their last dim
    monkeypatch.setenv(cpu_kernels.DISABLE, "0")
    assert cpu_kernels.attend(query, key, value, None, 0.25) is None


def test_generation_decodes_on_the_kernel_with_sdpa_s_tokens(kernel, monkeypatch):
    """tiny-smollm2 in float32, rows of different lengths (a mask): every decode step's attention
    runs on the kernel, and the tokens and log-probs are those of decoding on sdpa."""
    model = load_model("tiny-smollm2", dtype="float32").model.eval()
    requests = [GenerationRequest(list(range(100 + 3 * i, 140 + 11 * i)), max_new_tokens=6, seed=i) for i in range(4)]
    calls = []

    class Spy:
        def decode_attention(self, *args):  # noqa: ANN002, ANN201
            calls.append(args[0].shape)
            return kernel.decode_attention(*args)

    monkeypatch.setattr(cpu_kernels, "_module", Spy())
    on_kernel = generate_batch(model, requests, pad_token_id=0, temperature=1.0)
    layers = model.config.num_hidden_layers
    assert len(calls) == layers * 5  # 5 decode steps after the prefill's first token, every layer
    monkeypatch.setenv(cpu_kernels.DISABLE, "0")
    on_sdpa = generate_batch(model, requests, pad_token_id=0, temperature=1.0)
    for got, want in zip(on_kernel, on_sdpa):
        assert got.token_ids == want.token_ids
        assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(16, 1, 576), (3, 301, 576), (2, 7, 64)])
def test_rms_norm_is_transformers_llama_rms_norm(kernel, dtype, shape):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    generator = torch.Generator().manual_seed(shape[1])
    norm = LlamaRMSNorm(shape[-1], eps=1e-5).to(dtype)
    with torch.inference_mode():
        norm.weight.copy_(1 + 0.3 * torch.randn(shape[-1], generator=generator))
        x = (3 * torch.randn(shape, generator=generator)).to(dtype)
        want, got = norm(x), cpu_kernels.rms_norm(x, norm.weight, norm.variance_epsilon)
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    else:  # rarely, the variance's last bit rounds the other way: the normalized value is one bf16
        # step off, and times the weight (rounded again) at most two steps of the output
        differ = got != want
        assert differ.float().mean() < 1e-4
        assert ((got.float() - want.float()).abs() <= want.float().abs() / 64 + 1e-30)[differ].all()


def test_rms_norm_declines_what_it_does_not_compute(kernel, monkeypatch):
    x, weight = torch.randn(2, 8), torch.ones(8)
    assert cpu_kernels.rms_norm(x.bfloat16(), weight, 1e-5) is None  # torch would promote to float32
    assert cpu_kernels.rms_norm(x.half(), weight.half(), 1e-5) is None
    assert cpu_kernels.rms_norm(x, torch.ones(8, requires_grad=True), 1e-5) is None  # training: autograd's
    monkeypatch.setenv(cpu_kernels.DISABLE, "0")
    assert cpu_kernels.rms_norm(x, weight, 1e-5) is None


def test_sampling_runs_every_norm_on_the_kernel_and_puts_them_back(kernel, monkeypatch):
    from workers.models.cpu.cpu_speedups import fused_rms_norms

    model = load_model("tiny-smollm2", dtype="float32").model.eval()
    requests = [GenerationRequest(list(range(100 + 3 * i, 140 + 11 * i)), max_new_tokens=6, seed=i) for i in range(3)]
    plain = generate_batch(model, requests, pad_token_id=0, temperature=1.0)
    calls = []

    class Spy:
        def rms_norm(self, *args):  # noqa: ANN002, ANN201
            calls.append(args[0].shape)
            return kernel.rms_norm(*args)

        def decode_attention(self, *args):  # noqa: ANN002, ANN201
            return kernel.decode_attention(*args)

    monkeypatch.setattr(cpu_kernels, "_module", Spy())
    with fused_rms_norms(model) as norms:
        fused = generate_batch(model, requests, pad_token_id=0, temperature=1.0)
    assert norms == 2 * model.config.num_hidden_layers + 1
    assert len(calls) == norms * 6  # the prefill and 5 decode steps, every norm
    assert not any("forward" in module.__dict__ for module in model.modules())
    for got, want in zip(fused, plain):
        assert got.token_ids == want.token_ids
        assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) < 1e-4


@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (4, 2, 16), (4, 4, 32)])
def test_rotary_is_transformers_rotary_bit_for_bit(kernel, heads, kv_heads, dim):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    rows = 16
    generator = torch.Generator().manual_seed(dim)
    qkv = (2 * torch.randn(rows, 1, (heads + 2 * kv_heads) * dim, generator=generator)).bfloat16()
    config = LlamaConfig(hidden_size=heads * dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=dim, rope_theta=100000.0)
    positions = torch.randint(0, 8000, (rows, 1), generator=generator)
    cos, sin = LlamaRotaryEmbedding(config)(qkv, positions)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    want_q, want_k = apply_rotary_pos_emb(q.view(rows, 1, heads, dim).transpose(1, 2),
                                          k.view(rows, 1, kv_heads, dim).transpose(1, 2), cos, sin)
    got_q, got_k = kernel.rotary(qkv, cos, sin, heads, kv_heads)
    assert got_q.shape == (rows, kv_heads, heads // kv_heads, dim) and got_k.shape == (rows, kv_heads, 1, dim)
    assert torch.equal(got_q.reshape(rows, heads, 1, dim), want_q) and torch.equal(got_k, want_k)
    assert not torch.equal(got_k, k.view(rows, 1, kv_heads, dim).transpose(1, 2))  # it did rotate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_gradient_is_autograds_through_transformers_norm(kernel, dtype):
    """The update runs its norms on the kernel too: the input's gradient (the weight is frozen) is
    autograd's through LlamaRMSNorm's ops, to float32 rounding, and in bfloat16 as close to float64."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    generator = torch.Generator().manual_seed(5)
    norm = LlamaRMSNorm(576, eps=1e-5).to(dtype).requires_grad_(False)
    norm.weight.copy_(1 + 0.3 * torch.randn(576, generator=generator))
    x = (3 * torch.randn(3, 41, 576, generator=generator)).to(dtype)
    grad = torch.randn(3, 41, 576, generator=generator).to(dtype)

    def gradient(forward) -> torch.Tensor:  # noqa: ANN001
        leaf = x.clone().requires_grad_()
        forward(leaf).backward(grad)
        return leaf.grad

    ours = gradient(lambda t: cpu_kernels.rms_norm(t, norm.weight, norm.variance_epsilon))
    autograd = gradient(norm)
    exact = gradient(lambda t: norm.weight.double() * t.double() * torch.rsqrt(t.double().pow(2).mean(-1, keepdim=True) + 1e-5))
    assert ours.dtype == dtype and ours.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(ours, autograd, rtol=1e-5, atol=1e-6)
    else:
        error = lambda got: float((got.double() - exact).norm() / exact.norm())  # noqa: E731
        assert error(ours) <= 1.1 * error(autograd)


def rotary_inputs(batch: int, length: int, heads: int, kv_heads: int, dim: int):  # noqa: ANN201
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=heads * dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=4096)
    generator = torch.Generator().manual_seed(length)
    q = torch.randn(batch, length, heads * dim, generator=generator).bfloat16()
    k = torch.randn(batch, length, kv_heads * dim, generator=generator).bfloat16()
    positions = torch.arange(length)[None] + 5 * torch.arange(batch)[:, None]
    cos, sin = LlamaRotaryEmbedding(config)(q, positions)
    # as transformers' attention hands them over: transposed views of the projections' outputs
    return q.view(batch, length, heads, dim).transpose(1, 2), k.view(batch, length, kv_heads, dim).transpose(1, 2), cos, sin


@pytest.mark.parametrize("batch, length, heads, kv_heads, dim", [(3, 37, 9, 3, 64), (2, 5, 4, 2, 16)])
def test_rotary_of_prefills_and_the_update_is_transformers_and_its_gradient_as_close_to_float64(
        kernel, batch, length, heads, kv_heads, dim):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k, cos, sin = rotary_inputs(batch, length, heads, kv_heads, dim)
    with torch.inference_mode():
        want, got = apply_rotary_pos_emb(q, k, cos, sin), cpu_kernels.rotary_embedding(q, k, cos, sin)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    grads = [torch.randn(x.shape, generator=torch.Generator().manual_seed(9)).bfloat16() for x in (q, k)]

    def gradients(rotate) -> list[torch.Tensor]:  # noqa: ANN001
        leaves = [x.detach().clone().requires_grad_() for x in (q, k)]
        torch.autograd.backward(list(rotate(*leaves)), grads)
        return [leaf.grad for leaf in leaves]

    ours = gradients(lambda a, b: cpu_kernels.rotary_embedding(a, b, cos, sin))
    autograd = gradients(lambda a, b: apply_rotary_pos_emb(a, b, cos, sin))
    exact = gradients(lambda a, b: apply_rotary_pos_emb(a.double(), b.double(), cos.double(), sin.double()))
    for mine, theirs, truth in zip(ours, autograd, exact):
        error = lambda got: float((got.double() - truth).norm() / truth.norm())  # noqa: E731
        assert mine.dtype == torch.bfloat16 and error(mine) <= error(theirs)


def test_fused_rotary_replaces_transformers_function_while_any_block_is_open(kernel):
    from transformers.models.llama import modeling_llama

    from workers.models.cpu.cpu_speedups import fused_rotary

    model = load_model("tiny-smollm2", dtype="bfloat16").model
    original = modeling_llama.apply_rotary_pos_emb
    with fused_rotary(model) as layers:
        assert layers == model.config.num_hidden_layers
        with fused_rotary(model):  # sampling and the update may overlap
            assert modeling_llama.apply_rotary_pos_emb is not original
        assert modeling_llama.apply_rotary_pos_emb is not original
        q, k, cos, sin = rotary_inputs(2, 7, 4, 2, 16)
        fused = modeling_llama.apply_rotary_pos_emb(q.float(), k.float(), cos.float(), sin.float())  # not taken
        torch.testing.assert_close(fused[0], original(q.float(), k.float(), cos.float(), sin.float())[0])
    assert modeling_llama.apply_rotary_pos_emb is original


def test_a_restart_from_another_copy_of_the_code_reuses_the_build(kernel, tmp_path):
    """A worker restarted from another path to the same code (a new release directory after a
    deploy, another checkout) imports the build it finds instead of compiling for a minute: the
    cache is keyed by what goes into the binary, not by where the sources lie."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    library = Path(kernel.__file__)
    built_at = library.stat().st_mtime_ns
    copy = tmp_path / "release-2"
    shutil.copytree(Path(cpu_kernels.__file__).with_name("kernels"), copy / "kernels")
    shutil.copy(cpu_kernels.__file__, copy / "cpu_kernels.py")
    program = ("import importlib.util, sys\n"
               f"spec = importlib.util.spec_from_file_location('released_kernels', {str(copy / 'cpu_kernels.py')!r})\n"
               "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
               "print(module.load().__file__)\n")
    loaded = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == str(library)
    assert library.stat().st_mtime_ns == built_at  # nothing was compiled or linked again
