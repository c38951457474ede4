"""Stop sequences on streamed text: emit everything up to a stop string, never the stop string
itself, and hold back only the tail that could still become one (so a stream never has to take
text back)."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""
        self.stopped = False

    def feed(self, segment: str) -> str:
        """New text -> the part that is safe to emit now."""
        if self.stopped:
            return ""
        text = self.pending + segment
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.pending = True, ""
            return text[:min(hits)]
        keep = self._tail(text)
        self.pending = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        """At the end of generation: what was held back (no stop string completed)."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out

    def _tail(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for n in range(min(self.hold, len(text)), 0, -1):
            suffix = text[-n:]
            if any(s.startswith(suffix) for s in self.stops):
                return n
        return 0
