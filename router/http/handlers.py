"""What the OpenAI endpoints' handlers share: the model check and sampling-parameter errors.

The handlers themselves live one per endpoint: :mod:`router.http.chat` (``/v1/chat/completions``)
and :mod:`router.http.completions` (``/v1/completions``). Each checks the model name and
sampling, prepares the prompt(s) through the router's shared
:class:`~router.prompts.PromptPreparer` (off the event loop), submits one request stream per
prompt and answers with one JSON body or a Server-Sent Events stream. Streams send one ``data:``
chunk per output token (its text may be "" while a stop string is pending), ``finish_reason``
null until the sequence's last chunk, then ``data: [DONE]``; ``stream_options.include_usage``
adds ``"usage": null`` to every chunk and one final chunk with empty ``choices`` and the usage.
"""

from __future__ import annotations

from collections.abc import Callable

from pdserve.sampling_params import SamplingError, SamplingParams
from router.errors import BadRequest, ModelNotFound
from router.serving import Router


def check_model(router: Router, model: str | None) -> None:
    """Raise ModelNotFound (404) when ``model`` is set and is not the served model."""
    if model and model != router.model_name:
        raise ModelNotFound(
            f"the model '{model}' does not exist; this server serves '{router.model_name}'",
            param="model",
        )


def sampling_params(build: Callable[[], SamplingParams]) -> SamplingParams:
    """``build()``, with a SamplingError turned into BadRequest naming the field."""
    try:
        return build()
    except SamplingError as e:
        raise BadRequest(str(e), param=e.field) from None
