"""The token sampler of the serving engine: the penalties, then the op `hy3.sample` (`hy3c.ops.sample`)
— its Triton provider (`hy3c.kernels.sampler`) on CUDA, its reference elsewhere.

    inputs = prepare_fused(params, generators, device)     # before the model step (None off CUDA)
    result = sample(logits, params, history, generators, num_logprobs, noise=None, prepared=inputs)
    pending = sample_async(logits, ..., staging=staging)   # the overlapped engine: draws on the device,
    pending.tokens                                         #   fed to the next step without a host sync,
    pending.result()                                       #   the host copy waited for later

Per row: the logit bias, repetition penalty over the prompt and output tokens, presence and frequency
penalties over the output tokens (`apply_penalties`, before either path), temperature, then min-p,
top-k and top-p filtering (`hy3c.ops.sample.filter_mask`), then a draw — greedy (temperature 0) or
Gumbel-max over the kept logits with the request's seeded generator (`noise` injects the uniform
draws, which makes sampling exactly reproducible in tests). Logprobs are those of the processed distribution (after bias,
penalties and temperature, before filtering), for the chosen token and the top `num_logprobs`.

Numbers that would overflow are kept out at this level, so that the reference and the fused kernel
see the same finite inputs: a temperature below SAMPLING_EPS (1e-5, as vLLM) is greedy — 1 / 1e-40
is inf in fp32 and would turn every logit into ±inf or NaN — and a penalised logit is clamped to
±PENALISED_LOGIT_LIMIT (a repetition penalty of 1e-300 divides by what fp32 holds as 0), which stays
finite after division by any temperature ≥ SAMPLING_EPS.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

import hy3c.kernels  # noqa: F401  (registers hy3.sample and its providers)
from hy3c.kernels.registry import providers_for
from hy3c.model.batch import aligned
from hy3c.ops.sample import SKIP_DRAW, block_columns, unpack_allowed

SAMPLING_EPS = 1e-5  # temperatures below this sample greedily (logits / 1e-40 overflow fp32 to inf)
PENALISED_LOGIT_LIMIT = 1e30  # x 1 / SAMPLING_EPS = 1e35: far below fp32's 3.4e38
# a request that names no temperature samples at 1.0, as OpenAI's API and vLLM do (the API's and `hy3c
# generate --temperature`'s default; 0 is greedy)
DEFAULT_TEMPERATURE = 1.0


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling parameters. A temperature below SAMPLING_EPS is stored as 0 (greedy), so
    every consumer — the reference, the fused kernel's columns, the top-logprobs fallback — treats it
    alike. `logit_bias`: (token id, bias) pairs added to the logits before everything else."""

    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < SAMPLING_EPS:
            object.__setattr__(self, "temperature", 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class History:
    """Token ids a row's penalties look at. With `tracked` (the engine's `TrackedPenalties`), the
    request's seen tokens and output counts are read from the device rows kept there at `slot`
    instead (host work per step then does not grow with the context); `prompt` / `output` must be
    what was registered and recorded there."""

    prompt: list[int]
    output: list[int]
    tracked: TrackedPenalties | None = None
    slot: int = -1


class TrackedPenalties:
    """The repetition, presence and frequency penalties' inputs of penalised requests kept on the
    device, a row per request: the prompt's tokens as a [V] mask and the output's token counts [V]
    (int32), so a step's penalties cost the host O(rows), not O(context). A request registers once
    (`slot`: O(its tokens) then), each new output token is recorded as it is emitted (`record`), and
    its row is freed when it leaves (`drop`). The rows grow by doubling."""

    def __init__(self, vocab: int, device: torch.device | str, rows: int = 4) -> None:
        self.vocab = vocab
        self.device = torch.device(device)
        self.prompt = torch.zeros(rows, vocab, dtype=torch.bool, device=self.device)
        self.counts = torch.zeros(rows, vocab, dtype=torch.int32, device=self.device)
        self._slots: dict[object, int] = {}
        self._free = list(range(rows - 1, -1, -1))

    def __contains__(self, owner: object) -> bool:
        return owner in self._slots

    def slot(self, owner: object, prompt: list[int], output: list[int]) -> int:
        """The request's row, registered from its prompt and output so far on first sight."""
        slot = self._slots.get(owner)
        if slot is not None:
            return slot
        if not self._free:
            self._grow()
        slot = self._slots[owner] = self._free.pop()
        self.prompt[slot].zero_()
        self.counts[slot].zero_()
        if prompt:
            self.prompt[slot, upload(torch.tensor(prompt, dtype=torch.long), self.device)] = True
        if output:
            self.record([(slot, token) for token in output])
        return slot

    def record(self, pairs: list[tuple[int, int]]) -> None:
        """Count emitted tokens: (slot, token) pairs, in one indexed add."""
        if pairs:
            index = upload(torch.tensor(pairs, dtype=torch.long).T.contiguous(), self.device)
            ones = torch.ones(len(pairs), dtype=torch.int32, device=self.device)
            self.counts.index_put_((index[0], index[1]), ones, accumulate=True)

    def drop(self, owner: object) -> None:
        slot = self._slots.pop(owner, None)
        if slot is not None:
            self._free.append(slot)

    def apply(self, logits: Tensor, rows: list[int], slots: list[int], params: list[SamplingParams]) -> None:
        """The repetition, then presence and frequency penalties of `rows` of `logits` (in place), as
        `apply_penalties` computes them from the host lists."""
        index = upload(torch.tensor([rows, slots], dtype=torch.long), self.device)
        values = upload(
            torch.tensor(
                [
                    [p.repetition_penalty for p in params],
                    [p.presence_penalty for p in params],
                    [p.frequency_penalty for p in params],
                ],
                dtype=torch.float64,
            ),
            self.device,
        )
        sub = logits.index_select(0, index[0])
        counts = self.counts.index_select(0, index[1])
        seen = self.prompt.index_select(0, index[1]) | (counts > 0)
        penalty = values[0].to(logits.dtype)[:, None]
        penalised = torch.where(sub > 0, sub / penalty, sub * penalty).clamp(
            -PENALISED_LOGIT_LIMIT, PENALISED_LOGIT_LIMIT
        )
        repeats = (values[0] != 1.0)[:, None]  # compared in fp64, as the host lists' path does
        sub = torch.where(seen & sub.isfinite() & repeats, penalised, sub)
        amount = values[1][:, None] * (counts > 0) + values[2][:, None] * counts
        sub = sub - amount.to(logits.dtype)
        logits.index_copy_(0, index[0], sub)

    def _grow(self) -> None:
        rows = self.prompt.shape[0]
        self.prompt = torch.cat([self.prompt, torch.zeros_like(self.prompt)])
        self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
        self._free = list(range(2 * rows - 1, rows - 1, -1))


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list[float]  # of the chosen token
    top: list[list[tuple[int, float]]]  # top-n (token, logprob) per row, n = num_logprobs


def upload(host: Tensor, device: torch.device | str) -> Tensor:
    """A host tensor on `device`; to CUDA through pinned memory without blocking, so a step built while
    the previous one runs does not wait for it (a pageable copy synchronizes the stream first)."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def apply_penalties(logits: Tensor, params: list[SamplingParams], history: list[History]) -> Tensor:
    """The logit bias, then the repetition penalty over the prompt and output tokens, then presence and
    frequency penalties over the output tokens (vLLM's order) — for all rows in a few indexed ops (only
    the tokens a row biases or has seen). Returns `logits` itself when no row has any, else a copy.
    Penalised logits are clamped to ±PENALISED_LOGIT_LIMIT (-inf, a masked token, stays -inf)."""
    bias: tuple[list[int], list[int], list[float]] = ([], [], [])  # rows, tokens, bias
    repeat: tuple[list[int], list[int], list[float]] = ([], [], [])  # rows, tokens, penalty
    subtract: tuple[list[int], list[int], list[float]] = ([], [], [])  # rows, tokens, amount
    tracked: tuple[list[int], list[int], list[SamplingParams]] = ([], [], [])  # rows, slots, params
    for row, (p, h) in enumerate(zip(params, history)):
        if p.logit_bias:
            bias[0].extend([row] * len(p.logit_bias))
            for token, amount in p.logit_bias:
                bias[1].append(token)
                bias[2].append(amount)
        if h.tracked is not None:
            if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
                tracked[0].append(row)
                tracked[1].append(h.slot)
                tracked[2].append(p)
            continue
        if p.repetition_penalty != 1.0 and (h.prompt or h.output):
            seen = set(h.prompt).union(h.output)
            repeat[0].extend([row] * len(seen))
            repeat[1].extend(seen)
            repeat[2].extend([p.repetition_penalty] * len(seen))
        if (p.presence_penalty or p.frequency_penalty) and h.output:
            for token, count in Counter(h.output).items():
                subtract[0].append(row)
                subtract[1].append(token)
                subtract[2].append(p.presence_penalty + p.frequency_penalty * count)
    if not bias[0] and not repeat[0] and not subtract[0] and not tracked[0]:
        return logits
    logits = logits.clone()

    def index(rows: list[int], tokens: list[int], values: list[float]) -> tuple[Tensor, Tensor, Tensor]:
        device = logits.device
        as_long = torch.tensor([rows, tokens], dtype=torch.long).to(device)
        return as_long[0], as_long[1], torch.tensor(values, dtype=logits.dtype).to(device)

    if bias[0]:
        rows, tokens, amount = index(*bias)
        logits.index_put_((rows, tokens), amount, accumulate=True)
    if repeat[0]:
        rows, tokens, penalty = index(*repeat)
        values = logits[rows, tokens]
        penalised = torch.where(values > 0, values / penalty, values * penalty)
        limit = PENALISED_LOGIT_LIMIT
        logits[rows, tokens] = torch.where(values.isfinite(), penalised.clamp(-limit, limit), values)
    if subtract[0]:
        rows, tokens, amount = index(*subtract)
        logits.index_put_((rows, tokens), -amount, accumulate=True)
    if tracked[0]:
        trackers = {id(h.tracked): h.tracked for h in history if h.tracked is not None}
        (tracker,) = trackers.values()
        tracker.apply(logits, *tracked)
    return logits


@dataclass(frozen=True)
class FusedInputs:
    """The fused sampler's per-row parameter columns, already on the device: temperature, top_k, top_p,
    min_p, seed. They do not depend on the logits, so the engine uploads them before the model step and
    the sampler's launches follow the step at once (no host-to-device copy waiting for the model)."""

    columns: tuple[Tensor, Tensor, Tensor, Tensor, Tensor]


def prepare_fused(
    params: list[SamplingParams], generators: list[torch.Generator | None], device: torch.device
) -> FusedInputs | None:
    """Draw this step's seeds and upload the parameter columns (None where the fused sampler is not used):
    `sampling_block`, then `upload_block`."""
    if not params or not fused_on(device):
        return None
    return upload_block(sampling_block(params, generators), len(params), device)


def fused_on(device: torch.device) -> bool:
    """Whether rows on `device` are drawn by the Triton fused sampler (CUDA, Triton installed)."""
    return device.type == "cuda" and _triton_sampler() is not None


def sampling_block(
    params: list[SamplingParams], generators: list[torch.Generator | None], width: int = 0
) -> Tensor:
    """The fused sampler's parameters of a step as one host [5, rows] int32 block (the layout of
    `hy3c.kernels.sampler.fused_sampler.block_columns`: rows 0-2 the fp32 bits of temperature, top_p,
    min_p; rows 3-4 top_k and the seed), with this step's seeds drawn.

    Each row draws a fresh 31-bit seed from its request's generator, so seeded requests reproduce. The
    rows are padded to a multiple of 4 (or to `width` rows, a decode graph's block: `sampling_width`),
    which puts every column 16-byte aligned whatever the batch size: Triton specializes on pointer
    alignment, and an unaligned column would compile new kernel variants on live traffic.
    """
    seeds = [
        int(torch.randint(0, 2**31 - 1, (1,), generator=g, device=g.device)) if g is not None else 0
        for g in generators
    ]
    return block_of(params, seeds, width)


def block_of(params: list[SamplingParams], seeds: list[int], width: int = 0) -> Tensor:
    """`sampling_block` for the given seeds (built through numpy: a few µs whatever the batch)."""
    columns = max(aligned(len(params), 4), width)
    block = np.zeros((5, columns), dtype=np.int32)
    rows = len(params)
    floats = block[:3].view(np.float32)
    floats[0, :rows] = [p.temperature for p in params]
    floats[1, :rows] = [p.top_p for p in params]
    floats[2, :rows] = [p.min_p for p in params]
    block[3, :rows] = [p.top_k for p in params]
    block[3, rows:] = SKIP_DRAW  # padding: a decode graph's rows beyond the batch are not drawn
    block[4, :rows] = seeds
    return torch.from_numpy(block)


def upload_block(block: Tensor, rows: int, device: torch.device) -> FusedInputs:
    """A `sampling_block` on the device (one copy) as the fused sampler's columns of `rows` rows."""
    return FusedInputs(block_columns(upload(block, device), rows))


def fused_inputs(params: list[SamplingParams], seeds: list[int], device: torch.device) -> FusedInputs:
    """The parameter columns of `prepare_fused` for the given seeds, on `device`."""
    return FusedInputs(block_columns(block_of(params, seeds).to(device), len(params)))


def has_penalties(params: SamplingParams) -> bool:
    """Whether the row's logits are changed before the draw (`apply_penalties`)."""
    p = params
    return (
        bool(p.logit_bias) or p.repetition_penalty != 1.0 or bool(p.presence_penalty or p.frequency_penalty)
    )


def sample(
    logits: Tensor,
    params: list[SamplingParams],
    history: list[History],
    generators: list[torch.Generator | None],
    num_logprobs: int = 0,
    noise: Tensor | None = None,
    prepared: FusedInputs | None = None,
    allowed: Tensor | None = None,
) -> SampleResult:
    """Sample one token per row; on CUDA through the Triton fused sampler (with the columns `prepared`
    earlier, else prepared now), elsewhere the reference. `allowed`: the rows' packed grammar masks
    (`hy3c.ops.sample`), or None."""
    return sample_async(
        logits, params, history, generators, num_logprobs, noise, prepared, allowed=allowed
    ).result()


@dataclass
class PendingSample:
    """A step's draws, launched: `tokens` (int64, one per row, on the logits' device) can feed the next
    step's inputs at once; `result()` waits for their copy to the host (once; later calls return it)."""

    tokens: Tensor
    _collect: Callable[[], SampleResult]
    _result: SampleResult | None = None

    def result(self) -> SampleResult:
        if self._result is None:
            self._result = self._collect()
        return self._result


def wait_event(event: torch.cuda.Event) -> None:
    """Wait for a CUDA event, keeping the GIL when it has already completed: `query` holds the GIL,
    `synchronize` releases it even then, and a busy HTTP loop on another thread may keep it for a
    while (bench/LOG.md: the engine's waits for the GIL inside a constrained step)."""
    if not event.query():
        event.synchronize()


class MaskStaging:
    """Pinned host buffers a step's packed masks are filled in and copied to the device from, without
    blocking: two used in turn (the overlapped engine has at most two steps' draws in flight), each
    reused only once its copy is done; grown to the largest step seen. Pinning a buffer per step cost
    ~7 ms at 32 rows on the H200 (bench/LOG.md), the masks themselves a fraction of that."""

    def __init__(self) -> None:
        self._buffers: list[Tensor] = []
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._next = 0

    def take(self, rows: int, vocab_size: int) -> Tensor:
        """A [rows, ceil(vocab_size / 32)] view of the next buffer, as the last use left it: every
        row must be written (`fill_masks`, then `allow_other_rows`)."""
        words = (vocab_size + 31) // 32
        if not self._buffers or self._buffers[0].numel() < rows * words:
            size = max(rows, 64) * words
            self._buffers = [torch.empty(size, dtype=torch.int32, pin_memory=True) for _ in range(2)]
            self._copied = [None, None]
        copied = self._copied[self._next]
        if copied is not None:
            wait_event(copied)
        return self._buffers[self._next][: rows * words].view(rows, words)

    def upload(self, masks: Tensor, device: torch.device) -> Tensor:
        """The masks of the last `take` on `device` (queued on the current stream)."""
        on_device = masks.to(device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._copied[self._next] = event
        self._next ^= 1
        return on_device


class HostStaging:
    """Two pinned host buffers the fused sampler's tokens and logprobs are copied into without blocking,
    used in turn: the overlapped engine has at most two steps' draws unread (the one it collects and the
    one it just launched). Allocated once at the largest batch seen (pinned allocation is slow).

    `take` returns a contiguous [rows, 2] view: a copy into a strided slice of pinned memory is not one
    DMA — torch stages it through pageable memory and waits for the device (measured on the H200: the
    engine's host blocked ~0.9 ms per step at batch 1 on it, the whole GPU step)."""

    def __init__(self) -> None:
        self._buffers: list[Tensor] = []
        self._next = 0

    def take(self, rows: int) -> Tensor:
        if not self._buffers or self._buffers[0].numel() < 2 * rows:
            size = 2 * max(rows, 64)
            self._buffers = [torch.empty(size, dtype=torch.float64, pin_memory=True) for _ in range(2)]
        buffer = self._buffers[self._next]
        self._next ^= 1
        return buffer[: 2 * rows].view(rows, 2)


def sample_async(
    logits: Tensor,
    params: list[SamplingParams],
    history: list[History],
    generators: list[torch.Generator | None],
    num_logprobs: int = 0,
    noise: Tensor | None = None,
    prepared: FusedInputs | None = None,
    staging: HostStaging | None = None,
    allowed: Tensor | None = None,
) -> PendingSample:
    """`sample` without waiting for the draws: on CUDA the fused sampler's tokens stay on the device and
    reach the host through a pinned `staging` buffer (copied without blocking; `result()` waits for it).
    With `num_logprobs` the top logprobs are gathered at once (a row whose kernel candidates cannot vouch
    for them reads its logits again, which a later step may overwrite), and off CUDA everything is."""
    if not params:
        return PendingSample(
            torch.empty(0, dtype=torch.long, device=logits.device), lambda: SampleResult([], [], [])
        )
    if logits.is_cuda and _triton_sampler() is not None:
        inputs = prepared or prepare_fused(params, generators, logits.device)
        assert inputs is not None
        return _sample_fused(logits, params, history, inputs, num_logprobs, noise, staging, allowed)
    result = sample_reference(logits, params, history, generators, num_logprobs, noise, allowed)
    return PendingSample(torch.tensor(result.tokens, dtype=torch.long, device=logits.device), lambda: result)


def _triton_sampler() -> torch._ops.OpOverload | None:
    """`hy3.sample`'s Triton provider; None where Triton is not installed."""
    return next((p.target for p in providers_for("sample") if p.name == "triton"), None)


def _sample_fused(
    logits,
    params,
    history,
    inputs: FusedInputs,
    num_logprobs,
    noise,
    staging: HostStaging | None = None,
    allowed: Tensor | None = None,
) -> PendingSample:
    logits = apply_penalties(logits.float(), params, history)
    outputs = _triton_sampler()(logits, *inputs.columns, noise, num_logprobs, allowed)
    tokens, chosen = outputs[:2]
    pair = torch.stack([tokens.double(), chosen.double()], 1)
    if staging is None or num_logprobs:
        result = _fused_result(logits, params, pair.T.tolist(), outputs, num_logprobs, allowed)
        return PendingSample(tokens.long(), lambda: result)
    return staged_draws(tokens.long(), pair, staging)


def staged_draws(tokens: Tensor, pair: Tensor, staging: HostStaging) -> PendingSample:
    """Draws on the device as a `PendingSample`: `pair` ([rows, 2] float64: each token and its
    logprobs) is copied to a pinned `staging` buffer without blocking; `result()` waits for that copy.
    `tokens` (int64) must stay valid until the next step has read them (a decode graph's output does:
    the next replay follows the reads queued before it)."""
    if not pair.is_cuda:
        result = _drawn(pair.tolist())
        return PendingSample(tokens, lambda: result)
    host = staging.take(pair.shape[0])
    host.copy_(pair, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def collect() -> SampleResult:
        wait_event(copied)
        return _drawn(host.tolist())

    return PendingSample(tokens, collect)


def _drawn(rows: list[list[float]]) -> SampleResult:
    """The draws of [rows, 2] (token, logprob) pairs, without top logprobs."""
    return SampleResult([int(token) for token, _ in rows], [chosen for _, chosen in rows], [[] for _ in rows])


def _fused_result(
    logits, params, pair: list[list[float]], outputs, num_logprobs, allowed: Tensor | None = None
) -> SampleResult:
    token_list, chosen_list = pair
    top: list[list[tuple[int, float]]] = [[] for _ in params]
    if num_logprobs:  # the kernel's sorted candidates give the top logprobs too
        ids, values, exact = (t.tolist() for t in outputs[2:])
        for row in range(len(params)):
            if not exact[row]:  # the candidates cannot vouch for the n-th token: the whole row
                temperature = params[row].temperature or 1.0
                scaled = logits[row] / temperature
                if allowed is not None:  # the grammar's disallowed tokens are -inf, as in the kernel
                    scaled = scaled.masked_fill(
                        ~unpack_allowed(allowed[row : row + 1], scaled.shape[-1])[0], -math.inf
                    )
                values[row], ids[row] = torch.log_softmax(scaled, -1).topk(num_logprobs)
                values[row], ids[row] = values[row].tolist(), ids[row].tolist()
            top[row] = list(zip(ids[row], values[row]))
    return SampleResult([int(t) for t in token_list], chosen_list, top)


def _uniforms(like: Tensor, generator: torch.Generator | None) -> Tensor:
    """Uniform draws shaped like `like` from the request's generator (a host generator on any device)."""
    device = generator.device if generator is not None else like.device
    return torch.rand(like.shape, generator=generator, device=device).to(like.device)


def sample_reference(
    logits: Tensor,
    params: list[SamplingParams],
    history: list[History],
    generators: list[torch.Generator | None],
    num_logprobs: int = 0,
    noise: Tensor | None = None,
    allowed: Tensor | None = None,
) -> SampleResult:
    """The penalties, then `hy3.sample`'s reference with each sampled row's uniforms drawn from its
    request's generator (or taken from `noise`); greedy rows draw nothing."""
    logits = apply_penalties(logits.float(), params, history)
    if noise is None:
        noise = torch.empty_like(logits)  # unread in greedy rows
        for row, (p, generator) in enumerate(zip(params, generators)):
            if not p.greedy:
                noise[row] = _uniforms(logits[row], generator)
    columns = fused_inputs(params, [0] * len(params), logits.device).columns
    tokens, chosen, ids, values, _ = torch.ops.hy3.sample(logits, *columns, noise, num_logprobs, allowed)
    top = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return SampleResult(tokens.tolist(), chosen.tolist(), top)
