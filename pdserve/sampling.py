"""Batched token sampling (DESIGN §6): penalties, truncation, seeded generators, logprobs.

Per step, for logits ``[num_seqs, vocab]``, each row goes through, in order:

1. raw log-probabilities ``log_softmax(logits)`` for rows that asked for logprobs (reported values
   are of the model's own distribution, before any of what follows);
2. repetition penalty over prompt + generated tokens (Keskar et al. 2019, "CTRL", §4.1, in the
   form transformers uses: a positive logit is divided by the penalty, a negative one multiplied);
3. frequency and presence penalties over generated tokens (OpenAI API reference:
   ``logit -= count * frequency_penalty + (count > 0) * presence_penalty``);
4. ``logit_bias`` added (OpenAI), tokens outside ``allowed_token_ids`` masked (vLLM);
5. ``min_tokens``: EOS and ``stop_token_ids`` masked to -inf until that many tokens were
   generated (``ignore_eos`` masks nothing; the engine stops on EOS unless it is set), except in
   a row where that would leave no token (``allowed_token_ids`` holding only such ids): there
   ``allowed_token_ids`` wins and the row is left as it is;
6. the structured-output grammar's token bitmask applied (tokens the grammar forbids masked).
   The grammar wins over ``min_tokens``: if the two leave nothing, the grammar's tokens are kept;
   a grammar state that errored allows only EOS, so the sequence ends instead of running on
   (:mod:`pdserve.sampling_masks`);
7. greedy rows (temperature 0, or top_k 1): argmax, done;
8. the rest: divide by temperature, then top-k (Fan et al. 2018), top-p / nucleus (Holtzman et al.
   2019: the smallest set of most likely tokens whose probability reaches top_p), min-p (Nguyen
   et al. 2024: drop tokens whose probability is below min_p times the top token's), in the order
   transformers applies them; then sample from the softmax.

Sampling uses the exponential race (the Gumbel-max trick: Gumbel 1954; Maddison et al. 2014, "A*
Sampling"): ``argmax(log p + g)`` with ``g = -log(q)``, ``q ~ Exp(1)`` i.i.d., picks token i with
probability ``p_i``, with no per-row multinomial call. It runs in two levels: the vocabulary is cut
into blocks of ``RACE_BLOCK`` tokens, one race over the blocks' total masses (a logsumexp per block)
picks a block, and a second race inside that block picks the token. That is exact (token i wins
with probability ``P(block) * p_i / P(block)``) and draws ``vocab / RACE_BLOCK + RACE_BLOCK``
noise values per row instead of ``vocab``: the whole sampler takes 1.6 ms instead of 8.8 ms for
16 rows of 49152 bf16 logits on one core (``bench/sampler.py``).

The race is robust to rounding: logits that differ in the last bf16 bit (a different batch shape
can make the matmul accumulate in another order) change the sampled token only when the two best
keys nearly tie. With 10% of a 49k-token row moved by one bf16 ulp, 0.4-1.2% of seeded tokens
changed with the two-level race and 0.3-1.1% with a one-level race over the whole row (three
simulations of 4000 rows), where inverse-CDF sampling, whose every boundary moves with the sum of
all earlier tokens' errors, changed 26%. The noise of a seeded request comes from its own
``torch.Generator`` seeded by a hash of (seed, position = len(output_token_ids)) and is drawn on
the CPU, so the noise depends neither on batch companions nor on which worker (or device) ran the
step; unseeded rows share one sampler-wide generator on the logits' device.

NOTE: after sampling, ``__call__`` advances each row's grammar matcher over the sampled token, so
every caller (prefill token 1, decode steps, offline) keeps grammar state the same way.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from itertools import chain

import torch

from pdserve.engine.batch import ScheduledSeq
from pdserve.sampling_cpu import cpu_argmax, cpu_race, kernel_can_read
from pdserve.sampling_masks import apply_bias_and_allowed, apply_grammar
from pdserve.sampling_params import SamplingError, SamplingParams
from pdserve.structured.spec import StructuredOutputError
from pdserve.types import SampledToken

# Temperatures below this are treated as 0 (greedy): dividing logits by them would overflow.
GREEDY_TEMPERATURE = 1e-5
_MASK64 = (1 << 64) - 1
# Best tokens examined for top-p before falling back to sorting the whole row (speed only).
TOP_P_CANDIDATES = 512
# Tokens per block of the two-level race (speed only; the distribution is exact for any value,
# but the tokens a given seed draws depend on it).
RACE_BLOCK = 256


def _is_greedy(p: SamplingParams) -> bool:
    return p.temperature < GREEDY_TEMPERATURE or p.top_k == 1


def _modifies_logits(s: ScheduledSeq) -> bool:
    """Whether a penalty, a mask or a bias changes this row's logits this step."""
    p = s.sampling
    return (
        p.repetition_penalty != 1.0
        or p.frequency_penalty != 0
        or p.presence_penalty != 0
        or len(s.output_token_ids) < p.min_tokens
        or bool(p.logit_bias)
        or p.allowed_token_ids is not None
        or s.grammar is not None
    )


def _expect(tokens: torch.Tensor | None) -> torch.Tensor:
    """A kernel result the caller made sure it can compute (:func:`kernel_can_read`)."""
    if tokens is None:
        raise RuntimeError("the CPU sampling kernel refused logits it said it could read")
    return tokens


# Columns per block of the two-level argmax (speed only; any value gives the same indices).
ARGMAX_BLOCK = 256


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for a 2-D tensor [rows, cols] -> int64 [rows], the same indices
    (the first maximal one; NaN counts as maximal, as in torch), computed in two levels.

    torch's CPU argmax over a long row runs at ~1 element/ns (0.65 ms for 16 x 49152 fp32 on this
    project's EPYC) while ``amax`` is vectorised ~20x faster; so take the max of each
    ``ARGMAX_BLOCK``-column block, argmax over those block maxima (the first block holding the
    row's max), then argmax inside that one block: ~8x faster end to end. Columns past the last
    whole block are compared separately.
    """
    rows, cols = x.shape
    nb = cols // ARGMAX_BLOCK
    if nb < 2 or x.device.type != "cpu":
        return x.argmax(dim=-1)
    head = x[:, : nb * ARGMAX_BLOCK].reshape(rows, nb, ARGMAX_BLOCK)
    block = head.amax(dim=-1).argmax(dim=-1)  # [rows]
    best = head[torch.arange(rows, device=x.device), block]  # [rows, ARGMAX_BLOCK]
    idx = block * ARGMAX_BLOCK + best.argmax(dim=-1)
    if nb * ARGMAX_BLOCK == cols:
        return idx
    tail_idx = x[:, nb * ARGMAX_BLOCK :].argmax(dim=-1) + nb * ARGMAX_BLOCK
    head_val = x.gather(1, idx[:, None]).squeeze(1)
    tail_val = x.gather(1, tail_idx[:, None]).squeeze(1)
    take_tail = (tail_val > head_val) | (tail_val.isnan() & ~head_val.isnan())
    return torch.where(take_tail, tail_idx, idx)


def position_seed(seed: int, position: int) -> int:
    """Generator seed for output token ``position`` (0-based) of a request seeded with ``seed``.

    SplitMix64 finaliser (Steele et al. 2014) over seed and position: deterministic across
    processes and platforms (no Python ``hash``); result in [0, 2^63).
    """
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class Sampler:
    """Samples one token per row of a logits batch; see the module docstring for the pipeline.

    ``vocab_size``: number of real token ids; extra logit columns (a padded embedding) are
    ignored. ``eos_token_ids``: masked while ``min_tokens`` is not reached. ``seed``: seed of the
    generator shared by unseeded rows (None = random per sampler).

    NOTE: a request with ``n > 1`` is several sequences to the sampler; if they share one seed
    they draw the same tokens, so the engine should give each its own (e.g. seed + index).
    """

    def __init__(
        self, vocab_size: int, eos_token_ids: Sequence[int] = (), seed: int | None = None
    ) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        bad = [i for i in eos_token_ids if not 0 <= i < vocab_size]
        if bad:
            raise ValueError(f"eos_token_ids {bad} outside the vocabulary [0, {vocab_size})")
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._seed = seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self._generators: dict[torch.device, torch.Generator] = {}

    def check(self, params: SamplingParams) -> None:
        """Reject params that only make sense against this vocabulary. Raises SamplingError
        naming the field (and, for ``logit_bias``, the key)."""
        bad = [i for i in params.stop_token_ids if not 0 <= i < self.vocab_size]
        if bad:
            raise SamplingError(
                "stop_token_ids", f"'stop_token_ids' {bad} outside [0, {self.vocab_size})"
            )
        for t, _ in params.logit_bias:
            if not 0 <= t < self.vocab_size:
                raise SamplingError(
                    "logit_bias",
                    f"'logit_bias' key '{t}' is not a token id of this model's vocabulary "
                    f"[0, {self.vocab_size})",
                )
        bad = [i for i in params.allowed_token_ids or () if not 0 <= i < self.vocab_size]
        if bad:
            raise SamplingError(
                "allowed_token_ids",
                f"'allowed_token_ids' {bad[:8]} outside the vocabulary [0, {self.vocab_size})",
            )

    def __call__(self, logits: torch.Tensor, seqs: Sequence[ScheduledSeq]) -> list[SampledToken]:
        """One token per row. ``logits``: [len(seqs), >= vocab_size], any float dtype/device.

        Raises ValueError when the shapes disagree or a sequence holds a token id outside the
        vocabulary.
        """
        n = len(seqs)
        if n == 0:
            self._check_shape(logits, 0)
            return []
        params = [s.sampling for s in seqs]
        lp_rows = [i for i, p in enumerate(params) if p.logprobs or p.top_logprobs > 0]
        greedy = [_is_greedy(p) for p in params]
        tokens = self._kernel_tokens(logits, seqs, greedy) if not lp_rows else None
        raw_logprobs = None
        if tokens is None:
            logits = self._check_shape(logits, n)
            if lp_rows:
                raw_logprobs = torch.log_softmax(logits[lp_rows], dim=-1)
            tokens = self._torch_tokens(logits, seqs, greedy)

        out = self._results(tokens, raw_logprobs, lp_rows, params)
        for s, t in zip(seqs, out, strict=True):
            if s.grammar is not None and not s.grammar.error:
                try:
                    s.grammar.advance([t.token_id])
                except StructuredOutputError:
                    pass  # the matcher is now in its error state: the next step allows only EOS
        return out

    def _kernel_tokens(
        self, logits: torch.Tensor, seqs: Sequence[ScheduledSeq], greedy: list[bool]
    ) -> torch.Tensor | None:
        """Tokens [n] int64 from the C kernel (:mod:`pdserve.sampling_cpu`), reading ``logits``
        in place, for a batch whose rows need neither logprobs nor any processing or truncation
        (greedy, or plain temperature sampling); None when that does not hold or the kernel
        cannot read ``logits``. The draws are the torch path's (the same noise, same race) up
        to rounding in the block keys."""
        self._check_shape(logits, len(seqs), convert=False)
        for s, g in zip(seqs, greedy, strict=True):
            p = s.sampling
            if _modifies_logits(s) or not (
                g or (p.top_p >= 1.0 and p.min_p <= 0 and not 0 < p.top_k < self.vocab_size)
            ):
                return None
        if not kernel_can_read(logits, self.vocab_size):
            return None
        n, vocab = len(seqs), self.vocab_size
        g_rows = [i for i in range(n) if greedy[i]]
        s_rows = [i for i in range(n) if not greedy[i]]
        tokens = torch.empty(n, dtype=torch.int64)
        if g_rows:
            sub = logits if len(g_rows) == n else logits[g_rows]
            tokens[g_rows] = _expect(cpu_argmax(sub, vocab))
        if s_rows:
            s_seqs = [seqs[i] for i in s_rows]
            sub = logits if len(s_rows) == n else logits[s_rows]
            nb = -(-vocab // RACE_BLOCK)
            noise = self._gumbel(s_seqs, nb + RACE_BLOCK, logits.device)
            temps = [s.sampling.temperature for s in s_seqs]
            tokens[s_rows] = _expect(cpu_race(sub, vocab, temps, noise, RACE_BLOCK))
        return tokens

    def _torch_tokens(
        self, logits: torch.Tensor, seqs: Sequence[ScheduledSeq], greedy: list[bool]
    ) -> torch.Tensor:
        """Tokens [n] int64 by the torch path: ``logits`` fp32 [n, vocab] (unprocessed)."""
        n = len(seqs)
        x = self._processed(logits, seqs)
        if all(greedy):
            tokens = row_argmax(x)
        else:
            tokens = torch.empty(n, dtype=torch.long, device=x.device)
            g_rows = [i for i in range(n) if greedy[i]]
            s_rows = [i for i in range(n) if not greedy[i]]
            if g_rows:
                tokens[g_rows] = row_argmax(x[g_rows])
            s_seqs = [seqs[i] for i in s_rows]
            sub = x if len(s_rows) == n else x[s_rows]
            x_s = self._truncated_logits(sub, [p.sampling for p in s_seqs])
            tokens[s_rows] = self._race(x_s, s_seqs)
        return tokens

    def processed_logits(self, logits: torch.Tensor, seqs: Sequence[ScheduledSeq]) -> torch.Tensor:
        """Logits after penalties and the ``min_tokens`` mask, before temperature: [n, vocab] fp32,
        a new tensor (never ``logits`` itself). Raises ValueError as ``__call__``.
        """
        raw = self._check_shape(logits, len(seqs))
        x = self._processed(raw, seqs)
        return x.clone() if x is raw else x

    def distribution(self, logits: torch.Tensor, seqs: Sequence[ScheduledSeq]) -> torch.Tensor:
        """The probabilities each row's token is drawn from: [n, vocab] fp32, rows sum to 1.

        Greedy rows are one-hot at the argmax. Raises ValueError as ``__call__``.
        """
        x = self.processed_logits(logits, seqs)
        out = torch.zeros_like(x)
        for i, s in enumerate(seqs):
            if _is_greedy(s.sampling):
                out[i, x[i].argmax()] = 1.0
            else:
                out[i] = self._truncated_logits(x[i : i + 1], [s.sampling])[0].softmax(dim=-1)
        return out

    def _check_shape(self, logits: torch.Tensor, n: int, convert: bool = True) -> torch.Tensor:
        """``logits`` [n, >= vocab] -> float32 [n, vocab] (padding columns dropped); with
        ``convert=False`` only checked and returned as they are. Raises ValueError."""
        if logits.dim() != 2 or logits.shape[0] != n or logits.shape[1] < self.vocab_size:
            raise ValueError(
                f"logits shape {tuple(logits.shape)} does not fit {n} sequences x vocab "
                f"{self.vocab_size}"
            )
        return logits[:, : self.vocab_size].float() if convert else logits

    def _processed(self, logits: torch.Tensor, seqs: Sequence[ScheduledSeq]) -> torch.Tensor:
        """Penalties and the min_tokens mask applied to a copy of ``logits`` [n, vocab]; when no
        row has any, ``logits`` itself (no copy of a [n, vocab] tensor)."""
        if not any(_modifies_logits(s) for s in seqs):
            return logits
        x = logits.clone()  # the caller's logits stay raw (they give the reported logprobs)
        self._apply_penalties(x, seqs)
        apply_bias_and_allowed(x, seqs, self.vocab_size, self.check)
        self._apply_min_tokens(x, seqs)
        apply_grammar(x, logits, seqs, self.vocab_size, self.eos_token_ids)
        return x

    # -- penalties ---------------------------------------------------------------------------

    def _token_index(
        self,
        rows: list[int],
        id_lists: Sequence[Sequence[int]],
        seqs: Sequence[ScheduledSeq],
        dev: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(row index, token id) pairs, flattened, for ``id_lists[j]`` belonging to row ``j``."""
        lengths = torch.tensor([len(ids) for ids in id_lists], dtype=torch.long)
        row_idx = torch.repeat_interleave(torch.arange(len(rows)), lengths)
        tok_idx = torch.tensor(list(chain.from_iterable(id_lists)), dtype=torch.long)
        if tok_idx.numel() and (tok_idx.min() < 0 or tok_idx.max() >= self.vocab_size):
            for j, ids in enumerate(id_lists):
                if any(not 0 <= t < self.vocab_size for t in ids):
                    raise ValueError(
                        f"request {seqs[rows[j]].request_id}: token id outside the vocabulary "
                        f"[0, {self.vocab_size}) in its prompt/output"
                    )
        return row_idx.to(dev), tok_idx.to(dev)

    def _apply_penalties(self, x: torch.Tensor, seqs: Sequence[ScheduledSeq]) -> None:
        """In place on ``x`` [n, vocab]: repetition, then frequency and presence penalties.

        Works on the (row, token) pairs that occurred only, never on dense [n, vocab] masks.
        NOTE: ``x[r, t] = f(x[r, t])`` with repeated pairs writes the same value several times, so
        it applies ``f`` once per distinct token (set semantics); ``index_put_(accumulate=True)``
        applies once per occurrence (count semantics).
        """
        dev = x.device
        rep = [i for i, s in enumerate(seqs) if s.sampling.repetition_penalty != 1.0]
        if rep:
            ids = [list(chain(seqs[i].prompt_token_ids, seqs[i].output_token_ids)) for i in rep]
            r, t = self._token_index(rep, ids, seqs, dev)
            pen = torch.tensor([seqs[i].sampling.repetition_penalty for i in rep], device=dev)
            rows = torch.tensor(rep, device=dev)[r]
            vals = x[rows, t]
            x[rows, t] = torch.where(vals > 0, vals / pen[r], vals * pen[r])
        fp = [
            i
            for i, s in enumerate(seqs)
            if s.sampling.frequency_penalty != 0 or s.sampling.presence_penalty != 0
        ]
        if fp:
            r, t = self._token_index(fp, [seqs[i].output_token_ids for i in fp], seqs, dev)
            freq = torch.tensor([seqs[i].sampling.frequency_penalty for i in fp], device=dev)
            pres = torch.tensor([seqs[i].sampling.presence_penalty for i in fp], device=dev)
            rows = torch.tensor(fp, device=dev)[r]
            x.index_put_((rows, t), -freq[r], accumulate=True)  # count * frequency_penalty
            x[rows, t] = x[rows, t] - pres[r]  # presence_penalty once per distinct token

    def _apply_min_tokens(self, x: torch.Tensor, seqs: Sequence[ScheduledSeq]) -> None:
        """In place: mask EOS and stop_token_ids of rows still short of ``min_tokens``, unless
        they are the only tokens the row has left (``allowed_token_ids`` holding only them)."""
        for i, s in enumerate(seqs):
            if len(s.output_token_ids) < s.sampling.min_tokens:
                ids = sorted(set(self.eos_token_ids) | set(s.sampling.stop_token_ids))
                if any(not 0 <= t < self.vocab_size for t in ids):
                    raise ValueError(
                        f"request {s.request_id}: stop_token_ids outside [0, {self.vocab_size})"
                    )
                if not ids:
                    continue
                alive = ~torch.isneginf(x[i])
                if int(alive.sum()) == int(alive[ids].sum()):
                    continue  # masking them would leave nothing: the earlier masks win
                x[i, ids] = float("-inf")

    # -- random sampling ---------------------------------------------------------------------

    def _truncated_logits(self, x: torch.Tensor, ps: Sequence[SamplingParams]) -> torch.Tensor:
        """Logits [rows, vocab] after temperature, top-k, top-p and min-p (dropped tokens -inf);
        their softmax is the distribution a row's token is drawn from.

        ``x``: processed logits [rows, vocab] of non-greedy rows; ``ps``: their params.
        """
        dev = x.device
        if any(p.temperature != 1.0 for p in ps):
            x = x / torch.tensor([p.temperature for p in ps], device=dev).unsqueeze(1)

        top_k = [p.top_k if 0 < p.top_k < self.vocab_size else 0 for p in ps]
        if any(top_k):
            # NOTE: ties with the k-th logit are kept (as transformers' top-k does).
            k_max = max(top_k)
            k = torch.tensor([kk if kk else k_max for kk in top_k], device=dev).unsqueeze(1)
            kth = x.topk(k_max, dim=-1).values.gather(1, k - 1)  # [rows, 1]
            no_k = torch.tensor([kk == 0 for kk in top_k], device=dev).unsqueeze(1)
            x = x.masked_fill((x < kth) & ~no_k, float("-inf"))

        if any(p.top_p < 1.0 for p in ps):
            x = self._top_p(x, [p.top_p for p in ps])

        if any(p.min_p > 0 for p in ps):
            # p_i >= min_p * p_max  <=>  x_i >= x_max + log(min_p): no softmax needed
            log_min_p = torch.tensor([p.min_p for p in ps], device=dev).log().unsqueeze(1)
            floor = x.max(dim=-1, keepdim=True).values + log_min_p  # -inf where min_p == 0
            x = x.masked_fill(x < floor, float("-inf"))

        return x

    def _top_p(self, x: torch.Tensor, top_ps: Sequence[float]) -> torch.Tensor:
        """Nucleus truncation of logits ``x`` [rows, vocab]; a top_p of 1 leaves its row alone.

        Instead of sorting whole rows (tens of ms for a batch of 50k-token rows on a CPU), take
        the ``TOP_P_CANDIDATES`` best tokens; a row whose candidates already hold top_p of the
        probability mass has its nucleus among them. Other rows fall back to a full sort.
        """
        dev = x.device
        top_p = torch.tensor([p if p < 1.0 else 2.0 for p in top_ps], device=dev).unsqueeze(1)
        k0 = min(TOP_P_CANDIDATES, x.shape[1])
        vals, idx = x.topk(k0, dim=-1)  # [rows, k0], best first
        probs = (vals - torch.logsumexp(x, dim=-1, keepdim=True)).exp()  # of the whole row
        drop = probs.cumsum(dim=-1) - probs >= top_p  # mass of strictly better tokens
        drop[:, 0] = False  # the most likely token always stays
        out = torch.full_like(x, float("-inf")).scatter_(1, idx, vals.masked_fill(drop, -math.inf))
        off = top_p.squeeze(1) > 1.0
        out[off] = x[off]
        uncovered = ((probs.sum(dim=-1) < top_p.squeeze(1)) & ~off).nonzero().flatten().tolist()
        if uncovered:
            sub = x[uncovered]
            sorted_x, order = sub.sort(dim=-1, descending=True)
            sp = sorted_x.softmax(dim=-1)
            drop = sp.cumsum(dim=-1) - sp >= top_p[uncovered]
            drop[:, 0] = False
            sorted_x = sorted_x.masked_fill(drop, float("-inf"))
            out[uncovered] = torch.empty_like(sub).scatter_(1, order, sorted_x)
        return out

    def _race(self, x: torch.Tensor, seqs: Sequence[ScheduledSeq]) -> torch.Tensor:
        """Two-level exponential race (module docstring) over truncated logits ``x`` [rows, vocab]
        -> token ids int64 [rows]. Every row needs at least one finite logit.
        """
        rows, vocab = x.shape
        nb = -(-vocab // RACE_BLOCK)
        if nb * RACE_BLOCK != vocab:
            x = torch.nn.functional.pad(x, (0, nb * RACE_BLOCK - vocab), value=-math.inf)
        xb = x.reshape(rows, nb, RACE_BLOCK)
        g = self._gumbel(seqs, nb + RACE_BLOCK, x.device)  # [rows, nb + RACE_BLOCK]
        block = (torch.logsumexp(xb, dim=-1) + g[:, :nb]).argmax(dim=-1)  # [rows]
        inner = xb[torch.arange(rows, device=x.device), block]  # [rows, RACE_BLOCK]
        return block * RACE_BLOCK + (inner + g[:, nb:]).argmax(dim=-1)

    def _gumbel(self, seqs: Sequence[ScheduledSeq], cols: int, dev: torch.device) -> torch.Tensor:
        """Gumbel(0, 1) noise [rows, cols] fp32, ``-log(q)`` with ``q = -log(1 - u) ~ Exp(1)``.

        ``u`` is drawn in float64: a float32 ``u`` is 0 with probability 2^-24 per draw, which
        makes that token's noise infinite, so a whole-row race over 49k tokens picked a uniformly
        random token in 0.3% of its draws; in float64 that chance is 2^-53. A seeded row's noise
        comes from a CPU generator seeded by (seed, position), the same on every device and in
        every batch; unseeded rows share the sampler's generator.
        """
        f64 = torch.float64
        unseeded = [i for i, s in enumerate(seqs) if s.sampling.seed is None]
        u = torch.empty(0, dtype=f64, device=dev)
        if unseeded:
            gen = self._generators.get(dev)
            if gen is None:
                gen = torch.Generator(device=dev)
                gen.manual_seed(self._seed)
                self._generators[dev] = gen
            u = torch.rand(len(unseeded), cols, generator=gen, dtype=f64, device=dev)
        if len(unseeded) < len(seqs):  # seeded rows: each its own generator
            rows = u
            u = torch.empty(len(seqs), cols, dtype=f64, device=dev)
            if unseeded:
                u[unseeded] = rows
            for i, s in enumerate(seqs):
                seed = s.sampling.seed
                if seed is not None:
                    gen = torch.Generator()  # CPU, so the draw is the same on every device
                    gen.manual_seed(position_seed(seed, len(s.output_token_ids)))
                    u[i] = torch.rand(cols, generator=gen, dtype=f64).to(dev)
        q = u.neg_().log1p_().neg_()
        # q == 0 (u == 0, chance 2^-53) would give +inf noise, and -inf + inf = NaN for a
        # truncated token; clamped, a -inf logit stays -inf.
        return q.clamp_min_(torch.finfo(q.dtype).tiny).log_().neg_().float()

    # -- results -----------------------------------------------------------------------------

    def _results(
        self,
        tokens: torch.Tensor,
        raw_logprobs: torch.Tensor | None,
        lp_rows: list[int],
        params: list[SamplingParams],
    ) -> list[SampledToken]:
        ids = tokens.tolist()
        out = [SampledToken(token_id=t) for t in ids]
        if raw_logprobs is None:
            return out
        k_max = max(params[i].top_logprobs for i in lp_rows)
        chosen = raw_logprobs.gather(1, tokens[lp_rows].unsqueeze(1)).squeeze(1).tolist()
        top_vals_l: list[list[float]] = []
        top_ids_l: list[list[int]] = []
        if k_max:
            top_vals, top_ids = raw_logprobs.topk(k_max, dim=-1)
            top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
        for j, i in enumerate(lp_rows):
            k = params[i].top_logprobs
            top = tuple(zip(top_ids_l[j][:k], top_vals_l[j][:k], strict=True)) if k else ()
            out[i] = SampledToken(token_id=ids[i], logprob=chosen[j], top_logprobs=top)
        return out
