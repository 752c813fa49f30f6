"""One tokenizer for every engine: Hugging Face's, loaded from the model folder, and the `Tokenizer` protocol the
kit reads it through.

Sharing it means a template renders to the same ids on every engine, so experiments compare like with
like. Special tokens written in text (`<|im_start|>`) become their single ids only with `special=True`;
field report 4 is what happens otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from exlnb.engines.checks import check_text

# Text whose tokens exercise what llguidance must read as the tokenizer does: spaces inside, JSON, non-ASCII
GRAMMAR_PROBE = 'A {"name": "Ana", "tags": [1, 2]}\n\tcafé, 東京!'


class Tokenizer(Protocol):
    """The slice of a tokenizer the kit needs; every engine hands out the same HF-backed one."""

    eos_token_id: int
    eos_token_ids: tuple[int, ...]  # every id that ends a turn (Llama 3 has two)
    chat_template: str | None

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        """Tokenise; with `special=True`, `<|im_start|>` and friends become their single ids."""
        ...

    def decode(self, ids: Sequence[int], *, special: bool = True) -> str: ...

    def special_tokens(self) -> dict[str, int]: ...

    def token_to_id(self, token: str) -> int | None: ...

    def longest_token(self) -> int:
        """The most characters of text one token stands for: a prompt longer than the cache times this cannot
        fit it, whatever it holds."""
        ...

    def apply_chat_template(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        """The model's own chat template rendered to text (template "auto")."""
        ...


class HfTokenizer:
    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(model_dir)
        self.eos_token_ids: tuple[int, ...] = _model_eos_ids(model_dir) or _tokenizer_eos_ids(self._tok)
        if not self.eos_token_ids:
            raise ValueError(f"{model_dir} defines no eos token; exlnb needs one to stop jobs")
        self.eos_token_id: int = self.eos_token_ids[0]
        self.chat_template: str | None = getattr(self._tok, "chat_template", None)
        self.vocab_size: int = len(self._tok)
        self._pieces: tuple[str, ...] | None = None
        self._longest: int | None = None
        self._grammar_tokenizers: dict[int, object] = {}

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        check_text("the prompt", text)
        if special:
            return self._tok.encode(text, add_special_tokens=False)
        # split_special_tokens makes "<|im_start|>" plain text: several ordinary tokens
        return self._tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def decode(self, ids: Sequence[int], *, special: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=not special)

    def special_tokens(self) -> dict[str, int]:
        return {t.content if hasattr(t, "content") else str(t): i for i, t in self._tok.added_tokens_decoder.items()}

    def token_to_id(self, token: str) -> int | None:
        tid = self._tok.convert_tokens_to_ids(token)
        return None if tid is None or tid == self._tok.unk_token_id and token != self._tok.unk_token else tid

    def longest_token(self) -> int:
        # A vocabulary entry is at least as long as the text it stands for: a byte-level one spells each byte of
        # its text as a character, a SentencePiece one its characters ("<0x0A>" for one byte). SmolLM2's longest,
        # 81 characters, are runs of '#' and of spaces.
        if self._longest is None:
            self._longest = max(map(len, self._tok.get_vocab()))
        return self._longest

    def pieces(self) -> tuple[str, ...]:
        """Each token's own text, by id (exllamav2's id_to_piece list): what DRY and XTC classify tokens by."""
        if self._pieces is None:
            self._pieces = tuple(self._tok.batch_decode([[i] for i in range(self.vocab_size)]))
        return self._pieces

    def grammar_tokenizer(self, vocab_size: int):
        """llguidance's view of this tokenizer over `vocab_size` logits (about 0.4 s to build, so built once),
        checked to read tokens as this tokenizer decodes them: otherwise every mask would be wrong."""
        if vocab_size not in self._grammar_tokenizers:
            from llguidance.hf import from_tokenizer

            view = from_tokenizer(self._tok, n_vocab=vocab_size, eos_token=list(self.eos_token_ids))
            self._check_grammar_view(view)
            self._grammar_tokenizers[vocab_size] = view
        return self._grammar_tokenizers[vocab_size]

    def _check_grammar_view(self, view) -> None:
        """llguidance reads tokenizer.json itself (as exllamav3's own filter does): a decoder that does not
        match the vocabulary (a byte-level one read as SentencePiece, `exlnb.models.repair_tokenizer`) makes it
        see other bytes than this tokenizer decodes, and its masks then allow the wrong tokens."""
        ids = self._tok.encode(GRAMMAR_PROBE, add_special_tokens=False)
        seen = view.decode_bytes(ids).decode("utf-8", errors="replace").lstrip()
        meant = self._tok.decode(ids).lstrip()  # lstrip: SentencePiece tokenizers drop a leading space here
        if seen != meant:
            at = next(i for i, (a, b) in enumerate(zip(seen + "\0", meant + "\0")) if a != b)
            raise ValueError(
                f"llguidance reads this tokenizer's tokens otherwise than it decodes them ({meant[at : at + 8]!r} "
                f"reads as {seen[at : at + 8]!r}), so no constraint could be enforced: its tokenizer.json's decoder "
                "does not fit its vocabulary; for a byte-level one, exlnb.models.repair_tokenizer(folder) fixes it"
            )

    def apply_chat_template(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _model_eos_ids(model_dir: Path) -> tuple[int, ...]:
    """The model's own end-of-sequence ids (generation_config.json, then config.json).

    Preferred over the tokenizer's: transformers 5.17 reads eos_token_id 1 (<|im_start|>) from a tokenizer
    folder that transformers 5.23 wrote with eos <|im_end|> (2), and a job then never stops.
    """
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (eos,)
    return ()


def _tokenizer_eos_ids(tokenizer) -> tuple[int, ...]:
    return () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
