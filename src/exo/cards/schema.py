"""ModelCard: the declarative description of one runnable model (one TOML file in `model_cards/`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import ErrorDetails

# The tokens of attention KV an instance reserves room for (at most the model's context for placement):
# one long sequence, or the sequences of a batch together (exo.runner.device admits by it).
CONTEXT_BUDGET_TOKENS = 32768
# What placement counts for a loaded instance's activations beyond its weights and KV (exo.cluster.placement),
# and what a runner keeps free for them (its prefix cache's RAM tier takes none of it).
ACTIVATION_MARGIN_BYTES = 512 << 20

# mlx-lm `model_type`s this project runs.
Arch = Literal["qwen3_5", "qwen3_5_moe", "qwen3_next"]

# Lowercase slug; dots are allowed because model families carry them ("qwen3.5-27b-4bit").
SLUG_PATTERN = r"^[a-z0-9][a-z0-9._-]*$"
# Hugging Face "owner/name".
REPO_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$"
QUANTIZATION_PATTERN = r"^([1-8]bit|bf16|fp16|fp32|mxfp[468]|nvfp4)$"

MAX_DRAFT_DEPTH = 8

# The vocabulary of each family (the official configs' vocab_size): Qwen3.5 / 3.6 dense and MoE 248320,
# Qwen3-Next the Qwen3 tokenizer's 151936. A card's vocab_size overrides it.
ARCH_VOCAB: dict[str, int] = {"qwen3_5": 248320, "qwen3_5_moe": 248320, "qwen3_next": 151936}


class CardError(ValueError):
    """An invalid model card. Names the file (when there is one) and the offending field."""

    def __init__(self, path: Path | str | None, field: str | None, message: str) -> None:
        self.path = Path(path) if path is not None else None
        self.field = field
        self.message = message
        where = str(self.path) if self.path is not None else "model card"
        super().__init__(f"{where}: {field}: {message}" if field else f"{where}: {message}")

    @classmethod
    def from_validation_error(cls, path: Path | str | None, error: ValidationError) -> CardError:
        """One CardError for a pydantic error: the first problem's field, every problem in the message."""
        problems = [_describe(e) for e in error.errors()]
        first_field = ".".join(str(p) for p in error.errors()[0]["loc"]) or None
        message = problems[0][1] if len(problems) == 1 else "; ".join(f"{f}: {m}" for f, m in problems)
        return cls(path, first_field, message)


def _describe(err: ErrorDetails) -> tuple[str, str]:
    field = ".".join(str(p) for p in err["loc"]) or "card"
    if err["type"] == "extra_forbidden":
        model = NativeMTPCard if err["loc"][:1] == ("native_mtp",) else ModelCard
        allowed = ", ".join(model.model_fields)
        return field, f"unknown key {err['loc'][-1]!r} (allowed keys: {allowed})"
    if err["type"] == "missing":
        return field, "required key is missing"
    return field, f"{err['msg']} (got {err.get('input')!r})"


class NativeMTPCard(BaseModel):
    """The model's native MTP head: where it lives and how deep to draft with it."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    num_layers: int = Field(ge=1)
    # max_k is declared before default_k so default_k's validator can compare against it.
    max_k: int = Field(ge=1, le=MAX_DRAFT_DEPTH)
    default_k: int = Field(ge=0)
    # Official repo whose last shard holds `mtp.*`; None: the head is in the model's own weights.
    source_repo: str | None = Field(default=None, pattern=REPO_PATTERN)

    @field_validator("default_k")
    @classmethod
    def _default_within_max(cls, value: int, info: ValidationInfo) -> int:
        max_k = info.data.get("max_k")
        if max_k is not None and value > max_k:
            raise ValueError(f"default_k ({value}) must be <= max_k ({max_k})")
        return value


class ModelCard(BaseModel):
    """One model: what to download (or which bundled model), its shape, and its native MTP head."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    id: str = Field(pattern=SLUG_PATTERN)
    name: str = Field(min_length=1)
    arch: Arch
    repo: str | None = Field(default=None, pattern=REPO_PATTERN)
    # validate_default so "neither repo nor bundled" is caught even when the key is absent.
    bundled: str | None = Field(default=None, pattern=SLUG_PATTERN, validate_default=True)
    n_layers: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    kv_heads: int = Field(ge=1)
    head_dim: int | None = Field(default=None, ge=1)
    full_attention_interval: int = Field(default=4, ge=1)
    context_length: int = Field(ge=1)
    storage_bytes: int = Field(ge=1)
    quantization: str | None = Field(default=None, pattern=QUANTIZATION_PATTERN)
    # The token vocabulary (config.json's vocab_size); None: the family's (ARCH_VOCAB). Placement estimates
    # the embedding and lm_head from it while no node has the checkpoint's headers to read.
    vocab_size: int | None = Field(default=None, ge=1)
    # TOML arrays arrive as lists; a tuple keeps the frozen card hashable.
    tags: tuple[str, ...] = Field(default=(), strict=False)
    native_mtp: NativeMTPCard | None = None
    # Whether exo may split the model by tensor (a slice of every layer per node: engine/sharding.py). false: the
    # sharding rules do not cover its architecture, and a request for tensor sharding gets a 400.
    tensor_sharding: bool = True

    @field_validator("bundled")
    @classmethod
    def _exactly_one_source(cls, value: str | None, info: ValidationInfo) -> str | None:
        if "repo" not in info.data:  # repo itself failed validation; that error is enough
            return value
        if (info.data["repo"] is None) == (value is None):
            raise ValueError(
                "exactly one of `repo` (Hugging Face repo) or `bundled` (shipped model) is required"
            )
        return value

    @field_validator("tags")
    @classmethod
    def _tags_are_slugs(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for tag in value:
            if not tag or tag != tag.lower() or " " in tag:
                raise ValueError(f"tag {tag!r} must be a lowercase word without spaces")
        return value

    @property
    def is_moe(self) -> bool:
        return self.arch in ("qwen3_5_moe", "qwen3_next")

    @property
    def full_attention_layers(self) -> int:
        # mlx-lm: layer i is full attention when (i + 1) % full_attention_interval == 0; the rest are
        # GatedDeltaNet layers with a fixed-size state that does not grow with the sequence.
        return self.n_layers // self.full_attention_interval

    @property
    def vocab(self) -> int:
        return self.vocab_size if self.vocab_size is not None else ARCH_VOCAB[self.arch]

    @property
    def bytes_per_weight(self) -> float:
        """Bytes one weight of a linear or embedding takes at the card's quantization: MLX affine N-bit with
        a bf16 scale and bias per group of 64, mxfp with one byte of scale per 32, nvfp4 per 16."""
        q = self.quantization
        if q is None or q in ("bf16", "fp16"):
            return 2.0
        if q == "fp32":
            return 4.0
        if q.startswith("mxfp"):
            return int(q[4:]) / 8 + 1 / 32
        if q == "nvfp4":
            return 0.5 + 1 / 16
        return int(q[:-3]) / 8 + 4 / 64  # "Nbit"

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV-cache bytes one token of context costs (keys + values of the full-attention layers)."""
        if self.head_dim is None:
            raise CardError(
                None, "head_dim", f"card {self.id!r} has no head_dim; add it from the model's config.json"
            )
        return 2 * self.full_attention_layers * self.kv_heads * self.head_dim * dtype_bytes
