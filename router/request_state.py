"""The router's request state machine (DESIGN §4): its states and allowed transitions.

One sequence's life; :class:`router.lifecycle.RequestLifecycle` drives it.

States and transitions (``_ALLOWED``)::

    QUEUED ──> PREFILLING ──> DECODING ──> FINISHED
      ^            │              │
      └────────────┤              v
                   │          MIGRATING ──> PREFILLING ...
                   v
    any non-terminal state ──> ABORTED | FAILED

* **QUEUED / MIGRATING -> PREFILLING**: a decode worker D (ranked by :func:`router.policy.rank_decode`)
  accepts a ``Decode`` stream and reserves KV blocks; its first event is ``Accepted{transfer_id,
  kv_endpoint}``. In MIGRATING the "prompt" is prompt + tokens generated so far, with
  ``num_output_tokens`` telling the worker how many trailing tokens are output (penalties, seeds).
* **PREFILLING -> DECODING**: disaggregated: a prefill worker P (ranked by
  :class:`router.policy.PrefillPolicy`) runs ``Prefill`` with D as the KV target and returns token 1,
  which is emitted at once (TTFT). Unified (``--mode unified``, or no prefill worker is up): D
  prefills locally and its first ``Tokens`` event carries token 1.
* **DECODING**: D's ``Tokens`` events are emitted in order until ``Finished`` (-> FINISHED).
  ``Preempted`` (D ran out of KV), an ``ErrorEvent`` or a broken stream -> MIGRATING: the sequence
  is re-prefilled on a decode worker again and the caller's token stream continues unbroken.
* A failed or timed-out Prefill releases D's reservation and goes back to QUEUED (MIGRATING when
  tokens exist) to try another P: at most ``max_prefill_attempts`` failures in all.
* **ABORTED**: the consumer closed the token stream (stop string, client disconnect) or the
  deadline passed; **FAILED**: a non-retryable error or the retry budgets ran out. Both send one
  idempotent ``Abort`` to every worker that holds state for the sequence.

Worker-facing request ids are ``<request_id>`` for the first placement and ``<request_id>~<k>``
for the k-th re-placement, so a late Abort for an old attempt never hits a newer one.

Usage: iterate :meth:`RequestLifecycle.run` (an async generator of ``SampledToken``); when it ends,
``finish_reason`` is "stop" or "length". Closing the generator early (``aclose()`` or task
cancellation) aborts the sequence.
"""

from __future__ import annotations

import enum


class RequestState(str, enum.Enum):
    """Router-side state of one sequence (DESIGN §4)."""

    QUEUED = "queued"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    MIGRATING = "migrating"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


S = RequestState
TERMINAL = frozenset({S.FINISHED, S.ABORTED, S.FAILED})
_ALLOWED: dict[RequestState, frozenset[RequestState]] = {
    S.QUEUED: frozenset({S.PREFILLING, S.ABORTED, S.FAILED}),
    S.PREFILLING: frozenset({S.DECODING, S.QUEUED, S.MIGRATING, S.ABORTED, S.FAILED}),
    S.DECODING: frozenset({S.MIGRATING, S.FINISHED, S.ABORTED, S.FAILED}),
    S.MIGRATING: frozenset({S.PREFILLING, S.FINISHED, S.ABORTED, S.FAILED}),
    S.FINISHED: frozenset(),
    S.ABORTED: frozenset(),
    S.FAILED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A transition not in the state machine; always a router bug."""


def check_transition(old: RequestState, new: RequestState, request_id: str) -> None:
    """Raise IllegalTransition unless ``old -> new`` is allowed (``old is new`` is a no-op)."""
    if new is not old and new not in _ALLOWED[old]:
        raise IllegalTransition(f"{request_id}: {old.name} -> {new.name}")
