"""Server settings: command-line flags override TMOD_* environment variables override defaults."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from modules_store import DEFAULT_STORE


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TMOD_", extra="ignore")

    host: str = Field("127.0.0.1", description="interface to bind")
    port: int = Field(8080, ge=0, le=65535, description="port to bind (0 = any free port)")
    store: Path = Field(DEFAULT_STORE, description="module store directory")
    backbone: Path | None = Field(None, description="local Hugging Face model directory (default: all-MiniLM-L6-v2)")
    device: str = Field("cpu", description="torch device for backbone and heads")
    tasks: str | None = Field(None, description="comma-separated tasks to load at start (default: every task in the store)")
    threads: int | None = Field(None, ge=1, description="torch intra-op threads, and ONNX Runtime's with backend onnx (default: the library's choice)")
    backend: Literal["torch", "onnx"] = Field(
        "torch", description="what runs the backbone's layers: torch (PyTorch eager) or onnx (ONNX Runtime, "
        "one exported graph per layer, cached under cache_dir)")
    precision: Literal["fp32", "int8"] = Field(
        "fp32", description="backbone precision: fp32, or int8 (dynamic quantisation; backend onnx on the CPU only)")
    cache_dir: Path | None = Field(None, description="where exported backbone graphs are cached "
                                   "(default: $XDG_CACHE_HOME/tmod, else ~/.cache/tmod)")
    max_inputs: int = Field(64, ge=1, description="most inputs in one request (413 above)")
    max_chars: int = Field(20_000, ge=1, description="most characters in one input text (413 above)")
    max_tokens: int | None = Field(None, ge=8, description="most tokens per input (default: the backbone's limit)")
    max_body_bytes: int = Field(2_000_000, ge=1024, description="largest request body in bytes (413 above)")
    batching: bool = Field(True, description="batch concurrent requests into one backbone pass")
    max_batch_tokens: int = Field(16384, ge=1, description="padded tokens per backbone pass (rows x longest)")
    max_batch_size: int = Field(128, ge=1, description="most inputs per backbone pass")
    max_padding_ratio: float = Field(
        1.25, ge=1.0, description="a batch is cut into length runs whose padded tokens stay within this "
        "factor of their real tokens, one backbone pass each (a large value: one pass per batch)")
    max_wait_ms: float = Field(2.0, ge=0, description="how long a batch waits for more requests after its first")
    max_queue: int = Field(256, ge=1, description="requests waiting for compute; beyond this, 429 at once")
    request_timeout_s: float = Field(30.0, gt=0, description="a request still queued after this is answered 503")
    admin_token: str | None = Field(None, description="bearer token for /admin endpoints (unset: admin disabled)")
    log_level: str = Field("info", description="uvicorn log level")

    @model_validator(mode="after")
    def _precision_fits_backend(self) -> "Settings":
        if self.precision != "fp32" and self.backend == "torch":
            raise ValueError(f"precision {self.precision} needs backend onnx (backend torch runs fp32)")
        return self

    def task_list(self) -> list[str]:
        return [t.strip() for t in (self.tasks or "").split(",") if t.strip()]
