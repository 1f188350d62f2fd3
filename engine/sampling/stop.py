"""Stop strings on detokenised text, with a holdback so a partial stop string is never
emitted (pure)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StopMatch:
    text: str  # the final output text (up to, and with include=True through, the stop)
    stop: str


class StopStringMatcher:
    """Feed the full decoded output text after every token; read what may be emitted."""

    def __init__(self, stops: tuple[str, ...], include_stop: bool = False) -> None:
        self.stops = tuple(s for s in stops if s)
        self.include_stop = include_stop
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._searched = 0  # text before this index cannot start a stop any more

    def feed(self, text: str) -> tuple[str, StopMatch | None]:
        """(text safe to emit so far, the stop match if the text now contains a stop)."""
        best: tuple[int, str] | None = None
        start = max(0, self._searched - self._hold)
        for s in self.stops:
            i = text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            final = text[: i + len(s)] if self.include_stop else text[:i]
            return final, StopMatch(final, s)
        self._searched = len(text)
        safe = len(text) - self._hold if self.stops else len(text)
        while safe > 0 and text[safe - 1] == "\ufffd":  # an incomplete UTF-8 sequence
            safe -= 1
        return text[: max(safe, 0)], None
