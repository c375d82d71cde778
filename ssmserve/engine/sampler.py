"""Sampler: one vectorised pass over the whole batch, results to the host in one copy.

Each call reads the rows' settings in one host pass, packs them into one float64 buffer and
copies it to the device once. Penalties, min_tokens bans, temperature, top-k / top-p / min-p,
the draw and the logprobs are then tensor ops over [B, V]; a feature costs nothing for rows
that do not use it (the rows that do are gathered and handled together). The sampled ids,
their logprobs, ranks and top alternatives come back to the host in one device-to-host copy.

Logprobs are those of the model's raw distribution (log-softmax of the logits before
penalties and temperature), as vLLM returns by default and as HF's log-softmax gives.

Drawing. Let z be a row's logits after penalties and bans. A greedy row (temperature 0)
takes argmax z. A row with temperature T draws from softmax(z / T) restricted to the tokens
its filters keep, by the exponential race (the Gumbel-max trick): argmax_v (z_v / T - log E_v)
over the kept v, with E_v ~ Exp(1) independent. That is elementwise work and an exact
argmax, so a row's token depends on its own logits and noise only, never on its neighbours.

Noise. Unseeded rows draw E from the engine's generator, in one call for all of them. A
seeded row's E_v is a fixed function of (seed, sample index, output position, v): a
counter-based generator computed on the device for all seeded rows at once, so a seeded
request gives the same tokens alone or in any batch, in any arrival order, and after
preemption. Two 32-bit row keys a (odd) and b come from mixing the seed's halves, the sample
index and the position; token v's counter is (a * v + b) mod 2^32, mixed once more into 32
uniform bits u, and E = -log1p(-(u + 1/2) / 2^32). The mixer is an xor-shift-multiply
32-bit hash (constants from Wellons' hash prospector) on int64 values kept below 2^32 with
multipliers below 2^31, so no product overflows int64.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from ssmserve.kernels._common import HAS_TRITON, interpret_mode
from ssmserve.kernels.sampling import draw_triton
from ssmserve.sampling_params import SamplingParams

_MASK32 = 0xFFFFFFFF
# Keeps the uniform below 1 so that E, and so every score, stays finite.
_MAX_UNIFORM = 1.0 - 2.0**-24


@dataclass
class SamplingRow:
    """What the sampler needs for one row of logits."""

    params: SamplingParams
    sample_index: int  # which of the request's n samples; part of a seeded row's noise key
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # complete when the row has penalties
    # Output position of the token drawn (len(output_token_ids) when None): a step
    # launched before the one before it came back has tokens not in the list yet.
    position: int | None = None


@dataclass
class SamplerOutput:
    """Host-side results, one entry per row."""

    token_ids: list[int]
    logprobs: list[float]  # raw logprob of each sampled token
    ranks: list[int | None]  # its rank in the raw distribution (1 = top); None unless asked
    top_ids: list[list[int]]  # the row's `logprobs` top alternatives by rank, [] if none
    top_logprobs: list[list[float]]


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor's copy on `device`, queued behind the work already there without
    the host waiting for it (from pinned memory: a copy from pageable memory may wait)."""
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


class _Packed:
    """Several small tensors' values in one float64 buffer, uploaded in one copy."""

    def __init__(self) -> None:
        self.data = array("d")
        self.spans: dict[str, tuple[int, int, int]] = {}

    def add(self, name: str, values: list, width: int = 1) -> None:
        start = len(self.data)
        self.data.extend(values)
        self.spans[name] = (start, len(self.data), width)

    def upload(self, device: torch.device) -> dict[str, torch.Tensor]:
        if not self.data:
            return {}
        buf = _to_device(torch.frombuffer(self.data, dtype=torch.float64), device)
        return {
            name: buf[a:b] if width == 1 else buf[a:b].view(-1, width)
            for name, (a, b, width) in self.spans.items()
        }


class _Batch:
    """One host pass over the rows: which rows need what, and the values to upload.

    Spans uploaded (row indices are positions in the batch):
      rows       logits row of each batch row (only when not 0..B-1)
      temps      [B] temperature, 1 for greedy rows (only when some row samples)
      unseeded   sampled rows that draw from the engine's generator
      seeded     [S, 5] row, seed high 32 bits, seed low 32 bits, sample index, position
      filters    [F, 4] row, top_k (0 = none), top_p, min_p
      penalties  [P, 6] row, presence, frequency, repetition, #output ids, #prompt ids
      bans       [N, 2] row, token id masked out while the row is short of min_tokens
      lp_rows    rows that asked for logprobs
    Token ids for the penalties travel as int64 in `penalty_ids` (output ids of every
    penalty row, then the prompt ids of the rows with a repetition penalty).
    """

    def __init__(
        self, rows: list[SamplingRow], vocab: int, num_logits: int, logits_rows: list[int] | None
    ) -> None:
        self.num_rows = len(rows)
        temps: list[float] = []
        unseeded: list[int] = []
        seeded: list[float] = []
        filters: list[float] = []
        penalties: list[float] = []
        bans: list[int] = []
        self.lp_rows: list[int] = []
        self.lp_counts: list[int] = []
        self.max_top_k = 0
        self.any_top_p = False
        self.full_sort = False  # a top-p row without top-k needs its whole row sorted
        out_ids = array("q")
        prompt_ids = array("q")
        for i, row in enumerate(rows):
            p = row.params
            position = len(row.output_token_ids) if row.position is None else row.position
            if p.temperature == 0.0:
                temps.append(1.0)
            else:
                temps.append(p.temperature)
                if p.seed is None:
                    unseeded.append(i)
                else:
                    seed = p.seed % 2**64
                    seeded += (i, seed >> 32, seed & _MASK32, row.sample_index, position)
                top_k = p.top_k if 0 < p.top_k < vocab else 0
                if top_k or p.top_p < 1.0 or p.min_p > 0.0:
                    filters += (i, top_k, p.top_p, p.min_p)
                    self.max_top_k = max(self.max_top_k, top_k)
                    if p.top_p < 1.0:
                        self.any_top_p = True
                        self.full_sort = self.full_sort or not top_k
            if p.has_penalties:
                num_prompt = len(row.prompt_token_ids) if p.repetition_penalty != 1.0 else 0
                penalties += (
                    i,
                    p.presence_penalty,
                    p.frequency_penalty,
                    p.repetition_penalty,
                    position,
                    num_prompt,
                )
                out_ids.extend(row.output_token_ids)
                if num_prompt:
                    prompt_ids.extend(row.prompt_token_ids)
            if position < p.min_tokens:
                banned = set(p.stop_token_ids)
                if not p.ignore_eos:
                    banned.update(p.eos_token_ids)
                for token in banned:
                    if token < vocab:
                        bans += (i, token)
            if p.logprobs is not None:
                self.lp_rows.append(i)
                self.lp_counts.append(min(p.logprobs, vocab))
        if not out_ids and not prompt_ids:
            penalties = []  # nothing seen yet: the penalties change nothing
        # Every row greedy, or every row drawn from the engine's generator with only a
        # temperature: the rows `draw_triton` takes whole.
        self.plain = not (seeded or filters or penalties or bans or self.lp_rows) and (
            not unseeded or len(unseeded) == len(rows)
        )
        self.sampled = bool(unseeded) or bool(seeded)
        self.num_unseeded = len(unseeded)
        self.num_seeded = len(seeded) // 5
        self.num_filters = len(filters) // 4
        self.num_penalties = len(penalties) // 6
        self.num_out_ids = len(out_ids)
        self.num_prompt_ids = len(prompt_ids)
        self.num_bans = len(bans) // 2
        self.gather = logits_rows is not None and (
            num_logits != self.num_rows or logits_rows != list(range(self.num_rows))
        )
        packed = _Packed()
        if self.gather:
            packed.add("rows", logits_rows)
        if self.sampled:
            packed.add("temps", temps)
        for name, values, width in (
            ("unseeded", unseeded, 1),
            ("seeded", seeded, 5),
            ("filters", filters, 4),
            ("penalties", penalties, 6),
            ("bans", bans, 2),
            ("lp_rows", self.lp_rows, 1),
        ):
            if values:
                packed.add(name, values, width)
        self._packed = packed
        self._penalty_ids = out_ids + prompt_ids

    def upload(self, device: torch.device) -> dict[str, torch.Tensor]:
        dev = self._packed.upload(device)
        if self._penalty_ids:
            ids = torch.frombuffer(self._penalty_ids, dtype=torch.int64)
            dev["penalty_ids"] = _to_device(ids, device)
        return dev


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x's rows at `index`, or x itself when index names all of them.

    Row indices are collected in increasing order, so as many of them as x has rows are
    0..len(x)-1: the length decides, with no read of the device.
    """
    return x if index.numel() == x.shape[0] else x.index_select(0, index)


def _penalised(raw: torch.Tensor, batch: _Batch, dev: dict[str, torch.Tensor]) -> torch.Tensor:
    """A copy of raw with repetition (prompt and output ids), then frequency and presence
    (output ids) penalties applied to the penalty rows, all of them together.

    Only the logits of ids a row has seen change, so the work is over those ids: each
    (row, id) entry finds its output count by binary search in the sorted output keys and
    writes its penalised logit back (duplicates of an entry write the same value).
    """
    num_rows, vocab = raw.shape
    spec = dev["penalties"]
    presence, frequency, repetition = (spec[:, j].float() for j in (1, 2, 3))
    ids = dev["penalty_ids"].long()
    # Entry e belongs to penalty row owner[e]: its output ids first, then its prompt ids.
    owner = torch.arange(batch.num_penalties, device=raw.device)
    owner_out = torch.repeat_interleave(owner, spec[:, 4].long(), output_size=batch.num_out_ids)
    owner_prompt = torch.repeat_interleave(
        owner, spec[:, 5].long(), output_size=batch.num_prompt_ids
    )
    owner = torch.cat([owner_out, owner_prompt])
    # Ids outside [0, vocab) (a tokenizer larger than the LM head) change nothing.
    valid = (ids >= 0) & (ids < vocab)
    ids = ids.clamp(0, vocab - 1)
    key = torch.where(valid, owner * vocab + ids, -1)
    out_keys = key[: batch.num_out_ids].sort().values
    count = torch.searchsorted(out_keys, key, right=True) - torch.searchsorted(out_keys, key)
    count = count.to(raw.dtype)
    flat = spec[:, 0].long()[owner] * vocab + ids
    x = raw.view(-1)[flat]
    rep = repetition[owner]
    x = torch.where(x > 0, x / rep, x * rep)
    x -= frequency[owner] * count + presence[owner] * (count > 0)
    # One spare element past the logits takes the writes of invalid ids.
    storage = torch.empty(num_rows * vocab + 1, dtype=raw.dtype, device=raw.device)
    z = storage[:-1].view(num_rows, vocab)
    z.copy_(raw)
    storage.index_put_((torch.where(valid, flat, num_rows * vocab),), x)
    return z


def _thresholds(scaled: torch.Tensor, batch: _Batch, dev: dict[str, torch.Tensor]):
    """[B] the lowest scaled logit each row keeps (-inf where a row has no filter).

    top-k keeps values >= the k-th largest; top-p then keeps the shortest run of what
    top-k kept, largest first, whose renormalised probability reaches top_p; min-p keeps
    probabilities >= min_p times the largest, i.e. values >= max + log(min_p). top-k and
    top-p read the row's largest values in order: its top max_k when every top-p row also
    has a top-k, else a sort of the whole row.
    """
    spec = dev["filters"]
    index = spec[:, 0].long()
    top_k = spec[:, 1].long()[:, None]
    x = _rows(scaled, index)
    if batch.any_top_p or batch.max_top_k:
        if batch.full_sort:
            ordered = x.sort(dim=-1, descending=True).values
        else:
            ordered = x.topk(batch.max_top_k, dim=-1).values
        kth = ordered.gather(1, top_k.clamp(min=1) - 1)
        threshold = torch.where(top_k > 0, kth, float("-inf"))
        if batch.any_top_p:
            ordered = ordered.masked_fill(ordered < threshold, float("-inf"))
            probs = ordered.softmax(-1)
            mass_before = probs.cumsum(-1) - probs
            top_p = spec[:, 2:3].float()
            kept = (mass_before < top_p).sum(-1, keepdim=True)
            cutoff = ordered.gather(1, kept - 1)
            threshold = torch.maximum(threshold, torch.where(top_p < 1, cutoff, float("-inf")))
        top = ordered[:, :1]
    else:
        threshold = torch.full((x.shape[0], 1), float("-inf"), device=x.device)
        top = x.amax(-1, keepdim=True)
    threshold = torch.maximum(threshold, top + spec[:, 3:4].float().log()).squeeze(1)
    if batch.num_filters == batch.num_rows:
        return threshold
    out = torch.full((batch.num_rows,), float("-inf"), device=x.device)
    return out.index_copy_(0, index, threshold)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 values in [0, 2^32), in place; products stay < 2^63."""
    x ^= x >> 16
    x *= 0x21F0AAAD
    x &= _MASK32
    x ^= x >> 15
    x *= 0x735A2D97
    x &= _MASK32
    x ^= x >> 15
    return x


def _row_key(fields: torch.Tensor, salt: int) -> torch.Tensor:
    """Fold the columns of fields [S, C] (int64 in [0, 2^32)) into a 32-bit key per row."""
    key = _mix32(fields[:, 0] ^ salt)
    for j in range(1, fields.shape[1]):
        key = _mix32(key ^ fields[:, j])
    return key


def _seeded_log_exponentials(fields: torch.Tensor, vocab: int) -> torch.Tensor:
    """[S, vocab] float32 log E with E ~ Exp(1); row s, token v is a function of v and of
    fields[s] (int64: seed high 32 bits, seed low 32 bits, sample index, output position)
    only."""
    multiplier = (_row_key(fields, 0x5EED) & 0x7FFFFFFF) | 1
    offset = _row_key(fields, 0xC0FFEE)
    token = torch.arange(vocab, device=fields.device, dtype=torch.int64)
    counter = token[None, :] * multiplier[:, None]
    counter += offset[:, None]
    counter &= _MASK32
    # -w for w = (u + 1/2) / 2^32 in (0, 1), kept above -1 so that E = -log1p(-w) is finite.
    neg_w = _mix32(counter).float().mul_(-(2.0**-32)).sub_(2.0**-33).clamp_(min=-_MAX_UNIFORM)
    return neg_w.log1p_().neg_().log_()


def _subtract_rows(scores: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """scores[index] -= values, in place."""
    if index.numel() == scores.shape[0]:
        scores -= values
    else:
        scores.index_add_(0, index, values, alpha=-1)


def _adjusted(raw: torch.Tensor, batch: _Batch, dev: dict[str, torch.Tensor]) -> torch.Tensor:
    """raw with the penalties and min_tokens bans applied (raw itself when there are none)."""
    z = _penalised(raw, batch, dev) if batch.num_penalties else raw
    if batch.num_bans:
        z = z.clone() if z is raw else z
        bans = dev["bans"].long()
        z.index_put_((bans[:, 0], bans[:, 1]), torch.full((), float("-inf"), device=z.device))
    return z


def _filtered(z: torch.Tensor, batch: _Batch, dev: dict[str, torch.Tensor]) -> torch.Tensor:
    """z / temperature with what top-k / top-p / min-p drop at -inf. Greedy rows get
    temperature 1 and no filter, so their argmax is still exactly argmax z."""
    scores = z / dev["temps"].float()[:, None]
    if batch.num_filters:
        threshold = _thresholds(scores, batch, dev)
        scores.masked_fill_(scores < threshold[:, None], float("-inf"))
    return scores


def _draw(
    scores: torch.Tensor,
    batch: _Batch,
    dev: dict[str, torch.Tensor],
    generator: torch.Generator | None,
) -> torch.Tensor:
    """argmax(scores - log E) with E ~ Exp(1) on the sampled rows (none on greedy rows)."""
    num_rows, vocab = scores.shape
    if batch.num_unseeded:
        noise = torch.empty(batch.num_unseeded, vocab, dtype=scores.dtype, device=scores.device)
        noise.exponential_(generator=generator).clamp_(min=torch.finfo(scores.dtype).tiny)
        _subtract_rows(scores, dev["unseeded"].long(), noise.log_())
    if batch.num_seeded:
        spec = dev["seeded"].long()
        _subtract_rows(scores, spec[:, 0], _seeded_log_exponentials(spec[:, 1:], vocab))
    return scores.argmax(-1)


class Sampler:
    """Turns a step's logits into one token per row, with logprobs; holds no state."""

    def __call__(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        generator: torch.Generator | None,
        logits_rows: list[int] | None = None,
    ) -> SamplerOutput:
        """logits [K, V] (any float dtype); row i samples from logits row logits_rows[i]
        (row i when None, and then K must be len(rows)). `generator`, on the logits'
        device, supplies the noise of unseeded rows (None: torch's default generator)."""
        return self.launch(logits, rows, generator, logits_rows).result()

    def launch(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        generator: torch.Generator | None,
        logits_rows: list[int] | None = None,
    ) -> PendingSample:
        """Queue the sampling work on the device and the copy of its results to the host;
        `result()` waits for them. Arguments as for calling the sampler."""
        if logits_rows is None and logits.shape[0] != len(rows):
            raise ValueError(
                f"{len(rows)} sampling rows for {logits.shape[0]} rows of logits; pass "
                "logits_rows to say which logits row each sampling row reads"
            )
        if logits_rows is not None and len(logits_rows) != len(rows):
            raise ValueError(
                f"logits_rows names {len(logits_rows)} rows but {len(rows)} rows are sampled; "
                "give one logits row per sampling row"
            )
        if not rows:
            return PendingSample(None, None, None, None)
        batch = _Batch(rows, logits.shape[1], logits.shape[0], logits_rows)
        dev = batch.upload(logits.device)
        raw = logits.index_select(0, dev["rows"].long()) if batch.gather else logits
        raw = raw.float().contiguous()
        if batch.plain and HAS_TRITON and (raw.is_cuda or interpret_mode()):
            # Two launches for the common rows (kernels/sampling.py), the same noise drawn.
            temps = noise = None
            if batch.sampled:
                temps = dev["temps"]
                noise = torch.empty_like(raw).exponential_(generator=generator)
            chosen, packed = draw_triton(raw, temps, noise)
            return PendingSample(packed, batch, chosen, logits.device)
        z = _adjusted(raw, batch, dev)
        if batch.sampled:
            chosen = _draw(_filtered(z, batch, dev), batch, dev, generator)
        else:
            chosen = z.argmax(-1)
        return PendingSample(_results(raw, chosen, batch, dev), batch, chosen, logits.device)


def _results(
    raw: torch.Tensor, chosen: torch.Tensor, batch: _Batch, dev: dict[str, torch.Tensor]
) -> torch.Tensor:
    """Sampled ids, logprobs, ranks and top alternatives, packed in one float64 tensor."""
    logprobs = raw.log_softmax(-1)
    chosen_lp = logprobs.gather(1, chosen[:, None]).squeeze(1)
    pieces = [chosen.double(), chosen_lp.double()]
    max_k = max(batch.lp_counts, default=0)
    if batch.lp_rows:
        index = dev["lp_rows"].long()
        x = _rows(logprobs, index)
        ranks = (x > _rows(chosen_lp, index)[:, None]).sum(-1, dtype=torch.int32) + 1
        pieces.append(ranks.double())
        if max_k:
            top = x.topk(max_k, dim=-1)
            pieces += [top.indices.double().flatten(), top.values.double().flatten()]
    return torch.cat(pieces)


class PendingSample:
    """A launched sampling pass whose results are on their way to the host.

    `token_ids` [rows] int64 on the device: the sampled ids, which a step launched before
    these results are read takes its input tokens from.
    """

    def __init__(
        self,
        packed: torch.Tensor | None,
        batch: _Batch | None,
        token_ids: torch.Tensor | None,
        device,
    ) -> None:
        self._batch = batch
        self.token_ids = token_ids
        self._event = None
        self._host = packed
        if packed is not None and packed.is_cuda:
            self._host = packed.to("cpu", non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(device))

    def result(self) -> SamplerOutput:
        """Wait for the results (one device-to-host copy) and unpack them."""
        batch = self._batch
        if batch is None:
            return SamplerOutput([], [], [], [], [])
        if self._event is not None:
            self._event.synchronize()
        host = self._host.tolist()
        num_rows = batch.num_rows
        token_ids = [int(t) for t in host[:num_rows]]
        chosen_logprobs = host[num_rows : 2 * num_rows]
        ranks_out: list[int | None] = [None] * num_rows
        top_ids: list[list[int]] = [[] for _ in range(num_rows)]
        top_logprobs: list[list[float]] = [[] for _ in range(num_rows)]
        num_lp, max_k = len(batch.lp_rows), max(batch.lp_counts, default=0)
        ranks_at = 2 * num_rows
        ids_at = ranks_at + num_lp
        lps_at = ids_at + num_lp * max_k
        for j, (i, k) in enumerate(zip(batch.lp_rows, batch.lp_counts)):
            ranks_out[i] = int(host[ranks_at + j])
            start = j * max_k
            top_ids[i] = [int(t) for t in host[ids_at + start : ids_at + start + k]]
            top_logprobs[i] = host[lps_at + start : lps_at + start + k]
        return SamplerOutput(token_ids, chosen_logprobs, ranks_out, top_ids, top_logprobs)
