"""Progress on stderr: a bar with the running TPS on a terminal, one plain line per prompt otherwise."""

from __future__ import annotations

import io

from bench.runs.progress import Progress


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_terminal_gets_a_bar_with_running_tps():
    stream, lines = Terminal(), []
    p = Progress(3, "ds-tiny ar mn", lines.append, stream=stream)
    p.done("a: 9 tokens", 9, 0.5)
    p.done("", 0, 0.0)  # already in the store
    p.note("c: skipped — too long")
    p.close()
    out = stream.getvalue()
    assert "ds-tiny ar mn" in out and "18.0 tok/s" in out and "c: skipped" in out and "2/3" in out
    assert lines == []  # nothing else printed beside the bar


def test_a_pipe_gets_one_line_per_prompt():
    lines = []
    p = Progress(2, "x", lines.append, stream=io.StringIO())
    p.done("a: 9 tokens, 18.0 tok/s", 9, 0.5)
    p.done("", 0, 0.0)
    p.note("b: skipped")
    p.close()
    assert lines == ["a: 9 tokens, 18.0 tok/s", "b: skipped"]
