"""A grammar as a logits processor: llguidance's matcher brought to each context the
engine asks about, and the tokens it refuses next masked to -inf (structured_output.py
compiles the grammars; call_hold.py holds the calls a model opens with a subclass)."""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx
import numpy as np


def allowed_tokens(matcher, n: int) -> np.ndarray:
    """[n] bools: which of the first n token ids the matcher's grammar takes next."""
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    return bits[:n].astype(np.bool_)


class GrammarError(RuntimeError):
    """The grammar engine stopped holding an answer part way (a limit of its own reached):
    the request fails rather than going on with free text, as a 400 naming `param`, the
    request's field the grammar came from (its schema is what asked too much)."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


class GrammarProcessor:
    """(context [prompt + generated], logits [1, V]) -> logits with the tokens the grammar
    refuses next at -inf. The engine calls it for any prefix (a verify checks k+1 positions;
    drafts it rejected are replaced): the matcher is brought to each context by rolling back
    what differs from the tokens it consumed and consuming the rest. A context the grammar
    refuses (a draft after a refused one, rejected anyway) gets its logits unchanged."""

    def __init__(self, matcher, prompt_len: int, opens_after: Optional[List[int]] = None,
                 where: Optional[str] = None):
        self.matcher = matcher
        self.where = where  # the request's field the grammar holds its answer to (GrammarError)
        self.prompt_len = prompt_len
        self.opens_after = opens_after  # the grammar holds after these tokens (`</think>`), or at once
        self.consumed: List[int] = []

    def __call__(self, context: mx.array, logits: mx.array) -> mx.array:
        held = self._held(context[self.prompt_len :].tolist())  # not the prompt: it may be 100K tokens
        if held is None:
            return logits
        return self._mask(held, logits)

    def _mask(self, held: List[int], logits: mx.array) -> mx.array:
        """`logits` with what the grammar refuses after the tokens `held` at -inf."""
        reached = self._reach(held)
        allowed = allowed_tokens(self.matcher, logits.shape[-1]) if reached else None
        if self.matcher.is_error():
            field = f"'{self.where}': " if self.where else ""
            raise GrammarError(f"{field}the answer's format could no longer be enforced: "
                               + self.matcher.get_error().splitlines()[0], self.where)
        if not reached:
            return logits
        allowed = mx.array(allowed)
        return mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))

    def _held(self, generated: List[int]) -> Optional[List[int]]:
        """The generated tokens the grammar covers; None while it does not hold yet."""
        if self.opens_after is None:
            return generated
        n = len(self.opens_after)
        for i in range(len(generated) - n + 1):
            if generated[i : i + n] == self.opens_after:
                return generated[i + n :]
        return None

    def _reach(self, tokens: List[int]) -> bool:
        """Bring the matcher to `tokens`; False when the grammar refuses one of them."""
        same = 0
        while same < min(len(tokens), len(self.consumed)) and tokens[same] == self.consumed[same]:
            same += 1
        if same < len(self.consumed):
            self.matcher.rollback(len(self.consumed) - same)
            del self.consumed[same:]
        rest = tokens[same:]
        taken = self.matcher.try_consume_tokens(rest) if rest else 0
        self.consumed += rest[:taken]
        return taken == len(rest)
