"""Per-request grammar state: the allowed-token mask for the next step and token advance."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from engine.structured.grammar import CompiledGrammar, GrammarError


class GrammarState:
    """Wraps one ``llguidance.LLMatcher``. ``vocab_size`` is the model's logits width."""

    def __init__(
        self, compiled: CompiledGrammar, ll_tokenizer: Any, vocab_size: int, limits: Any = None
    ) -> None:
        import llguidance

        self.matcher = llguidance.LLMatcher(ll_tokenizer, compiled.grammar, log_level=0, limits=limits)
        if self.matcher.is_error():
            raise GrammarError(f"{compiled.kind} rejected: {self.matcher.get_error()}")
        self.vocab_size = vocab_size

    def allowed_mask(self) -> torch.Tensor:
        """[vocab_size] bool: tokens the grammar allows next (EOS only when it may end)."""
        raw = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(raw, bitorder="little")  # [ceil(n_tok/32)*32]
        mask = np.zeros(self.vocab_size, dtype=bool)
        n = min(self.vocab_size, bits.shape[0])
        mask[:n] = bits[:n].astype(bool)
        if self.matcher.is_error():
            raise GrammarError(f"grammar failed while computing the mask: {self.matcher.get_error()}")
        return torch.from_numpy(mask)

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} violates the grammar: {self.matcher.get_error()}")

    def valid_prefix(self, tokens: tuple[int, ...] | list[int]) -> int:
        """How many leading ``tokens`` the grammar would accept from here (nothing consumed)."""
        n = int(self.matcher.validate_tokens(list(tokens)))
        if self.matcher.is_error():
            raise GrammarError(f"grammar failed while checking drafts: {self.matcher.get_error()}")
        return n

    @property
    def is_finished(self) -> bool:
        """The grammar cannot be extended any more (only EOS may follow)."""
        return bool(self.matcher.is_stopped())

    @property
    def is_accepting(self) -> bool:
        return bool(self.matcher.is_accepting())
