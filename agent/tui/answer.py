"""An assistant answer streamed as Markdown. Its own module because the Markdown widget costs ~70 ms
to import: the app loads it after the first paint, not before."""

from __future__ import annotations

from textual.widgets import Markdown
from textual.widgets.markdown import MarkdownStream


class AssistantText(Markdown):
    def __init__(self, turn: int, markdown: str = ""):
        super().__init__(markdown)
        self.turn = turn
        self.stream: MarkdownStream | None = None

    async def write(self, text: str) -> None:
        if self.stream is None:
            self.stream = Markdown.get_stream(self)
        await self.stream.write(text)

    async def close(self) -> None:
        if self.stream is not None:
            await self.stream.stop()
            self.stream = None
