"""A scripted model server that speaks the token-id protocol, for harness tests without an LLM.

It is `train.expert_data.ExpertTokenServer` (prompts rendered with the checkpoint's real chat format,
completions tokenized and split by the real parser, streamed with `prompt_token_ids`, `token_ids`,
logprobs and `policy_version`) answering from a script of raw model texts instead of the expert:
requests without tools (the loop's summary requests) take the next summary text.
"""

from __future__ import annotations

import threading

from train.expert_data import ExpertTokenServer


class TokenScriptServer(ExpertTokenServer):
    def __init__(self, model_dir, turns: list[str], summaries: list[str], version: int = 7):
        super().__init__(model_dir, [], name="scripted", version=version)
        self.turns, self.summaries = list(turns), list(summaries)
        self.completions: list[list[int]] = []
        self.lock = threading.Lock()

    def completion(self, messages, tools) -> str:
        with self.lock:
            text = (self.turns if tools else self.summaries).pop(0)
            self.completions.append(self.chat.encode(text))
        return text

    def logprobs(self, ids: list[int]) -> list[float]:
        return [-0.25 - 0.001 * i for i in range(len(ids))]
