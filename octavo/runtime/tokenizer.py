"""Tokenizer: the export folder's tokenizer.json (HF `tokenizers`) and chat template (sandboxed jinja2)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from octavo.errors import InvalidRequestError, ModelFormatError
from octavo.export.manifest import Manifest


def _raise_exception(message: str) -> None:
    raise InvalidRequestError(f"chat template: {message}")


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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of TEXT. Releases the GIL while it works (`encode` would hold it for ~2 s per MB of text)."""
        try:
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        except TypeError as exc:  # e.g. a lone surrogate ("\ud800"): not encodable text
            raise InvalidRequestError(f"the text cannot be tokenized (is it valid Unicode?): {exc}") from None

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation rendered with the chat template. The rendered text already holds the
        template's special tokens (BOS included), so it is encoded without adding more."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render messages with the model's chat template in a sandbox (no file or attribute access)."""
        if self.chat_template is None:
            raise InvalidRequestError("this model has no chat template; send a plain prompt instead")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise InvalidRequestError("messages must be a list of {'role': ..., 'content': ...} dicts")
        try:
            if self._template is None:
                from jinja2.sandbox import ImmutableSandboxedEnvironment

                env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                    extensions=["jinja2.ext.loopcontrols"])
                env.globals["raise_exception"] = _raise_exception
                self._template = env.from_string(self.chat_template)
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token, **kwargs,
            )
        except InvalidRequestError:
            raise
        except Exception as exc:  # noqa: BLE001 - TemplateError, and what the sandbox raises (OverflowError for
            # range() over its cap, TypeError for {% include %} without a loader): all the template's fault
            raise InvalidRequestError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
