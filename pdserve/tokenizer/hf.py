"""The Hugging Face tokenizer behind a model, with its chat template and end-of-sequence ids.

``load_tokenizer(model)`` accepts what ``--model`` accepts: ``smollm2`` (the bundled GGUF), a
``.gguf`` file, or a Hugging Face directory (``tokenizer.json`` / ``tokenizer_config.json``,
``config.json`` optional). Nothing is downloaded (``local_files_only``).

Loading from GGUF means transformers converts the GGUF vocabulary and merges into a ``tokenizers``
object, which takes several seconds. Two caches avoid paying that twice:

- in memory, one ``Tokenizer`` per source path per process;
- on disk (``DISK_CACHE_DIR``), the converted tokenizer saved as a Hugging Face directory, keyed by
  the GGUF's absolute path, size, mtime and the transformers version, so a later process (a worker,
  the CLI) loads it in a fraction of a second. A cache that cannot be written is skipped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pdserve import json_text
from pdserve.config import ConfigError
from pdserve.model.gguf_header import read_gguf_metadata
from pdserve.model.resolve import resolve_model

log = logging.getLogger(__name__)

DISK_CACHE_DIR = Path.home() / ".cache" / "pdserve" / "tokenizers"
_CACHE_FORMAT = 1  # bump when what is stored in a disk-cache entry changes
_META_FILE = "pdserve_tokenizer.json"
# GGUF scalars naming tokens that end generation (llama.cpp: end of sequence / turn / message).
_GGUF_EOS_KEYS = (
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class TokenizerError(ValueError):
    """A tokenizer cannot do what was asked (no chat template, malformed messages, ...).

    ``param``: the request field at fault when it is not the messages themselves (e.g.
    ``continue_final_message``, ``chat_template_kwargs``); None means ``messages``.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# Names the chat template receives from render_chat itself; chat_template_kwargs may not set them.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
        "chat_template", "tokenize", "return_dict", "conversation",
    }
)  # fmt: skip


def load_chat_template(value: str) -> str:
    """The chat template named by ``--chat-template``: a file's text, or ``value`` itself when
    it is an inline Jinja template (holds ``{{`` or ``{%``), as vLLM accepts.

    Raises ConfigError when ``value`` is neither a readable file nor a template.
    """
    path = Path(value).expanduser()
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read chat template {path}: {e}") from e
    if "{{" in value or "{%" in value:
        return value
    raise ConfigError(f"--chat-template {value!r} is neither a file nor a Jinja template")


class Tokenizer:
    """A loaded HF tokenizer plus the facts the engine needs about it.

    ``eos_token_ids``: every id that ends generation — the tokenizer's EOS, plus those named by
    ``generation_config.json`` / ``config.json`` (HF directory) or the GGUF's eos/eot/eom keys;
    the tokenizer's own EOS first. ``vocab_size``: number of ids the tokenizer can decode (base
    vocabulary + added tokens); a model's embedding may be padded beyond it. ``bos_token_id``:
    None when the tokenizer has none; ``encode(add_special_tokens=True)`` adds it exactly when
    transformers does.
    """

    def __init__(self, hf: Any, eos_token_ids: Sequence[int], source: str) -> None:
        self.hf = hf
        self.source = source
        self.vocab_size: int = len(hf)
        self.bos_token_id: int | None = hf.bos_token_id
        self.eos_token_ids: tuple[int, ...] = _unique_ids([hf.eos_token_id, *eos_token_ids])

    def __repr__(self) -> str:
        return (
            f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, "
            f"eos_token_ids={self.eos_token_ids})"
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds BOS etc. as the tokenizer config says."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``. No "tokenization space clean-up" (it would alter the model's text)."""
        return str(
            self.hf.decode(
                list(ids),
                skip_special_tokens=skip_special_tokens,
                clean_up_tokenization_spaces=False,
            )
        )

    @property
    def has_chat_template(self) -> bool:
        """True when the tokenizer files or GGUF metadata carry a chat template."""
        return bool(self.hf.chat_template)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text the chat template makes of ``messages`` ([{'role', 'content'}, ...]).

        ``add_generation_prompt``: open the assistant's turn after the last message.
        ``continue_final_message``: leave the last (assistant) message open, so the model
        continues its text rather than starting a new turn (the template's end-of-turn markup
        after it is cut, as transformers does). ``tools``: OpenAI-style tool definitions
        ({'type': 'function', 'function': {...}}) for templates that render them; ``documents``:
        retrieval documents for templates that take them; ``chat_template``: a template used
        instead of the model's; ``chat_template_kwargs``: extra variables for the template.
        An assistant message's ``tool_calls[].function.arguments`` given as a JSON string is
        parsed to an object first (templates index into it).

        Raises TokenizerError when the model has no chat template, a message is malformed, both
        ``add_generation_prompt`` and ``continue_final_message`` are set or the last message is
        not the assistant's with ``continue_final_message``, a ``chat_template_kwargs`` key is
        reserved, or the template itself rejects the conversation (e.g. roles that do not
        alternate); ``param`` names the field at fault.
        """
        template = chat_template or None
        if template is None and not self.has_chat_template:
            raise TokenizerError(
                f"model {self.source} has no chat template; send a plain completion prompt instead"
            )
        msgs = _check_messages(messages)
        if continue_final_message:
            if add_generation_prompt:
                raise TokenizerError(
                    "'continue_final_message' and 'add_generation_prompt' cannot both be true",
                    param="continue_final_message",
                )
            if msgs[-1]["role"] != "assistant":
                raise TokenizerError(
                    "'continue_final_message' needs the last message to be the assistant's, "
                    f"got role {msgs[-1]['role']!r}",
                    param="continue_final_message",
                )
        extra = dict(chat_template_kwargs or {})
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS & extra.keys())
        if reserved:
            raise TokenizerError(
                f"'chat_template_kwargs' may not set {reserved}: they have their own fields",
                param="chat_template_kwargs",
            )
        try:
            text = self.hf.apply_chat_template(
                msgs,
                tools=[dict(t) for t in tools] if tools else None,
                documents=[dict(d) for d in documents] if documents else None,
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **extra,
            )
        except Exception as e:  # jinja2 errors, including the template's raise_exception()
            raise TokenizerError(f"chat template rejected the messages: {e}") from e
        return str(text)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **controls: Any,
    ) -> list[int]:
        """Token ids of ``render_chat(messages, add_generation_prompt, **controls)``.

        The template writes any BOS itself, so the text is encoded without special tokens (as
        transformers does). Raises TokenizerError as ``render_chat``.
        """
        return self.encode(
            self.render_chat(messages, add_generation_prompt, **controls),
            add_special_tokens=False,
        )


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise TokenizerError("'messages' must be a non-empty list of {'role', 'content'} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TokenizerError(f"messages[{i}] must be an object, got {type(m).__name__}")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise TokenizerError(f"messages[{i}] needs a non-empty string 'role'")
        if "content" not in m and not m.get("tool_calls"):
            raise TokenizerError(f"messages[{i}] has no 'content'")
        msg = dict(m)
        if msg.get("tool_calls"):
            msg["tool_calls"] = [_template_tool_call(c) for c in msg["tool_calls"]]
        out.append(msg)
    return out


def _template_tool_call(call: Any) -> Any:
    """A tool call as templates expect it: ``function.arguments`` an object, not JSON text."""
    if not isinstance(call, Mapping):
        return call
    fn = call.get("function")
    if isinstance(fn, Mapping) and isinstance(fn.get("arguments"), str):
        try:
            args = json_text.loads(fn["arguments"])
        except ValueError:
            return dict(call)
        return {**call, "function": {**fn, "arguments": args}}
    return dict(call)


def _unique_ids(ids: Sequence[Any]) -> tuple[int, ...]:
    out: list[int] = []
    for i in ids:
        if isinstance(i, int) and not isinstance(i, bool) and i >= 0 and i not in out:
            out.append(i)
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# Loading


_loaded: dict[str, Tokenizer] = {}
_load_lock = threading.Lock()


def load_tokenizer(model: str, use_disk_cache: bool = True) -> Tokenizer:
    """The tokenizer of ``model`` ('smollm2' | ``.gguf`` file | HF directory), cached per path.

    ``use_disk_cache``: read/write the converted tokenizer of a GGUF under ``DISK_CACHE_DIR``.
    Raises ConfigError when the model is not found or holds no loadable tokenizer.
    """
    path, kind = _locate(model)
    key = str(path)
    with _load_lock:
        tok = _loaded.get(key)
        if tok is None:
            if kind == "gguf":
                tok = _load_gguf(path, use_disk_cache)
            else:
                tok = _load_hf_dir(path)
            _loaded[key] = tok
        return tok


def clear_tokenizer_cache() -> None:
    """Forget the tokenizers loaded in this process (the disk cache is kept)."""
    with _load_lock:
        _loaded.clear()


def _locate(model: str) -> tuple[Path, str]:
    """(absolute path, 'gguf' | 'hf'); also accepts a tokenizer-only directory."""
    p = Path(model).expanduser()
    if p.is_dir() and not (p / "config.json").is_file():
        if any((p / f).is_file() for f in _TOKENIZER_FILES):
            return p.resolve(), "hf"
    resolved = resolve_model(model)
    return resolved.path.resolve(), resolved.kind


def _from_pretrained(directory: Path, **kwargs: Any) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True, **kwargs)
    except Exception as e:  # transformers raises OSError/ValueError/KeyError variously
        what = kwargs.get("gguf_file") or directory
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"cannot load a tokenizer from {what}: {msg}") from e


def _load_hf_dir(directory: Path) -> Tokenizer:
    hf = _from_pretrained(directory)
    extra: list[Any] = []
    for name in ("generation_config.json", "config.json"):
        f = directory / name
        if f.is_file():
            try:
                eos = json.loads(f.read_text()).get("eos_token_id")
            except (OSError, ValueError) as e:
                raise ConfigError(f"cannot read {f}: {e}") from e
            extra.extend(eos if isinstance(eos, list) else [eos])
    return Tokenizer(hf, _unique_ids(extra), str(directory))


def _load_gguf(path: Path, use_disk_cache: bool) -> Tokenizer:
    entry = _disk_entry(path) if use_disk_cache else None
    if entry is not None and (entry / _META_FILE).is_file():
        try:
            meta = json.loads((entry / _META_FILE).read_text())
            return Tokenizer(_from_pretrained(entry), meta["eos_token_ids"], str(path))
        except (OSError, ValueError, KeyError, ConfigError) as e:
            log.warning("tokenizer disk cache entry %s unusable (%s); reconverting", entry, e)
    scalars = read_gguf_metadata(path)
    eos = _unique_ids([scalars.get(k) for k in _GGUF_EOS_KEYS])
    hf = _from_pretrained(path.parent, gguf_file=path.name)
    tok = Tokenizer(hf, eos, str(path))
    if entry is not None:
        _write_disk_entry(entry, tok)
    return tok


def _disk_entry(path: Path) -> Path | None:
    """Cache directory for this GGUF (it may not exist yet); None when the file cannot be stat'ed."""
    import transformers

    try:
        st = path.stat()
    except OSError:
        return None
    key = f"{path}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}|{_CACHE_FORMAT}"
    return DISK_CACHE_DIR / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _write_disk_entry(entry: Path, tok: Tokenizer) -> None:
    """Save atomically: write a temporary directory, then rename it into place."""
    tmp: str | None = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=entry.parent)
        tok.hf.save_pretrained(tmp)
        meta = {"source": tok.source, "eos_token_ids": list(tok.eos_token_ids)}
        Path(tmp, _META_FILE).write_text(json.dumps(meta))
        if entry.exists():
            shutil.rmtree(entry, ignore_errors=True)  # an unusable older entry
        try:
            os.replace(tmp, entry)
            tmp = None
        except OSError:
            if not (entry / _META_FILE).is_file():  # else another process just wrote it
                raise
    except OSError as e:
        log.warning("cannot write tokenizer disk cache %s: %s", entry, e)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
