"""A character-level tokenizer with a small explicit alphabet, and the chat template.

Ids: ``0 <pad>``, ``1 <s>``, ``2 </s>``, ``3 <unk>``, ``4 <|system|>``, ``5 <|user|>``,
``6 <|assistant|>``, then one id per alphabet character in order. A character outside
the alphabet encodes as ``<unk>`` (so a prompt never fails to encode) and ``<unk>`` /
role tokens decode to nothing. The alphabet travels with every checkpoint.
"""

from __future__ import annotations

from typing import Any

import msgspec

PAD, BOS, EOS, UNK = 0, 1, 2, 3
ROLE_IDS = {"system": 4, "user": 5, "assistant": 6}
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
N_SPECIAL = len(SPECIALS)

#: Digits and the little punctuation the demo tasks use.
DEFAULT_ALPHABET = "0123456789+-=?: \n"


class CharTokenizer(msgspec.Struct, frozen=True, kw_only=True):
    alphabet: str = DEFAULT_ALPHABET

    def __post_init__(self) -> None:
        if len(set(self.alphabet)) != len(self.alphabet) or not self.alphabet:
            raise ValueError("the alphabet must be non-empty with no repeated characters")

    @property
    def vocab_size(self) -> int:
        return N_SPECIAL + len(self.alphabet)

    def _index(self) -> dict[str, int]:
        return {ch: N_SPECIAL + i for i, ch in enumerate(self.alphabet)}

    def encode(self, text: str) -> list[int]:
        index = self._index()
        return [index.get(ch, UNK) for ch in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.alphabet[i - N_SPECIAL] for i in ids if N_SPECIAL <= i < self.vocab_size)

    def token_str(self, token_id: int) -> str:
        if 0 <= token_id < N_SPECIAL:
            return SPECIALS[token_id]
        if token_id < self.vocab_size:
            return self.alphabet[token_id - N_SPECIAL]
        raise ValueError(f"token id {token_id} is outside the vocabulary ({self.vocab_size})")

    def render_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """``<s>`` then ``<|role|> content`` per message, then ``<|assistant|>``."""
        ids = [BOS]
        for message in messages:
            if not isinstance(message, dict):
                raise ValueError("every message must be an object")
            role = message.get("role", "user")
            if role not in ROLE_IDS:
                raise ValueError(f"unknown message role {role!r}; expected one of {sorted(ROLE_IDS)}")
            content = message.get("content") or ""
            if isinstance(content, list):  # OpenAI content parts
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            if not isinstance(content, str):
                raise ValueError("message content must be a string or a list of text parts")
            ids.append(ROLE_IDS[role])
            ids.extend(self.encode(content))
        ids.append(ROLE_IDS["assistant"])
        return ids

    def render_prompt(self, prompt: str) -> list[int]:
        """A raw completion prompt: ``<s>`` then its characters."""
        return [BOS, *self.encode(prompt)]
