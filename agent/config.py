"""Agent configuration: one dataclass, validated at construction, filled from four places.

Strongest first: command-line flags, environment (`COMPOSER_BASE_URL`, `COMPOSER_MODEL`,
`COMPOSER_API_KEY`, `COMPOSER_CONTEXT_WINDOW`), the repository's `.composer/config.toml`, the user's
`~/.config/composer/config.toml` (or `$XDG_CONFIG_HOME/composer/config.toml`). Config files use the
field names below as top-level keys, plus an optional `[lint]` table mapping globs to commands and
`[mcp_servers.NAME]` tables (agent/mcp_client.py); a repository's server replaces the user's of the same name.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from agent.errors import ConfigError as ConfigError  # raised here; importers take it from either

APPROVALS = ("auto", "ask", "read-only")
ENV = {"base_url": "COMPOSER_BASE_URL", "model": "COMPOSER_MODEL", "api_key": "COMPOSER_API_KEY",
       "context_window": "COMPOSER_CONTEXT_WINDOW"}
DEFAULT_CONTEXT_WINDOW = 128_000


@dataclass
class Config:
    base_url: str = "http://127.0.0.1:8000/v1"
    """OpenAI-compatible endpoint, up to and including the version segment (…/v1)."""
    model: str | None = None
    """Model name; None picks the first model the server lists."""
    api_key: str | None = None
    """Bearer token for the server, if it needs one."""
    context_window: int | None = None
    """Tokens the model can attend to; None asks the server (`max_model_len`), else 128k."""
    summarize_at: float = 0.8
    """Fraction of the context window at which the conversation is summarised."""
    max_turns: int = 100
    """Model requests per run before it stops with status max_turns."""
    max_time_s: float | None = None
    """Wall-clock limit for a run, in seconds."""
    token_budget: int | None = None
    """Limit on prompt + completion tokens over a run."""
    temperature: float | None = None
    """Sampling temperature sent to the server (None: the server's default)."""
    max_output_tokens: int | None = None
    """`max_tokens` per model response (None: the server's default)."""
    seed: int | None = None
    """Sampling seed sent with every request (servers that honour it, composer-serve and vLLM, then
    sample reproducibly); None sends none. Eval runs of one model under two seeds are two samples."""
    record_tokens: bool = False
    """Ask the server for the sampled token ids and logprobs and write them into the session, so a
    trajectory trains without re-tokenising (RL). Needs composer-serve or vLLM >= 0.10.2."""
    approval: str = "auto"
    """auto: tools run without asking; ask: shell and writes need a yes; read-only: they are refused."""
    sandbox: bool = False
    """Run shell commands under bubblewrap (no network, writes only in the workspace)."""
    request_timeout_s: float = 600.0
    """Longest wait for the next streamed chunk from the server."""
    max_retries: int = 5
    """Retries on connection errors, 429 and 5xx, with exponential backoff."""
    malformed_retries: int = 2
    """Turns in a row whose tool call could not be parsed that the model is told so and asked again;
    one more ends the run with status error, error_kind malformed_tool_call."""
    linters: dict[str, str] = field(default_factory=dict)
    """Extra linters for the lint tool: glob -> command (`{paths}` is replaced by the files)."""
    add_dirs: list[str] = field(default_factory=list)
    """Folders outside the workspace that tools may also read and write (relative to the workspace)."""
    mcp_servers: dict[str, dict[str, Any]] = field(default_factory=dict)
    """MCP servers whose tools are added to ours: name -> table (see agent/mcp_client.ServerConfig)."""
    builtin_model: bool = field(default=False, metadata={"internal": True})
    """Set by composer-agent when it serves the small built-in model itself (no endpoint configured); not a
    configuration key. Front-ends then say so where a person looks, and label the model's claims unverified."""

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ConfigError(f"base_url must start with http:// or https://, got {self.base_url!r}")
        self.base_url = self.base_url.rstrip("/")
        if self.approval not in APPROVALS:
            raise ConfigError(f"approval must be one of {', '.join(APPROVALS)}, got {self.approval!r}")
        if self.context_window is not None and self.context_window < 1024:
            raise ConfigError(f"context_window must be at least 1024 tokens, got {self.context_window}")
        if not 0.1 <= self.summarize_at <= 0.95:
            raise ConfigError(f"summarize_at must be between 0.1 and 0.95, got {self.summarize_at}")
        if self.max_turns < 1:
            raise ConfigError(f"max_turns must be at least 1, got {self.max_turns}")
        if not isinstance(self.record_tokens, bool):  # TOML `"true"` would otherwise count as on
            raise ConfigError(f"record_tokens must be true or false, got {self.record_tokens!r}")
        if not isinstance(self.add_dirs, list) or not all(isinstance(d, str) for d in self.add_dirs):
            raise ConfigError(f"add_dirs must be a list of folder paths, got {self.add_dirs!r}")
        if self.mcp_servers:
            from agent.mcp_client import parse_servers  # light: the SDK itself loads only to connect

            parse_servers(self.mcp_servers)

    def extra_roots(self, root: Path) -> tuple[Path, ...]:
        """`add_dirs` resolved against the workspace root; each must be an existing folder."""
        out = []
        for d in self.add_dirs:
            path = (root / os.path.expanduser(d)).resolve()
            if not path.is_dir():
                raise ConfigError(f"added folder {d} is not a directory")
            out.append(path)
        return tuple(out)


def user_config_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    return Path(base) / "composer"


def load_config(cwd: Path, flags: dict[str, Any] | None = None, env: dict[str, str] | None = None,
                defaults: dict[str, Any] | None = None) -> Config:
    """Merge defaults < user file < repo file < environment < flags (None in flags means "not given").

    `defaults` are a front-end's own defaults over the dataclass's, e.g. the interactive interfaces ask
    before shell and writes unless a config file or flag chose another approval mode."""
    env = os.environ if env is None else env
    merged: dict[str, Any] = dict(defaults or {})
    for path in (user_config_dir() / "config.toml", cwd / ".composer" / "config.toml"):
        data = _read_toml(path)
        servers = data.pop("mcp_servers", None)
        merged.update(data)
        if servers is not None:  # merged per server, not replaced as a whole
            merged["mcp_servers"] = {**merged.get("mcp_servers", {}), **servers}
    for key, var in ENV.items():
        if env.get(var):
            merged[key] = env[var]
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    if "add_dirs" in flags:  # --add-dir adds to the configured folders
        flags["add_dirs"] = [*merged.get("add_dirs", []), *flags["add_dirs"]]
    merged.update(flags)
    known = {f.name for f in fields(Config) if not f.metadata.get("internal")}
    unknown = set(merged) - known
    if unknown:
        raise ConfigError(f"unknown configuration key(s): {', '.join(sorted(unknown))}")
    for key in ("context_window", "max_turns", "token_budget", "max_output_tokens", "max_retries"):
        if isinstance(merged.get(key), str):
            try:
                merged[key] = int(merged[key])
            except ValueError:
                raise ConfigError(f"{key} must be an integer, got {merged[key]!r}") from None
    return Config(**merged)


def endpoint_source(cwd: Path, flags: dict[str, Any] | None = None, env: dict[str, str] | None = None) -> str | None:
    """Where base_url is set (a flag, the environment or a config file), or None: then composer-agent
    serves its small built-in model instead of assuming a server on the default address."""
    env = os.environ if env is None else env
    if (flags or {}).get("base_url"):
        return "--base-url"
    if env.get(ENV["base_url"]):
        return ENV["base_url"]
    for path in (cwd / ".composer" / "config.toml", user_config_dir() / "config.toml"):
        if "base_url" in _read_toml(path):
            return str(path)
    return None


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError:
        return {}
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    lint = data.pop("lint", None)
    if lint is not None:
        if not isinstance(lint, dict) or not all(isinstance(v, str) for v in lint.values()):
            raise ConfigError(f"{path}: [lint] must map globs to command strings")
        data["linters"] = lint
    servers = data.get("mcp_servers")
    if servers is not None and not isinstance(servers, dict):
        raise ConfigError(f"{path}: mcp_servers must be a table of servers ([mcp_servers.NAME])")
    return data
