#!/bin/bash
# issue 56 item 6: SFT from the expert's sessions with their recorded ids vs the same sessions with the ids
# stripped (teacher data: rendered by the chat template); the two checkpoints compared tensor by tensor.
set -e
cd /work/main && . .venv/bin/activate
W=/tmp/m56/sft; rm -rf $W; mkdir -p $W/text
python -m serve.tiny $W/tiny > /dev/null 2>&1
composer-train expert-data synthetic-small --model $W/tiny --out $W/data --limit 12 --concurrency 2 2>&1 | tail -1
python - <<'PY'
import json, pathlib
W = pathlib.Path("/tmp/m56/sft")
for f in sorted((W / "data" / "sessions").glob("*.jsonl")):
    out = []
    for line in f.read_text().splitlines():
        r = json.loads(line)
        for k in ("prompt_token_ids", "completion_token_ids", "completion_logprobs", "policy_version", "routed_experts"):
            r.pop(k, None)
        out.append(json.dumps(r))
    (W / "text" / f.name).write_text("\n".join(out) + "\n")
PY
composer-train sft $W/data/sessions --model $W/tiny --out $W/ids --epochs 2 --batch 4 2>&1 | tail -2
composer-train sft $W/text --model $W/tiny --out $W/from-text --epochs 2 --batch 4 2>&1 | tail -2
python - <<'PY'
from safetensors.torch import load_file
a = load_file("/tmp/m56/sft/ids/model.safetensors"); b = load_file("/tmp/m56/sft/from-text/model.safetensors")
diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
print({"tensors": len(a), "same_names": sorted(a) == sorted(b), "max_abs_diff": diff,
       "bit_identical": all(a[k].equal(b[k]) for k in a)})
PY
