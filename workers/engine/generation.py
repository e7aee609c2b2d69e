"""Batched sampling with a KV cache, left padding, per-rollout seeds, and the log-prob of every
sampled token (token-in/token-out: the ids and log-probs are kept exactly as sampled).

Log-probs are those of the policy at the sampling temperature over the full vocabulary
(top-p only narrows which token is drawn), so the trainer can recompute them with one
forward pass and the same temperature.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from workers.models.cpu import lean_decode
from workers.engine.sampler import GenerationOutput, GenerationRequest


@dataclass
class KVPrefix:
    """A rollout's attention cache for the first `length` tokens of its next context, kept from its
    last turn (the context and every sampled token but the last, which was never fed): the next
    turn feeds only what came after (the last sampled token, the tool results, the next prompt)."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [kv_heads, length, head_dim]
    length: int

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)


def _sample_rows(
    logits: torch.Tensor, temperature: float, top_p: float, generators: list[torch.Generator]
) -> tuple[list[int], list[float]]:
    """One token per row, and its log-prob under the tempered policy. Vectorised over rows; each
    row draws its single uniform number from its own generator (inverse-CDF sampling), so a
    rollout's tokens depend on its seed only, never on which rollouts share its batch."""
    logits = logits.float()
    if temperature <= 0:
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = logprobs.argmax(dim=-1)
    else:
        logprobs = torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)
        probs, order = logprobs.exp(), None
        if top_p < 1.0:
            probs, order = torch.sort(probs, dim=-1, descending=True)
            probs = probs * ((probs.cumsum(dim=-1) - probs) < top_p)
        cdf = probs.cumsum(dim=-1)
        uniforms = torch.cat([torch.rand(1, generator=g) for g in generators]).unsqueeze(-1)
        picks = torch.searchsorted(cdf, uniforms * cdf[:, -1:], right=True).clamp(max=cdf.shape[-1] - 1)
        tokens = (order.gather(-1, picks) if order is not None else picks).squeeze(-1)
    chosen = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens.tolist(), chosen.tolist()


def _constrained(logits: torch.Tensor, constraints: list[Any]) -> torch.Tensor:
    """The logits with every token a row's constraint forbids at -inf (rows without one as they are)."""
    if not any(c is not None for c in constraints):
        return logits
    logits = logits.float().clone()
    for row, constraint in enumerate(constraints):
        if constraint is not None:
            allowed = torch.from_numpy(constraint.allowed(logits.shape[-1]))
            logits[row].masked_fill_(~allowed, float("-inf"))
    return logits


STOP_STRING_WINDOW = 8  # tokens decoded to look for a stop string


def _ends_with_stop_string(ids: list[int], stop_strings: tuple[str, ...], decode: Callable[[list[int]], str] | None) -> bool:
    if not stop_strings or decode is None:
        return False
    tail = decode(ids[-STOP_STRING_WINDOW:])
    return any(stop in tail for stop in stop_strings)


@dataclass
class _Row:
    """A request in the running batch: its output so far and its own random stream."""

    key: Any  # the caller's handle, given back with the finished output
    request: GenerationRequest
    generator: torch.Generator
    output: GenerationOutput = field(default_factory=GenerationOutput)
    next_token: int = 0


class DecodeBatch:
    """The running batch of a continuous-batching generator. `add` prefills new requests and joins
    them to the batch; `step` samples one token for every row and lets finished rows leave (their
    cache columns go with them, so the rest decode a smaller batch). Rows of different lengths share
    one left-aligned cache; a column a row does not use is masked out for it.

    Work is saved three ways: requests with the same context (a group's G rollouts of one prompt)
    are prefilled once and the cache copied to each; a request that brings its cache from the last
    turn (`prefix`) prefills only its new tokens; a row leaves the batch as soon as it is done."""

    def __init__(self, model: torch.nn.Module, *, pad_token_id: int, temperature: float = 1.0, top_p: float = 1.0,
                 decode: Callable[[list[int]], str] | None = None, on_token: Callable[[Any, int], None] | None = None,
                 timings: dict[str, float] | None = None) -> None:
        self.model, self.pad_token_id, self.temperature, self.top_p, self.decode = (
            model, pad_token_id, temperature, top_p, decode)
        self.on_token, self.timings = on_token, timings  # on_token(key, token_id) as each token is drawn
        self.device = next(model.parameters()).device
        self.rows: list[_Row] = []
        self.cache: Any = None  # the model's cache for every row, [rows, heads, width, dim] per layer
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=self.device)  # [rows, width]
        self.positions = torch.zeros((0, 1), dtype=torch.long, device=self.device)  # next position per row
        self.prefill_tokens = 0  # tokens fed by prefills (what the saving above is measured in)
        self.prefill_rows: list[int] = []  # requests joined by each prefill
        self.largest = 0  # most rows decoding at once

    def __len__(self) -> int:
        return len(self.rows)

    @torch.inference_mode()
    def add(self, requests: list[tuple[Any, GenerationRequest]]) -> list[tuple[Any, GenerationOutput]]:
        """Prefill `(key, request)` pairs, sample their first token and join them to the batch;
        returns those already finished (a first token that ends the turn)."""
        if not requests:
            return []
        clock = _PhaseClock(self.timings, "prefill_s")
        unique, expand = _dedupe([request for _, request in requests])
        ids, mask, positions, cache = self._prefill_inputs(unique)
        result = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache,
                            use_cache=True, logits_to_keep=1)
        self.prefill_tokens += int(sum(len(r.context_ids) - _cached(r) for r in unique))
        self.prefill_rows.append(len(requests))
        cache = result.cache
        index = torch.tensor(expand, device=self.device)
        if len(unique) < len(requests):
            cache.batch_select_indices(index)
        # The rows keep no prefix: it was copied into the batch's cache, and is freed with the request.
        rows = [_Row(key, replace(request, prefix=None), torch.Generator().manual_seed(request.seed))
                for key, request in requests]
        self._join(rows, cache, mask[index], positions[index, -1:] + 1)
        self.largest = max(self.largest, len(self.rows))
        finished = self._sample(result.logits[index, -1, :], first=len(self.rows) - len(rows))
        clock.switch(None)
        return finished

    @torch.inference_mode()
    def step(self) -> list[tuple[Any, GenerationOutput]]:
        """Feed every row its last sampled token and sample the next; returns the rows that finished."""
        clock = _PhaseClock(self.timings, "decode_s")
        step_input = torch.tensor([[row.next_token] for row in self.rows], device=self.device)
        self.mask = torch.cat([self.mask, torch.ones((len(self.rows), 1), dtype=torch.long, device=self.device)], dim=-1)
        lean = lean_decode.decoder_for(self.model)
        if lean is not None:
            logits = lean.step(step_input, self.mask, self.positions, self.cache)
        else:
            result = self.model(input_ids=step_input, attention_mask=self.mask, position_ids=self.positions,
                                cache=self.cache, use_cache=True, logits_to_keep=1)
            self.cache, logits = result.cache, result.logits[:, -1, :]
        self.positions = self.positions + 1
        finished = self._sample(logits, first=0)
        clock.switch(None)
        return finished

    def _prefill_inputs(self, unique: list[GenerationRequest]) -> tuple[torch.Tensor, ...]:
        """Left-padded new tokens after left-padded cached prefixes: [pad][prefix][pad][new]."""
        cached = [_cached(r) for r in unique]
        new = [r.context_ids[c:] for r, c in zip(unique, cached)]
        width_cached, width_new = max(cached), max(len(n) for n in new)
        ids = torch.full((len(unique), width_new), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(unique), width_cached + width_new), dtype=torch.long)
        positions = torch.zeros((len(unique), width_new), dtype=torch.long)
        for row, (tokens, c) in enumerate(zip(new, cached)):
            ids[row, width_new - len(tokens):] = torch.tensor(tokens)
            mask[row, width_cached - c:width_cached] = 1
            mask[row, width_new + width_cached - len(tokens):] = 1
            positions[row, width_new - len(tokens):] = torch.arange(c, c + len(tokens))
        prefixes = [r.prefix for r in unique]
        cache = _cache_of_prefixes(prefixes, width_cached, self.model) if width_cached else _new_cache(self.model)
        return ids.to(self.device), mask.to(self.device), positions.to(self.device), cache

    def _join(self, rows: list[_Row], cache: Any, mask: torch.Tensor, positions: torch.Tensor) -> None:
        if not self.rows:
            self.rows, self.cache, self.mask, self.positions = rows, cache, mask, positions
            return
        width = max(self.mask.shape[1], mask.shape[1])
        _merge_caches(self.cache, cache, width)
        self.mask = torch.cat([_left_pad(self.mask, width), _left_pad(mask, width)])
        self.positions = torch.cat([self.positions, positions])
        self.rows = self.rows + rows

    def _sample(self, logits: torch.Tensor, *, first: int) -> list[tuple[Any, GenerationOutput]]:
        """Sample for rows[first:], whose logits these are, then let finished rows leave."""
        rows = self.rows[first:]
        logits = _constrained(logits.cpu(), [row.request.constraint for row in rows])
        tokens, logprobs = self._sample_by_settings(logits, rows)
        done: list[int] = []
        for position, (row, token, logprob) in enumerate(zip(rows, tokens, logprobs), start=first):
            out, request = row.output, row.request
            out.token_ids.append(token)
            out.logprobs.append(logprob)
            row.next_token = token
            if self.on_token is not None:
                self.on_token(row.key, token)
            if request.constraint is not None:
                request.constraint.advance(token)
            if token in request.stop_token_ids or _ends_with_stop_string(out.token_ids, request.stop_strings, self.decode) \
                    or (request.constraint is not None and request.constraint.finished):
                out.finish = "stop"
                done.append(position)
            elif len(out.token_ids) >= request.max_new_tokens:
                done.append(position)
        return self._leave(done)

    def _sample_by_settings(self, logits: torch.Tensor, rows: list[_Row]) -> tuple[list[int], list[float]]:
        """`_sample_rows` for each group of rows that share a temperature and top-p (served requests
        bring their own; rollouts share the batch's)."""
        groups: dict[tuple[float, float], list[int]] = {}
        for index, row in enumerate(rows):
            request = row.request
            settings = (self.temperature if request.temperature is None else request.temperature,
                        self.top_p if request.top_p is None else request.top_p)
            groups.setdefault(settings, []).append(index)
        if len(groups) == 1:
            (temperature, top_p), = groups
            return _sample_rows(logits, temperature, top_p, [row.generator for row in rows])
        tokens, logprobs = [0] * len(rows), [0.0] * len(rows)
        for (temperature, top_p), indices in groups.items():
            picked = _sample_rows(logits[indices], temperature, top_p, [rows[i].generator for i in indices])
            for i, token, logprob in zip(indices, *picked):
                tokens[i], logprobs[i] = token, logprob
        return tokens, logprobs

    def _leave(self, done: list[int]) -> list[tuple[Any, GenerationOutput]]:
        if not done:
            return []
        finished = []
        for position in done:
            row = self.rows[position]
            if row.request.keep_cache:
                row.output.cache = _row_prefix(self.cache, position, self.mask[position])
            finished.append((row.key, row.output))
        leaving = set(done)
        keep = [i for i in range(len(self.rows)) if i not in leaving]
        if keep:
            index = torch.tensor(keep, device=self.device)
            self.cache.batch_select_indices(index)
            self.mask, self.positions = _drop_empty_columns(self.mask[index], self.cache), self.positions[index]
        else:
            self.cache, self.mask = None, self.mask[:0]
            self.positions = self.positions[:0]
        self.rows = [self.rows[i] for i in keep]
        return finished


def _cached(request: GenerationRequest) -> int:
    return request.prefix.length if request.prefix is not None else 0


def _dedupe(requests: list[GenerationRequest]) -> tuple[list[GenerationRequest], list[int]]:
    """The distinct contexts to prefill, and for each request the index of its context among them.
    Only requests without a cached prefix are shared (a prefix belongs to one rollout)."""
    unique: list[GenerationRequest] = []
    seen: dict[tuple[int, ...], int] = {}
    expand = []
    for request in requests:
        key = tuple(request.context_ids) if request.prefix is None else None
        if key is not None and key in seen:
            expand.append(seen[key])
            continue
        if key is not None:
            seen[key] = len(unique)
        expand.append(len(unique))
        unique.append(request)
    return unique, expand


def _layers(cache: Any) -> list[Any]:
    return cache.layers  # transformers' DynamicCache: one DynamicLayer (keys, values) per decoder layer


class _AppendLayer(DynamicLayer):
    """transformers' DynamicLayer, but each step's keys and values are written into spare room at
    the end of its buffers instead of concatenated: torch.cat copied the whole cache at every
    decode step (16 % of a generation's time in a profile). `keys`/`values` read as views of the
    filled part; assigning them (row selection, merges) replaces the buffers."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor | None] = {"keys": None, "values": None}
        self._lengths = {"keys": 0, "values": 0}  # each its own: callers assign one, then the other
        super().__init__()

    def _filled(self, name: str) -> torch.Tensor | None:
        buffer = self._buffers[name]
        return buffer if buffer is None or buffer.dim() != 4 else buffer[:, :, :self._lengths[name]]

    def _assign(self, name: str, value: torch.Tensor | None) -> None:
        self._buffers[name] = value
        self._lengths[name] = value.shape[-2] if value is not None and value.dim() == 4 else 0

    keys = property(lambda self: self._filled("keys"), lambda self, value: self._assign("keys", value))
    values = property(lambda self: self._filled("values"), lambda self, value: self._assign("values", value))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        for name, states in (("keys", key_states), ("values", value_states)):
            start, end = self._lengths[name], self._lengths[name] + states.shape[-2]
            buffer = self._buffers[name]
            if buffer is None or buffer.dim() != 4 or end > buffer.shape[-2]:
                buffer = self._grow(name, states, end)
            buffer[:, :, start:end] = states
            self._lengths[name] = end
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep these rows (rows leaving the batch, a shared prefill copied to its rows): one copy
        that keeps the spare room (transformers' version copies the filled part, and the next
        step's append copied the whole cache again to grow)."""
        for name in ("keys", "values"):
            buffer = self._buffers[name]
            if buffer is not None and buffer.dim() == 4:
                self._buffers[name] = buffer[indices]

    def drop_leading_columns(self, start: int) -> None:
        """Forget the first `start` columns: a view of the same buffers, nothing copied."""
        for name in ("keys", "values"):
            buffer = self._buffers[name]
            if buffer is not None and buffer.dim() == 4:
                self._buffers[name] = buffer[:, :, start:]
                self._lengths[name] -= start

    def append_rows(self, keys: torch.Tensor, values: torch.Tensor, width: int) -> None:
        """Add joining rows, this layer's rows and theirs right-aligned in `width` columns (zeros
        in the padding), written once into new buffers with spare room."""
        for name, theirs in (("keys", keys), ("values", values)):
            mine = self._filled(name)
            buffer = mine.new_empty((mine.shape[0] + theirs.shape[0], mine.shape[1], width + max(128, width // 4),
                                     mine.shape[-1]))
            for rows, part in ((slice(0, mine.shape[0]), mine), (slice(mine.shape[0], None), theirs)):
                buffer[rows, :, :width - part.shape[-2]] = 0
                buffer[rows, :, width - part.shape[-2]:width] = part
            self._buffers[name], self._lengths[name] = buffer, width

    def _grow(self, name: str, states: torch.Tensor, needed: int) -> torch.Tensor:
        """A new buffer with room for `needed` tokens and a quarter more (at least 128)."""
        filled, length = self._filled(name), self._lengths[name]
        buffer = states.new_empty((states.shape[0], states.shape[1], needed + max(128, needed // 4), states.shape[-1]))
        if length:
            buffer[:, :, :length] = filled
        self._buffers[name] = buffer
        return buffer


def _new_cache(model: torch.nn.Module, layers: int = 0) -> Any:
    """The cache the model would make for itself (its config names the layer kinds), with its
    full-attention layers appending in place (_AppendLayer); `layers` more than the config has
    (a wrapper's own, benchmarks/rollouts)."""
    from transformers import DynamicCache, PretrainedConfig

    config = model.config if isinstance(model.config, PretrainedConfig) else None
    if config is None:
        return DynamicCache()  # layers made on first use (test policies)
    cache = DynamicCache(config=config)
    cache.layers = [_AppendLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    while len(cache.layers) < layers:
        cache.layers.append(DynamicLayer())
    return cache


def _cache_of_prefixes(prefixes: list[KVPrefix | None], width: int, model: torch.nn.Module) -> Any:
    """A DynamicCache [rows, heads, width, dim] per layer with each prefix right-aligned in it."""
    template = next(p for p in prefixes if p is not None)
    cache = _new_cache(model, len(template.layers))
    for layer, (k0, v0) in enumerate(template.layers):
        keys = k0.new_zeros((len(prefixes), k0.shape[0], width, k0.shape[2]))
        values = v0.new_zeros((len(prefixes), v0.shape[0], width, v0.shape[2]))
        for row, prefix in enumerate(prefixes):
            if prefix is not None:
                k, v = prefix.layers[layer]
                keys[row, :, width - prefix.length:] = k
                values[row, :, width - prefix.length:] = v
        cache.update(keys, values, layer)
    return cache


def _row_prefix(cache: Any, row: int, mask_row: torch.Tensor) -> KVPrefix:
    """One row's cache over the columns it uses (copies: the batch's tensors are freed)."""
    columns = torch.nonzero(mask_row).squeeze(-1)
    layers = [(layer.keys[row, :, columns].clone(), layer.values[row, :, columns].clone()) for layer in _layers(cache)]
    return KVPrefix(layers=layers, length=int(columns.numel()))


def _left_pad(tensor: torch.Tensor, width: int, dim: int = 1) -> torch.Tensor:
    missing = width - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def _merge_caches(running: Any, joining: Any, width: int) -> None:
    """Append the joining rows' cache to the running one, both left-padded to `width` columns."""
    for mine, theirs in zip(_layers(running), _layers(joining)):
        if isinstance(mine, _AppendLayer):
            mine.append_rows(theirs.keys, theirs.values, width)
            continue
        mine.keys = torch.cat([_left_pad(mine.keys, width, 2), _left_pad(theirs.keys, width, 2)])
        mine.values = torch.cat([_left_pad(mine.values, width, 2), _left_pad(theirs.values, width, 2)])


def _drop_empty_columns(mask: torch.Tensor, cache: Any) -> torch.Tensor:
    """Cut the leading columns no remaining row uses (left padding of a row that left)."""
    used = torch.nonzero(mask.any(dim=0))
    start = int(used[0]) if used.numel() else 0
    if start == 0:
        return mask
    for layer in _layers(cache):
        if isinstance(layer, _AppendLayer):
            layer.drop_leading_columns(start)
        else:
            layer.keys, layer.values = layer.keys[:, :, start:], layer.values[:, :, start:]
    return mask[:, start:]


@torch.inference_mode()
def generate_batch(
    model: torch.nn.Module, requests: list[GenerationRequest], *, pad_token_id: int, temperature: float = 1.0,
    top_p: float = 1.0, decode: Callable[[list[int]], str] | None = None,
    on_token: Callable[[int, int], None] | None = None, timings: dict[str, float] | None = None,
) -> list[GenerationOutput]:
    """Generate for every request at once (a DecodeBatch that no one joins later).
    `on_token(row, token_id)` is called for each sampled token as it is drawn (streaming);
    `timings` gets the seconds of the prefill (the first forward and its sampling) and of the
    decode steps added to its "prefill_s" and "decode_s" (the step-time breakdown)."""
    batch = DecodeBatch(model, pad_token_id=pad_token_id, temperature=temperature, top_p=top_p, decode=decode,
                        on_token=on_token, timings=timings)
    outputs: dict[int, GenerationOutput] = {}
    for row, output in batch.add(list(enumerate(requests))):
        outputs[row] = output
    while batch:
        for row, output in batch.step():
            outputs[row] = output
    return [outputs[row] for row in range(len(requests))]


class _PhaseClock:
    """Adds the seconds spent in each phase to `timings[phase]`; does nothing without `timings`."""

    def __init__(self, timings: dict[str, float] | None, phase: str) -> None:
        self.timings, self.phase, self.started = timings, phase, time.perf_counter()

    def switch(self, phase: str | None) -> None:
        if self.timings is not None and self.phase is not None:
            now = time.perf_counter()
            self.timings[self.phase] = self.timings.get(self.phase, 0.0) + now - self.started
            self.started = now
        self.phase = phase


@torch.inference_mode()
def sequence_logprobs(model: torch.nn.Module, token_ids: list[int], *, temperature: float = 1.0) -> list[float]:
    """Log-prob of each token given the ones before it (index 0 gets 0.0): the trainer's view."""
    device = next(model.parameters()).device
    ids = torch.tensor([token_ids], device=device)
    logits = model(input_ids=ids).logits[0, :-1].float()
    if temperature > 0:
        logits = logits / temperature
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
    return [0.0] + logprobs.cpu().tolist()
