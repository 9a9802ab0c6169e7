"""The conversation pane: user messages, streamed Markdown answers, tool cards and notices, in order.

It stays scrolled to the bottom while output arrives (Textual's anchor) until the user scrolls up.
Each turn's answer (agent.tui.answer) streams through Textual's MarkdownStream, which itself merges
fragments when rendering falls behind; the pump upstream already joins deltas per frame.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from rich.text import Text
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Static

from agent.protocol import ToolCallFinished, ToolCallStarted
from agent.render import call_brief, typed_text
from agent.tui.cards import ToolCard

if TYPE_CHECKING:
    from agent.tui.answer import AssistantText

REASONING_TAIL_LINES = 4


class UserMessage(Static):
    pass


class Notice(Static):
    """A line from the interface itself: command output, errors, retries, the end of a run."""

    def __init__(self, text: str, kind: str = "info"):
        super().__init__(text, classes=f"-{kind}", markup=False)


class Reasoning(Static):
    """The model's thinking, dim, showing only its last few lines."""

    def __init__(self) -> None:
        super().__init__("", markup=False)
        self.text = ""

    def add(self, text: str) -> None:
        self.text += text
        tail = self.text.strip().splitlines()[-REASONING_TAIL_LINES:]
        self.update(Text("thinking · " + "\n".join(tail), style="dim italic"))


class ToolGroup(Vertical):
    """The calls of one model turn; those that are parallel-safe run (and spin) side by side."""


class Transcript(VerticalScroll):
    def __init__(self, **kw: Any):
        super().__init__(**kw)
        self._texts: dict[int, AssistantText] = {}
        self._reasoning: dict[int, Reasoning] = {}
        self._groups: dict[int, ToolGroup] = {}
        self.cards: dict[str, ToolCard] = {}

    def follow(self) -> None:
        """Keep the newest output in view. Anchoring only once the content overflows: an anchored
        Textual container bottom-aligns short content, and a conversation should start at the top."""
        self.call_after_refresh(self._anchor_if_overflowing)

    def _anchor_if_overflowing(self) -> None:
        if not self.is_anchored and self.max_scroll_y > 0:
            self.anchor()

    # -- messages -----------------------------------------------------------------------------------

    def add_user(self, text: str) -> None:
        self._turn_boundary()
        self.mount(UserMessage(Text(typed_text(text), style="bold")))
        if self.is_anchored:
            self.scroll_end(animate=False)  # sending a message brings the view back to the bottom
        self.follow()

    def notice(self, text: str, kind: str = "info") -> Notice:
        note = Notice(text, kind)
        self.mount(note)
        self.follow()
        return note

    async def text(self, turn: int, text: str) -> None:
        widget = self._texts.get(turn)
        if widget is None:
            from agent.tui.answer import AssistantText  # loaded lazily, see answer.py

            widget = self._texts[turn] = AssistantText(turn)
            await self.mount(widget)
        await widget.write(text)

    def reasoning(self, turn: int, text: str) -> None:
        widget = self._reasoning.get(turn)
        if widget is None:
            widget = self._reasoning[turn] = Reasoning()
            self.mount(widget)
        widget.add(text)

    async def end_text(self, turn: int) -> None:
        widget = self._texts.get(turn)
        if widget is not None:
            await widget.close()

    async def discard_turn_output(self, turn: int) -> None:
        """A retried request: what it streamed so far is thrown away, as the loop does."""
        widget = self._texts.pop(turn, None)
        if widget is not None:
            await widget.close()
            await widget.remove()
        thinking = self._reasoning.pop(turn, None)
        if thinking is not None:
            await thinking.remove()

    # -- tools --------------------------------------------------------------------------------------

    def tool_started(self, event: ToolCallStarted) -> ToolCard:
        group = self._groups.get(event.turn)
        if group is None:
            group = self._groups[event.turn] = ToolGroup()
            self.mount(group)
        card = self.cards[event.call_id] = ToolCard(event)
        group.mount(card)
        return card

    def tool_finished(self, event: ToolCallFinished) -> ToolCard | None:
        card = self.cards.get(event.call_id)
        if card is not None:
            card.finish(event)
        return card

    def running_cards(self) -> list[ToolCard]:
        return [c for c in self.cards.values() if c.running]

    async def end_run(self) -> None:
        """The run finished: streams close, cards still spinning were cut short."""
        for widget in self._texts.values():
            await widget.close()
        for card in self.running_cards():
            card.cancel()

    def _turn_boundary(self) -> None:
        # Turn numbers restart with each user message's run, so forget the previous run's widgets.
        self._texts, self._reasoning, self._groups = {}, {}, {}

    # -- whole transcript ---------------------------------------------------------------------------

    async def clear(self) -> None:
        await self.end_run()
        await self.remove_children()
        self.anchor(False)
        self._turn_boundary()
        self.cards = {}

    def replay(self, messages: list[dict[str, Any]]) -> None:
        """Show a resumed conversation: its user and assistant messages, calls as one line each."""
        for m in messages:
            if m.get("role") == "user":
                self.add_user(str(m.get("content") or ""))
            elif m.get("role") == "assistant":
                if m.get("content"):
                    from agent.tui.answer import AssistantText

                    self.mount(AssistantText(0, str(m["content"])))
                for tc in m.get("tool_calls") or []:
                    fn = tc.get("function", {})
                    try:
                        args = json.loads(fn.get("arguments") or "{}")
                    except json.JSONDecodeError:
                        args = fn.get("arguments")
                    self.notice(f"↳ {fn.get('name')}  {call_brief(fn.get('name', ''), args)}", "dim")
