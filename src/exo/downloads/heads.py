"""Recovering a stripped MTP head: fetch it from the official repo, convert it, check it, keep it.

Every mlx-community conversion drops ``mtp.*``. When a card names the official repo (``source_repo``),
exo reads that repo's index to find the shard(s) holding ``mtp.*`` (the parent process fetches only
those, see ``pull.py``), then here, with MLX:

1. reads the head's tensors and converts them with the loader's own code (``sanitize_head_weights``):
   the ``+1`` norm shift when the source is zero-centred (by provenance: the shard's metadata, as the
   loader decides for a sidecar), experts per expert or fused stacked into ``switch_mlp``;
2. keeps the source dtype (bf16), or quantizes the head like the backbone when asked;
3. builds the head against the loaded backbone (``build_head``: names and shapes must fit);
4. measures its agreement: greedy continuations of a few prompts decoded with MTP at depth 1, the
   fraction of drafts (the head's top-1) that the backbone's next-next token confirms;
5. at or above ``AGREEMENT_THRESHOLD`` writes the sidecar ``mtp.safetensors`` the loader reads (MLX
   layout, metadata saying where it came from); below it writes ``mtp_recovery.json`` with the reason
   instead, which the loader then reports as ``head_status.reason`` while the model runs plain.

A pipeline's last stage has the head's neighbours (embedding, final norm, lm_head) but not every backbone
layer, so step 4 cannot run where it downloads: its node does steps 1-3 and writes the head as
``mtp.pending.safetensors`` (``recover_head(pending=True)``), a name the loader does not read. The
pipeline's leader, once every stage is up, runs step 4 through the pipeline and step 5 on its result
(``check_pending_head``): the pending file becomes the sidecar, or is deleted and the note says why.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal, cast

import mlx.core as mx
from mlx.utils import tree_flatten

from exo.engine.convert import quantize_head
from exo.engine.forward import Forward
from exo.engine.generate import Engine, EngineConfig
from exo.engine.loader import (
    HEAD_PREFIXES,
    HEAD_RECOVERY_NOTE,
    SIDECAR_NAMES,
    HeadStatus,
    LoadedModel,
    MTPHeadError,
    NormConvention,
    build_head,
    recovery_note_reason,
    sanitize_head_weights,
)
from exo.engine.loader import _sidecar_convention as metadata_norm_convention
from exo.engine.models.mtp import MTPHead
from exo.engine.request import GenerationRequest

SIDECAR = SIDECAR_NAMES[0]
PENDING_SIDECAR = "mtp.pending.safetensors"  # converted on a pipeline's last stage, not yet checked
PENDING_REASON = ("not checked yet: this stage does not hold the whole backbone; the pipeline checks the head "
                  "when it starts and uses it only if it agrees with the backbone often enough")

# Agreement = acceptance at depth 1 on the backbone's own greedy continuations (VALIDATION_PROMPTS,
# VALIDATION_TOKENS each, 64-124 drafts). Measured by scripts/measure_head_agreement.py (CPU, mlx 0.32.4)
# on the bundled demo models and on the test fixtures (stripped MLX backbone + head from the raw repo):
#
#   head                        exo-demo  exo-demo-moe  qwen3_5  qwen3_5_moe  qwen3_6_moe  qwen3_next
#   good (bf16)                 0.79      0.78          0.73     1.00         1.00         0.85
#   good, 4-bit backbone        -         -             0.81     0.95         0.95         0.82
#   good, quantized head        -         -             0.79     0.94         0.94         0.88
#   random (untrained)          0.00      0.00          0.04     0.03         0.03         0.00
#   norm shift missed           0.00      0.00          0.08     0.00         0.00         0.03
#   norm shift applied twice    0.68      0.72          0.78     0.83         0.83         0.73
#   experts permuted            -         0.73          -        0.85         0.85         0.64
#   gate/up halves swapped      -         0.78          -        1.00         1.00         0.79
#
# Heads that do not work (random, zero-centred norms read as MLX ones) stay at or under 0.08; working
# heads reach 0.64 and more. A doubled norm shift or an expert mix-up barely hurts these small heads
# (their MoE MLP weighs little next to attention and the residual), so agreement cannot catch those here:
# the conversion's layout handling is checked against the loader by the tests instead, and such a head,
# while it agrees this well, still pays for itself. 0.3 sits between the groups with room on both sides
# (about 4 standard errors above 0.08 at ~120 drafts, half the weakest working head); real heads are
# published at 0.6-0.9 at depth 1, and below ~0.3 a draft would rarely pay for its verify anyway.
AGREEMENT_THRESHOLD = 0.3
VALIDATION_PROMPTS = (
    "Count from one to twenty.",
    "What is the capital of France?",
    "List the days of the week.",
    "Write a Python function that adds two numbers.",
)
VALIDATION_TOKENS = 32
MIN_DRAFTED = 16  # fewer drafts than this (every prompt ended at once) cannot tell a good head from a bad one

HeadRecoveryStatus = Literal["recovered", "refused", "pending"]


@dataclass(frozen=True)
class Agreement:
    rate: float
    drafted: int
    accepted: int


@dataclass(frozen=True)
class HeadSource:
    """The official repo's files holding the head (already in the cache)."""

    repo: str
    commit: str
    files: tuple[Path, ...]


@dataclass(frozen=True)
class RecoveredHead:
    status: HeadRecoveryStatus
    source_repo: str
    agreement: float | None
    threshold: float
    reason: str | None
    quantized: str | None = None  # "4bit-g64" when quantized like the backbone
    expert_layout: str | None = None
    sidecar: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def head_shards(weight_map: dict[str, str]) -> list[str]:
    """The files of an index (tensor -> file) that hold ``mtp.*`` tensors."""
    return sorted({file for name, file in weight_map.items() if name.startswith(HEAD_PREFIXES)})


def read_head_tensors(files: Sequence[Path]) -> tuple[dict[str, mx.array], NormConvention, str]:
    """The head's tensors (names relative to the head), their norm convention and their prefix."""
    tensors: dict[str, mx.array] = {}
    conventions: set[NormConvention] = set()
    prefix = ""
    for file in files:
        try:
            loaded = mx.load(str(file), return_metadata=True)  # lazy: only the head is read
            arrays, metadata = cast(tuple[dict[str, mx.array], dict[str, str]], loaded)
        except Exception as e:  # mlx raises RuntimeError / ValueError for unreadable files
            raise MTPHeadError(f"{file.name} is not a readable safetensors file: {e}") from None
        if not prefix:
            prefix = next((p for p in HEAD_PREFIXES if any(k.startswith(p) for k in arrays)), "")
        head_keys = [k for k in arrays if prefix and k.startswith(prefix)]
        if head_keys:
            conventions.add(metadata_norm_convention(metadata or {}))
        for key in head_keys:
            tensors[key[len(prefix) :]] = arrays[key]
    if not tensors:
        raise MTPHeadError(f"{', '.join(f.name for f in files)} hold no mtp.* tensors")
    if len(conventions) > 1:
        raise MTPHeadError("the head's shards disagree on their norm convention (mixed provenance)")
    return tensors, conventions.pop(), prefix


def head_weights(
    loaded: LoadedModel, source: HeadSource, quantize: bool
) -> tuple[dict[str, mx.array], str | None, str | None]:
    """The head in MLX layout and convention (names relative to the head), ready to save; its
    quantization ("4bit-g64") and expert layout."""
    raw, convention, _ = read_head_tensors(source.files)
    weights, layout = sanitize_head_weights(raw, convention)
    scheme = backbone_quantization(loaded.config) if quantize else None
    if scheme is None:
        return weights, None, layout
    bits, group_size = scheme
    head, _ = build_head(loaded.model, weights, "mlx", source.repo, fuse=False)  # saved: the checkpoint's names
    quantize_head(head, bits, group_size)
    dtype = weights["fc.weight"].dtype
    # The CPU backend computes gathered experts in float32 (loader.cpu_compatible); store the source dtype.
    parameters = cast(list[tuple[str, mx.array]], tree_flatten(head.parameters()))
    quantized = {
        name: value.astype(dtype) if mx.issubdtype(value.dtype, mx.floating) else value
        for name, value in parameters
    }
    return quantized, f"{bits}bit-g{group_size}", layout


def backbone_quantization(config: dict[str, Any]) -> tuple[int, int] | None:
    """(bits, group size) of an affine-quantized backbone; None when it is not quantized that way."""
    quant = config.get("quantization") or config.get("quantization_config")
    if not isinstance(quant, dict) or quant.get("mode", "affine") != "affine":
        return None
    bits, group_size = quant.get("bits"), quant.get("group_size")
    return (int(bits), int(group_size)) if isinstance(bits, int) and isinstance(group_size, int) else None


def validation_prompt(tokenizer: Any, text: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))
    return list(tokenizer.encode(text))


def measure_agreement(
    loaded: LoadedModel,
    head: MTPHead,
    prompts: Sequence[str] = VALIDATION_PROMPTS,
    max_tokens: int = VALIDATION_TOKENS,
    forward: Forward | None = None,
) -> Agreement:
    """How often the head's top-1 draft equals the backbone's next-next token: greedy decoding with MTP
    forced at depth 1 on ``prompts``, accepted drafts over drafted ones. ``forward``: the backbone runs
    through a pipeline (``PipelineForward``, ``loaded`` being its last stage); by default here."""
    # EOS does not end a validation run: a small model that stops at once would leave too few drafts to
    # judge, and what follows EOS is still the backbone's own greedy continuation.
    candidate = replace(
        loaded, head=head, head_status=HeadStatus(available=True, source="candidate"), eos_token_ids=frozenset()
    )
    engine = Engine(candidate, EngineConfig(native_mtp_enabled=True), forward=forward)
    drafted = accepted = 0
    for text in prompts:
        request = GenerationRequest(
            validation_prompt(loaded.tokenizer, text), max_tokens=max_tokens, native_mtp="on", mtp_k=1
        )
        stats = engine.complete(request).stats
        drafted += stats.drafted_tokens
        accepted += stats.accepted_tokens
    return Agreement(accepted / drafted if drafted else 0.0, drafted, accepted)


def recover_head(
    loaded: LoadedModel, source: HeadSource, *, quantize: bool = False, threshold: float = AGREEMENT_THRESHOLD,
    pending: bool = False,
) -> RecoveredHead:
    """Convert, check and keep (or refuse, with the reason) the head of ``source`` for ``loaded``.
    ``pending``: ``loaded`` is a pipeline's last stage: keep the converted head for the pipeline to check."""
    path = loaded.path
    quantized = layout = None
    try:
        weights, quantized, layout = head_weights(loaded, source, quantize)
        head, _ = build_head(loaded.model, weights, "mlx", f"{source.repo} (recovered)")
    except MTPHeadError as e:
        return _refuse(path, source, threshold, None, f"the head in {source.repo} cannot be used: {e}", quantized)
    metadata = {
        "format": "mlx",
        "exo.norm_convention": "mlx",
        "exo.source_repo": source.repo,
        "exo.source_commit": source.commit,
        "exo.source_files": ",".join(f.name for f in source.files),
        "exo.head_quantization": quantized or "none",
    }
    if pending:
        _atomic_write(path / PENDING_SIDECAR, lambda tmp: mx.save_safetensors(
            str(tmp), {f"mtp.{k}": v for k, v in weights.items()}, metadata=metadata))
        return RecoveredHead(
            "pending", source.repo, None, threshold, PENDING_REASON, quantized, layout, str(path / PENDING_SIDECAR)
        )
    agreement = measure_agreement(loaded, head)
    reason = _verdict(agreement, source.repo, threshold)
    if reason is not None:
        return _refuse(path, source, threshold, agreement.rate, reason, quantized)
    metadata["exo.head_agreement"] = f"{agreement.rate:.4f}"
    _atomic_write(path / SIDECAR, lambda tmp: mx.save_safetensors(
        str(tmp), {f"mtp.{k}": v for k, v in weights.items()}, metadata=metadata))
    (path / HEAD_RECOVERY_NOTE).unlink(missing_ok=True)
    (path / PENDING_SIDECAR).unlink(missing_ok=True)
    return RecoveredHead(
        "recovered", source.repo, agreement.rate, threshold, None, quantized, layout, str(path / SIDECAR)
    )


def check_pending_head(
    loaded: LoadedModel, forward: Forward | None = None, threshold: float = AGREEMENT_THRESHOLD
) -> LoadedModel:
    """On a pipeline's leader (``forward``: its ``PipelineForward``), or wherever the whole backbone runs:
    measure the agreement of a head ``recover_head(pending=True)`` left, then keep it (it becomes the
    sidecar) or refuse it (deleted; the note, and ``head_status.reason``, say why). ``loaded`` unchanged
    when it has a head already or none is pending."""
    path = loaded.path
    pending = path / PENDING_SIDECAR
    if loaded.head is not None or loaded.tokenizer is None or not pending.is_file():
        return loaded
    arrays, metadata = cast(tuple[dict[str, mx.array], dict[str, str]], mx.load(str(pending), return_metadata=True))
    metadata = metadata or {}
    repo = metadata.get("exo.source_repo", "its source repo")
    files = tuple(Path(name) for name in metadata.get("exo.source_files", "").split(",") if name)
    source = HeadSource(repo, metadata.get("exo.source_commit", ""), files)
    weights = {k.removeprefix("mtp."): v for k, v in arrays.items()}
    try:
        head, status = build_head(loaded.model, weights, "mlx", f"{path.name} (sidecar)")
    except MTPHeadError as e:
        reason, rate = f"the head recovered from {repo} cannot be used: {e}", None
    else:
        agreement = measure_agreement(loaded, head, forward=forward)
        reason, rate = _verdict(agreement, repo, threshold), agreement.rate
    if reason is None:
        try:
            os.replace(pending, path / SIDECAR)
        except FileNotFoundError:  # another leader of this model got there first, with the same head
            pass
        (path / HEAD_RECOVERY_NOTE).unlink(missing_ok=True)
        return replace(loaded, head=head, head_status=status)
    _refuse(path, source, threshold, rate, reason, metadata.get("exo.head_quantization"))
    pending.unlink(missing_ok=True)
    return replace(loaded, head=None, head_status=HeadStatus(available=False, reason=recovery_note_reason(path)))


def _verdict(agreement: Agreement, repo: str, threshold: float) -> str | None:
    """Why a head that agrees this often is refused; None: it is kept."""
    if agreement.drafted < MIN_DRAFTED:
        return (
            f"the head recovered from {repo} could not be checked: the validation prompts gave "
            f"only {agreement.drafted} drafts"
        )
    if agreement.rate < threshold:
        return (
            f"the head recovered from {repo} agrees with the backbone on {agreement.rate:.0%} of "
            f"next-next tokens ({agreement.accepted}/{agreement.drafted}), below the {threshold:.0%} a working "
            "head reaches: it does not belong to this model or its conversion is wrong"
        )
    return None


def _refuse(
    path: Path, source: HeadSource, threshold: float, rate: float | None, reason: str, quantized: str | None
) -> RecoveredHead:
    note = {"status": "refused", "source_repo": source.repo, "source_commit": source.commit,
            "agreement": rate, "threshold": threshold, "reason": reason}
    _atomic_write(path / HEAD_RECOVERY_NOTE, lambda tmp: tmp.write_text(json.dumps(note, indent=2) + "\n"))
    return RecoveredHead("refused", source.repo, rate, threshold, reason, quantized)


def _atomic_write(final: Path, write: Any) -> None:
    """Write through a temporary file in the same directory and rename it: readers never see half."""
    fd, name = tempfile.mkstemp(dir=final.parent, prefix=f".{final.stem}.", suffix=final.suffix or ".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        tmp.chmod(0o644)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
