"""Tokenizer: the export folder's tokenizer.json (HF `tokenizers`) and chat template (sandboxed jinja2)."""
from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from octavo.errors import InvalidRequestError, ModelFormatError
from octavo.export.manifest import Manifest
from octavo.runtime.chat_content import ContentEscaper


def _raise_exception(message: str) -> None:
    raise InvalidRequestError(f"chat template: {message}")


def _sandbox() -> Any:
    """The jinja2 environment chat templates render in: immutable sandbox, transformers' whitespace options."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = _tojson  # as transformers renders templates (tools, tool call arguments)
    return env


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' `tojson` for chat templates: plain json.dumps, keys in order, no HTML escaping (jinja2's
    own filter sorts keys and escapes <>&' — the model would see tool schemas unlike in training)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _cut_after_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    """TEXT up to the end of the last message's content (its closing tokens dropped), so the model continues
    it. The content is looked up from the end; trailing whitespace is kept only if the template kept it."""
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or not final.strip():
        raise InvalidRequestError("continue_final_message needs a last message with text content to continue")
    at = text.rfind(final.strip())
    if at < 0:
        raise InvalidRequestError("continue_final_message: the last message's content does not appear in the "
                                  "rendered chat template, so there is nothing to continue")
    body = final.lstrip()
    end = at + len(body) if text.startswith(body, at) else at + len(final.strip())
    return text[:end]


class Tokenizer:
    def __init__(self, folder: str | Path, manifest: Manifest) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        folder = Path(folder)
        path = folder / manifest.tokenizer_file
        if not path.is_file():
            raise ModelFormatError(f"{folder}: tokenizer file {manifest.tokenizer_file} is missing; re-export the model")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - `tokenizers` raises a bare Exception for a malformed file
            raise ModelFormatError(f"{path}: not a valid tokenizer file ({exc}); re-export the model") from exc
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = list(manifest.eos_token_ids)
        self.bos_token_id = manifest.bos_token_id
        self.bos_token = self._tok.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        self.eos_token = (self._tok.id_to_token(eos) or "") if eos is not None else ""
        self.chat_template: str | None = None
        if manifest.chat_template_file and (folder / manifest.chat_template_file).is_file():
            self.chat_template = (folder / manifest.chat_template_file).read_text()
        self._template: Any = None
        specials = [t.content for t in self._tok.get_added_tokens_decoder().values() if t.special]
        self._escaper = ContentEscaper.for_specials(specials)
        self._literal: Any = None  # the tokenizer with encode_special_tokens, made on first use
        self._literal_lock = threading.Lock()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of TEXT. Releases the GIL while it works (`encode` would hold it for ~2 s per MB of text)."""
        try:
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        except TypeError as exc:  # e.g. a lone surrogate ("\ud800"): not encodable text
            raise InvalidRequestError(f"the text cannot be tokenized (is it valid Unicode?): {exc}") from None

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
                    add_special_tokens: bool = False, special_tokens_in_content: bool = False,
                    **template_options: Any) -> list[int]:
        """Token ids of a conversation rendered with the chat template. The rendered text already holds the
        template's special tokens (BOS included), so it is encoded without adding more unless asked.
        template_options: apply_chat_template's keywords (chat_template, continue_final_message, variables).

        Special-token strings inside the messages (`<|im_end|>` typed by a user) stay plain text, not control
        tokens (see octavo.runtime.chat_content), unless SPECIAL_TOKENS_IN_CONTENT: then they are parsed like
        the template's own (for callers that build raw prompts in messages and trust their authors)."""
        if special_tokens_in_content or not self._escaper.needed(messages):
            text = self.apply_chat_template(messages, add_generation_prompt, **template_options)
            return self.encode(text, add_special_tokens=add_special_tokens)
        template = template_options.get("chat_template") or self.chat_template or ""
        try:
            escaped, open_, close = self._escaper.escape(messages, template)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        text = self.apply_chat_template(escaped, add_generation_prompt, **template_options)
        first = [add_special_tokens]  # the tokenizer's own specials (BOS), if asked, once, at the start

        def encode(piece: str) -> list[int]:
            add, first[0] = first[0], False
            return self.encode(piece, add_special_tokens=add)

        return self._escaper.tokenize(text, open_, close, encode, self._encode_literal)

    def _encode_literal(self, text: str) -> list[int]:
        """TEXT's ids with special-token strings taken as ordinary text (a second tokenizer, so that the shared
        one's state never changes under another thread)."""
        with self._literal_lock:
            if self._literal is None:
                from tokenizers import Tokenizer as HFTokenizer

                self._literal = HFTokenizer.from_str(self._tok.to_str())
                self._literal.encode_special_tokens = True
            literal = self._literal
        return literal.encode_batch([text], add_special_tokens=False)[0].ids

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what grammar engines are built from)."""
        return self._tok.to_str()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
                            chat_template: str | None = None, continue_final_message: bool = False,
                            **kwargs: Any) -> str:
        """Render messages with the model's chat template (or CHAT_TEMPLATE, a request's own) in a sandbox (no
        file or attribute access). continue_final_message: the text ends right after the last message's
        content, so that generation continues that message (transformers' rule)."""
        source = chat_template if chat_template is not None else self.chat_template
        if source is None:
            raise InvalidRequestError("this model has no chat template; send a plain prompt, or a 'chat_template'")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise InvalidRequestError("messages must be a list of {'role': ..., 'content': ...} dicts")
        try:
            if self._template is None:
                self._template = _sandbox().from_string(self.chat_template)
            template = self._template if chat_template is None else _sandbox().from_string(chat_template)
            text = template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token, **kwargs,
            )
            return _cut_after_final_message(text, messages) if continue_final_message else text
        except InvalidRequestError:
            raise
        except Exception as exc:  # noqa: BLE001 - TemplateError, and what the sandbox raises (OverflowError for
            # range() over its cap, TypeError for {% include %} without a loader): all the template's fault
            raise InvalidRequestError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
