"""A scripted model server that speaks the token-id protocol, for harness tests without an LLM.

It is `train.expert_data.ExpertTokenServer` (prompts rendered with the checkpoint's real chat format,
completions tokenized and split by the real parser, streamed with `prompt_token_ids`, `token_ids`,
logprobs and `policy_version`) answering from a script of raw model texts instead of the expert:
requests without tools (the loop's summary requests) take the next summary text.
"""

from __future__ import annotations

import threading

import numpy as np

from serve import routed_experts
from train.expert_data import ExpertTokenServer


class TokenScriptServer(ExpertTokenServer):
    def __init__(self, model_dir, turns: list[str], summaries: list[str], version: int = 7, routes: bool = False):
        super().__init__(model_dir, [], name="scripted", version=version)
        self.routes = routes
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

    def choice_extras(self, body, prompt, ids) -> dict:
        """With `routes`: routed experts as composer-serve sends them, every token read (all but the last
        sampled one) given experts that are a function of the token: fake_route(token id)."""
        if not (self.routes and body.get("return_routed_experts")):
            return {}
        read = (prompt + ids)[:-1]
        return {"routed_experts": routed_experts.encode(np.array([fake_route(t) for t in read]), 0)}


def fake_route(token_id: int) -> list[list[int]]:
    """[M=2 layers, K=2] experts of a token, out of 8."""
    return [[token_id % 8, (token_id + 1) % 8], [(token_id // 8) % 8, (token_id // 8 + 3) % 8]]
