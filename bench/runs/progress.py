"""Progress of a sweep on stderr: a tqdm bar (prompts done, running decode TPS) when stderr is a
terminal, one plain line per prompt otherwise (logs, CI, Ray workers)."""
from __future__ import annotations

import sys
from collections.abc import Callable

from tqdm import tqdm


class Progress:
    def __init__(self, total: int, desc: str, log: Callable[[str], None], stream=None):
        self.stream = stream = stream or sys.stderr
        self.log, self.tokens, self.seconds = log, 0, 0.0
        self.bar = None
        if stream.isatty():
            self.bar = tqdm(total=total, desc=desc, file=stream, unit="prompt", dynamic_ncols=True)

    def note(self, line: str) -> None:
        """A line that is not a prompt done (a skip, a repair)."""
        if self.bar is None:
            self.log(line)
        else:
            self.bar.write(line, file=self.stream)  # above the bar

    def done(self, line: str, tokens: int, decode_s: float, n: int = 1) -> None:
        """`n` prompts done (decoded now: `tokens` in `decode_s`; already in the store: 0)."""
        self.tokens += tokens
        self.seconds += decode_s
        if self.bar is None:
            if line:
                self.log(line)
            return
        self.bar.update(n)
        if self.seconds > 0:
            self.bar.set_postfix_str(f"{self.tokens / self.seconds:.1f} tok/s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
