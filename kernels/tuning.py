"""Per-GPU tables of tuned launch configurations: what `bench/gpu.py --tune` measured, read at start-up.

One JSON file per GPU model in kernels/tuned/, named after the device (`normalise("NVIDIA H200")` is
"nvidia-h200"), written by bench/gpu_tune.py and committed with the code (as vLLM's fused_moe keeps
configs/E=..,N=..,device_name=...json):

    {"schema": 1, "device": "NVIDIA H200", "meta": {...how and when it was measured...},
     "entries": {"moe_decode": {"D=2048,E=128,I=768,K=8,T=1,dtype=bf16": {"variant": "dot", ...}},
                 "fp8_linear": {"K=2048,M=1,N=5120,dtype=bf16": {"block_m": 16, ...}}}}

An entry is keyed by kernel, then by its shape and dtype (`shape_key`: sorted name=value pairs). The
kernels look up the table of the device they run on; a token or row count between two tuned ones takes
the next tuned count above it (its tiles serve any smaller count). vLLM and SGLang take the nearest tuned
count instead; past the largest tuned count we return nothing (defaults), so that a 4,096-token prefill
never runs a configuration timed at 64 decode tokens.
On a CPU (CI, the interpreter) no table is read unless COMPOSER_TUNED_DEVICE names a device, so CPU
results never depend on a GPU's table; tests use that to read a fake device's table.

A missing table means today's defaults, silently (most GPUs have none); an unreadable or invalid one
means the defaults too, with one warning naming the file and the fault, never a failed start.

Limits: a table is valid for the Triton version that measured it only in the sense that its configs
compiled and won there; a newer Triton may prefer others (rerun the sweep). Nothing checks that a
config fits the GPU's shared memory at lookup time: the sweep only writes configs that ran.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import torch

SCHEMA = 1
TUNED_DIR = Path(__file__).resolve().parent / "tuned"
DEVICE_ENV = "COMPOSER_TUNED_DEVICE"  # read this device's table even without a GPU (tests, what-if runs)
DIR_ENV = "COMPOSER_TUNED_DIR"  # another folder of tables (tests)

# the variants of the decode MoE layer (kernels/moe_decode_variants.py runs them); a "dot", "swap" or "fma"
# config with "fused": true runs gate_up and down in one launch (then a sum of its partials)
MOE_VARIANTS = ("default", "grouped", "dot", "swap", "fma")
_TILE_FIELDS = ("block_n", "block_k", "num_warps", "num_stages")
# per kernel: the shape dimensions of a key (besides dtype), and the fields a config must carry
KERNELS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "moe_decode": (("T", "D", "I", "E", "K"), ("variant",)),
    "fp8_linear": (("M", "N", "K"), ("block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages")),
}
# the dimension that counts tokens or rows: a lookup rounds it up to the next tuned value
_COUNT_DIM = {"moe_decode": "T", "fp8_linear": "M"}
DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def normalise(device_name: str) -> str:
    """A device name as a file name: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    name = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    if not name:
        raise ValueError(f"no usable characters in the device name {device_name!r}")
    return name


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPES:
        raise ValueError(f"no tuning key for dtype {dtype}")
    return DTYPES[dtype]


def shape_key(kernel: str, dtype: str, **dims: int) -> str:
    """The entry key of one shape: its dimensions and dtype as sorted name=value pairs."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r} (known: {', '.join(KERNELS)})")
    want = set(KERNELS[kernel][0])
    if set(dims) != want:
        raise ValueError(f"{kernel} keys take dimensions {sorted(want)}, not {sorted(dims)}")
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype must be one of {sorted(DTYPES.values())}, not {dtype!r}")
    for k, v in dims.items():
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{kernel} dimension {k} must be a positive int, not {v!r}")
    return ",".join(f"{k}={v}" for k, v in sorted({**dims, "dtype": dtype}.items()))


def parse_key(kernel: str, key: str) -> tuple[dict[str, int], str]:
    """shape_key's inverse: (dims, dtype); ValueError on a malformed key."""
    try:
        pairs = dict(part.split("=", 1) for part in key.split(","))
        dtype = pairs.pop("dtype")
        dims = {k: int(v) for k, v in pairs.items()}
    except (ValueError, KeyError) as e:
        raise ValueError(f"malformed {kernel} key {key!r}") from e
    if shape_key(kernel, dtype, **dims) != key:
        raise ValueError(f"{kernel} key {key!r} is not in canonical form ({shape_key(kernel, dtype, **dims)!r})")
    return dims, dtype


def _check_config(kernel: str, key: str, cfg: object) -> None:
    where = f"{kernel}[{key}]"
    if not isinstance(cfg, dict):
        raise ValueError(f"{where}: a config is an object, not {type(cfg).__name__}")
    missing = [f for f in KERNELS[kernel][1] if f not in cfg]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}")

    def positive_ints(obj: dict, fields: tuple[str, ...], what: str) -> None:
        for f in fields:
            v = obj.get(f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{where}: {what}{f} must be a positive int, not {v!r}")

    if kernel == "fp8_linear":
        positive_ints(cfg, KERNELS[kernel][1], "")
        return
    variant = cfg["variant"]
    if variant not in MOE_VARIANTS:
        raise ValueError(f"{where}: variant must be one of {MOE_VARIANTS}, not {variant!r}")
    if variant in ("dot", "swap", "fma"):
        for part in ("gate_up", "down"):
            if not isinstance(cfg.get(part), dict):
                raise ValueError(f"{where}: variant {variant!r} needs a {part!r} object of {', '.join(_TILE_FIELDS)}")
            positive_ints(cfg[part], _TILE_FIELDS, f"{part}.")
        positive_ints(cfg, ("split_k",), "")
        if not isinstance(cfg.get("fused", False), bool):
            raise ValueError(f"{where}: fused must be true or false, not {cfg['fused']!r}")
        if cfg.get("fused") and cfg["split_k"] != 1:
            raise ValueError(f"{where}: the fused kernel (gate_up and down in one launch) takes no split_k")


@dataclass(frozen=True)
class Table:
    """One device's entries: kernel -> shape key -> config (a plain dict, as in the file)."""

    device: str
    entries: dict[str, dict[str, dict]]
    meta: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"schema": SCHEMA, "device": self.device, "meta": self.meta, "entries": self.entries}


def validate(data: object) -> Table:
    """A parsed table file -> Table; ValueError naming the first fault."""
    if not isinstance(data, dict):
        raise ValueError("a table is a JSON object")
    if data.get("schema") != SCHEMA:
        raise ValueError(f"schema must be {SCHEMA}, not {data.get('schema')!r}")
    device, entries = data.get("device"), data.get("entries")
    if not isinstance(device, str) or not device:
        raise ValueError("'device' must name the GPU")
    if not isinstance(entries, dict):
        raise ValueError("'entries' must be an object of kernel -> shape key -> config")
    for kernel, by_key in entries.items():
        if kernel not in KERNELS:
            raise ValueError(f"unknown kernel {kernel!r} (known: {', '.join(KERNELS)})")
        if not isinstance(by_key, dict):
            raise ValueError(f"entries[{kernel!r}] must be an object")
        for key, cfg in by_key.items():
            parse_key(kernel, key)
            _check_config(kernel, key, cfg)
    meta = data.get("meta", {})
    if not isinstance(meta, dict):
        raise ValueError("'meta' must be an object")
    return Table(device, entries, meta)


def table_path(device_name: str, folder: Path | None = None) -> Path:
    return Path(folder or os.environ.get(DIR_ENV) or TUNED_DIR) / f"{normalise(device_name)}.json"


def write_table(table: Table, folder: Path | None = None) -> Path:
    """Validate and write a device's table (sorted keys: a rerun's diff shows only what changed)."""
    validate(table.to_json())
    path = table_path(table.device, folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table.to_json(), indent=1, sort_keys=True) + "\n")
    tmp.replace(path)
    reload()
    return path


@cache
def _load(path: Path) -> Table | None:
    if not path.exists():
        return None
    try:
        return validate(json.loads(path.read_text()))
    except (OSError, ValueError) as e:  # json's errors are ValueErrors
        warnings.warn(f"kernels/tuning: ignoring the tuned table {path} ({e}); using the default configurations",
                      RuntimeWarning, stacklevel=3)
        return None


def current_device_name() -> str | None:
    """The device whose table the kernels read: COMPOSER_TUNED_DEVICE, else the current CUDA device, else None."""
    if name := os.environ.get(DEVICE_ENV, "").strip():
        return name
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return None


def load(device_name: str | None = None, folder: Path | None = None) -> Table | None:
    """The table for a device (default: `current_device_name()`), or None (no device, no table, or a bad one)."""
    name = device_name or current_device_name()
    return None if name is None else _load(table_path(name, folder))


def lookup(kernel: str, dtype: str, *, device_name: str | None = None, folder: Path | None = None,
           **dims: int) -> dict | None:
    """The tuned config for these dimensions, or None (then the kernel keeps its defaults).

    The count dimension (T tokens, M rows) matches the smallest tuned count >= it with all other
    dimensions equal; a count above every tuned one gets None. Cached: a launch pays one dict lookup."""
    name = device_name or current_device_name()
    if name is None:
        return None
    return _lookup(table_path(name, folder), kernel, dtype, tuple(sorted(dims.items())))


@cache
def _lookup(path: Path, kernel: str, dtype: str, dims_items: tuple) -> dict | None:
    table = _load(path)
    if table is None or kernel not in table.entries:
        return None
    dims = dict(dims_items)
    by_key = table.entries[kernel]
    key = shape_key(kernel, dtype, **dims)
    if key in by_key:
        return by_key[key]
    count = _COUNT_DIM[kernel]
    best = None
    for k, cfg in by_key.items():
        got, got_dtype = parse_key(kernel, k)
        same = got_dtype == dtype and all(got[d] == v for d, v in dims.items() if d != count)
        if same and got[count] >= dims[count] and (best is None or got[count] < best[0]):
            best = (got[count], cfg)
    return None if best is None else best[1]


def reload() -> None:
    """Forget the tables read so far (after writing one, or changing COMPOSER_TUNED_*)."""
    _load.cache_clear()
    _lookup.cache_clear()
