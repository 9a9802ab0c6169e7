"""find-def is judged on the answer alone: it must name the defining file and no other module, or an
answer listing every module would pass (what RL on composer-tiny learnt to do)."""

from __future__ import annotations

import pytest

from agent.tasks import Workspace
from agent.tasks.families import generate
from agent.tasks.families.pool import MODULES


@pytest.mark.parametrize("size", ["small", "medium"])
def test_find_def_passes_the_right_file_only(size):
    task = generate("find-def", 3, size)
    path = task.meta["module"]
    other = next(f"pkg/{m}.py" for m in sorted(MODULES) if f"pkg/{m}.py" != path)
    fn = task.meta["function"]
    for answer, want in (
        (f"`{fn}` is defined in {path}, line {task.meta['line']}.", True),
        (f"`{fn}` is defined in {other}, line 3.", False),
        (f"`{fn}` is defined in {other}, line 3. `{fn}` is defined in {path}, line 1.", False),
        (" ".join(f"pkg/{m}.py" for m in MODULES), False),
    ):
        ws = Workspace.create(task)
        try:
            ok, out = ws.verify(answer)
        finally:
            ws.cleanup()
        assert ok == want, (answer, out)
