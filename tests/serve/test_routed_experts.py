"""return_routed_experts: the experts each MoE layer used for every token the model read, as transformers'
router picks them for the same ids, streamed or not, through the prefix cache too; null from engines that
cannot say (hf)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from serve.routed_experts import decode, encode

HEADERS = {"Authorization": "Bearer sk-test"}


def ask(server, content: str, stream: bool, **extra) -> tuple[list[int], list[int], dict | None]:
    """(prompt ids, completion ids, routed_experts) of one chat completion."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 10, "seed": 3,
            "return_token_ids": True, "return_routed_experts": True, "stream": stream, **extra}
    url = server.base_url + "/chat/completions"
    if not stream:
        r = httpx.post(url, json=body, headers=HEADERS, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        choice = out["choices"][0]
        return out["prompt_token_ids"], choice["token_ids"], choice["routed_experts"]
    prompt, ids, routes, finals = None, [], None, 0
    with httpx.stream("POST", url, json=body, headers=HEADERS, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            prompt = chunk.get("prompt_token_ids", prompt)
            for c in chunk["choices"]:
                ids += c.get("token_ids") or []
                if c.get("finish_reason"):
                    finals += 1
                    routes = c["routed_experts"]
    assert finals == 1
    return prompt, ids, routes


def hf_routes(hf, ids: list[int]) -> torch.Tensor:
    """transformers' top-k experts [T, M, K] (sorted within each token) for the tokens `ids`."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids]), output_router_logits=True).router_logits
    k = hf.config.num_experts_per_tok
    return torch.stack([torch.topk(x.float().softmax(-1), k, -1).indices for x in logits], 1).sort(-1).values


@pytest.fixture(scope="module")
def hf(tiny_hermes):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_hermes, dtype=torch.float32,
                                                experts_implementation="eager").eval()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_routes_are_the_routers_choice_for_every_token_read(hermes_server, hf, stream):
    prompt, ids, routes = ask(hermes_server, "route me", stream)
    if hermes_server.engine == "hf":
        assert routes is None  # transformers' generate does not say; the trainer then routes itself
        return
    start, got = decode(routes)
    read = (prompt + ids)[:-1]  # the last sampled token was never fed back
    assert start == 0 and routes["dtype"] == "uint8" and got.shape == (len(read), 2, 2)
    assert torch.equal(torch.from_numpy(got).long().sort(-1).values, hf_routes(hf, read))


def test_a_repeated_prompt_gets_the_same_routes_and_they_stay_right(hermes_server, hf):
    # the second request reads the prompt's full blocks from the prefix cache: their routes come from the
    # store the first request wrote, the rest are computed again
    if hermes_server.engine == "hf":
        pytest.skip("the hf engine returns no routes (checked above)")
    first, ids, routes1 = ask(hermes_server, "a long shared opening line " * 8, False)
    again, ids2, routes2 = ask(hermes_server, "a long shared opening line " * 8, False)
    assert again == first
    _, a = decode(routes1)
    _, b = decode(routes2)
    shared = len(first) - 1
    assert (a[:shared] == b[:shared]).all()
    assert torch.equal(torch.from_numpy(b).long().sort(-1).values, hf_routes(hf, (again + ids2)[:-1]))


def test_the_wire_format_round_trips_and_refuses_garbage():
    routes = torch.randint(0, 300, (5, 3, 2)).numpy()
    start, back = decode(encode(routes, 7))
    assert start == 7 and (back == routes).all() and encode(routes, 0)["dtype"] == "int16"
    assert encode(routes % 256, 0)["dtype"] == "uint8"
    bad = encode(routes, 0) | {"shape": [4, 3, 2]}
    with pytest.raises(ValueError, match="malformed routed_experts"):
        decode(bad)
    with pytest.raises(ValueError, match="malformed routed_experts"):
        decode({"start": 0, "shape": [1, 1, 1], "dtype": "float32", "data": ""})
