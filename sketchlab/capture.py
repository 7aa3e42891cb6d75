"""Capture Q/K (and V) from a PyTorch or transformers model: what its attention multiplies.

:func:`capture_qk` runs one forward pass and returns a :class:`~sketchlab.io.QKDump` of layout
``[L, H, n, d]`` whose ``n`` tokens are the valid tokens of all input sequences, concatenated in
batch order (padding, i.e. ``attention_mask == 0``, is dropped; ``meta["tokens"]`` lists each
sequence's length). Grouped-query ``k``/``v`` heads are repeated to the ``q`` heads as the
attention does (``q`` head ``h`` uses kv head ``h // (H / H_kv)``). No ``1/√d`` scaling is
applied (``meta["scale"] = "none"``).

What is captured (``point=``; recorded in ``meta["captured"]``)
---------------------------------------------------------------
``"attention"`` (the default wherever it applies)
    The ``(q, k, v)`` the attention function receives: after the projections *and* the rotary
    embedding, before the ``1/√d`` logit scale — the kernel the attention really multiplies.
    transformers models: a function registered through transformers' ``AttentionInterface``
    records its arguments and calls the model's own attention implementation (the outputs are
    unchanged; no modelling code is copied). sketchlab's :class:`~sketchlab.tasks.model.TransformerLM`
    (or explicit ``attention`` modules): hooks on the pluggable kernel. ``meta["captured"]`` is
    ``"post-rope"`` for rotary models (LLaMA, Qwen2, Mistral, SmolLM, sketchlab's model) and
    ``"attention-inputs"`` for the others (BERT, GPT-2: absolute positions are added to the
    embeddings, so these equal the projections).
``"projections"`` (transformers models, explicit ``q``/``k``/``v`` or ``qkv`` modules)
    Forward hooks on the *outputs of the projection layers*, split into heads: BERT-style
    ``query``/``key``/``value``, GPT-2 ``c_attn`` (split into thirds), LLaMA-style
    ``q_proj``/``k_proj``/``v_proj``. For rotary models this is *before* RoPE
    (``meta["captured"] = "pre-rope"``; ``"projections"`` otherwise).

Models are run under ``torch.no_grad()`` in eval mode (dropout off); the previous train/eval
mode is restored afterwards.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from ._validation import check_positive_int
from .hf.families import FAMILY_TABLE, Family, config_int
from .hf.interface import (
    attention_implementation,
    is_rotary,
    original_attention,
    original_mask,
    register,
    supports_interface,
)
from .hf.pretrained import from_local, load_pretrained
from .io import QKDump, save_qk, validate_qk

__all__ = ["CAPTURE_POINTS", "capture_pretrained", "capture_qk", "detect_qk_modules", "position_limit", "read_token_ids",
           "split_sequences"]

#: Values of ``capture_qk(point=...)``.
CAPTURE_POINTS = ("auto", "attention", "projections")
#: The name sketchlab's recording function is registered under in transformers' interfaces.
_CAPTURE_NAME = "sketchlab_capture"
_RECORDERS: list[_Recorder] = []  # the capture in progress (innermost last)

def detect_qk_modules(model: nn.Module, *, projections: bool = False) -> tuple[str, dict[str, list[str]]]:
    """Find the q/k/v producers of each layer by module name.

    Returns ``(kind, {"q": [...], "k": [...], "v": [...]})`` (or ``{"qkv": [...]}`` for GPT-2,
    ``{"attention": [...]}`` for sketchlab's TransformerLM unless ``projections``), names in layer order;
    ``kind`` is ``"attention-inputs"`` (the kernels' inputs) or ``"projections"``.

    Raises ``ValueError`` listing what was looked for when no known pattern matches: pass
    ``modules=`` explicitly then.
    """
    from .tasks.model import CausalSelfAttention

    kernels = [f"{name}.attn" for name, m in model.named_modules() if isinstance(m, CausalSelfAttention)]
    if kernels and not projections:
        return "attention-inputs", {"attention": kernels}
    names = [name for name, _ in model.named_modules()]
    for roles in (family.projections for family in FAMILY_TABLE.values()):
        found: dict[str, list[str]] = {role: [] for role in roles.values()}
        for name in names:
            last = name.rsplit(".", 1)[-1]
            if last in roles and not _is_cross_attention(name):
                found[roles[last]].append(name)
        if all(found.values()) and len({len(v) for v in found.values()}) == 1:
            return "projections", found
    raise ValueError(
        f"capture_qk: could not find the q/k projections of {type(model).__name__} (looked for modules named "
        f"query/key/value (BERT), c_attn (GPT-2), q_proj/k_proj/v_proj (LLaMA) or sketchlab attention kernels); "
        f"pass modules={{'q': [...], 'k': [...]}} with one module (or name) per layer"
    )


def _is_cross_attention(name: str) -> bool:
    return "crossattention" in name or "cross_attn" in name or "encoder_attn" in name


def _resolve(model: nn.Module, items, role: str) -> list[tuple[str, nn.Module]]:
    if isinstance(items, (str, nn.Module)) or not isinstance(items, Sequence) or not items:
        raise ValueError(f"modules[{role!r}] must be a non-empty list with one module or module name per layer, got {items!r}")
    by_name = dict(model.named_modules())
    by_id = {id(m): n for n, m in model.named_modules()}
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            if item not in by_name:
                raise ValueError(f"modules[{role!r}][{i}]: {type(model).__name__} has no submodule named {item!r}")
            out.append((item, by_name[item]))
        elif isinstance(item, nn.Module):
            out.append((by_id.get(id(item), f"<{type(item).__name__}>"), item))
        else:
            raise TypeError(f"modules[{role!r}][{i}] must be a module or a module name, got {type(item).__name__}")
    return out


def _heads(x: torch.Tensor, heads: int, what: str) -> torch.Tensor:
    """``[B, T, heads·D]`` (or ``[B, T, heads, D]``) -> ``[B, T, heads, D]``."""
    if x.ndim == 4:
        if x.shape[2] != heads:
            raise ValueError(f"{what}: captured [B, T, H, D] output has H={x.shape[2]}, expected {heads}")
        return x
    if x.ndim != 3:
        raise ValueError(f"{what}: expected a [B, T, features] output, got shape {tuple(x.shape)}")
    B, T, F = x.shape
    if F % heads:
        raise ValueError(f"{what}: output width {F} is not divisible by {heads} heads")
    return x.reshape(B, T, heads, F // heads)  # [B, T, H, D]


class _Recorder:
    """The q, k, v of one forward pass, in the order the attention modules are called."""

    def __init__(self, original: str):
        self.original = original
        self.order: dict[int, int] = {}  # id(module) -> layer
        self.names: list[str] = []
        self.records: dict[str, dict[int, torch.Tensor]] = {"q": {}, "k": {}, "v": {}}


def _record_attention(module, query, key, value, attention_mask, *args, **kwargs):
    """Registered in transformers' ``AttentionInterface``: record ``query [B, H, T, D]``,
    ``key``/``value [B, H_kv, S, D]`` (post-RoPE), then run the model's own implementation."""
    rec = _RECORDERS[-1]
    if id(module) in rec.order:
        raise ValueError(f"capture_qk: attention module {type(module).__name__} was called twice in one forward pass")
    layer = rec.order[id(module)] = len(rec.order)
    rec.names.append(type(module).__name__)
    for r, x in zip("qkv", (query, key, value)):
        rec.records[r][layer] = x.detach().transpose(1, 2)  # [B, T, H', D]
    return original_attention(module, rec.original)(module, query, key, value, attention_mask, *args, **kwargs)


def _record_mask(*args, **kwargs):
    """The mask of the implementation being recorded (registered beside :func:`_record_attention`)."""
    return original_mask(_RECORDERS[-1].original)(*args, **kwargs)


def _forward(model: nn.Module, inputs) -> None:
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            if isinstance(inputs, Mapping):
                model(**inputs)
            elif isinstance(inputs, (tuple, list)):
                model(*inputs)
            else:
                model(inputs)
    finally:
        model.train(was_training)


def _capture_interface(model: nn.Module, inputs) -> tuple[dict, list[str]]:
    """Run ``model`` once with :func:`_record_attention` as its attention implementation."""
    register(_CAPTURE_NAME, _record_attention, _record_mask)
    rec = _Recorder(model.config._attn_implementation)
    _RECORDERS.append(rec)
    try:
        with attention_implementation(model, _CAPTURE_NAME):
            _forward(model, inputs)
    finally:
        _RECORDERS.pop()
    if not rec.order:
        raise ValueError(f"capture_qk: {type(model).__name__}'s forward pass called no attention through "
                         "transformers' attention interface; pass point='projections'")
    return rec.records, [f"attention call {i} ({n})" for i, n in enumerate(rec.names)]


def capture_qk(
    model: nn.Module,
    inputs,
    *,
    modules: Mapping[str, Sequence] | None = None,
    point: str = "auto",
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    attention_mask: torch.Tensor | None = None,
    path=None,
    meta: Mapping[str, str] | None = None,
) -> QKDump:
    """Run ``model`` once and capture per-layer, per-head ``q``, ``k``, ``v``.

    Parameters
    ----------
    model : nn.Module
        A transformers model (BERT, GPT-2, LLaMA-style, auto-detected), a sketchlab
        ``TransformerLM`` (auto-detected), or any module when ``modules`` is given.
    inputs : Tensor, dict or tuple
        ``model(inputs)``, ``model(**inputs)`` or ``model(*inputs)``; a dict's
        ``"attention_mask"`` marks the valid tokens.
    modules : dict, optional
        One entry per layer, modules or names: ``{"q": [...], "k": [...], "v": [...]}`` (outputs
        ``[B, T, H·D]``; ``v`` optional), ``{"qkv": [...]}`` (one fused output split in thirds),
        or ``{"attention": [...]}`` (modules called as ``f(q, k, v)`` with ``[B, T, H, D]``).
    point : {"auto", "attention", "projections"}
        Where to capture (module docstring): ``"attention"`` records what the attention function
        receives (post-RoPE for rotary models; transformers models through the attention
        interface, sketchlab's model through its kernel); ``"projections"`` the projection
        outputs (pre-RoPE); ``"auto"``: ``"attention"`` wherever it applies (transformers models
        that dispatch through the interface, sketchlab's model), else the projections.
    num_heads, num_kv_heads : int, optional
        Heads of q and of k/v; default from ``model.config`` (``num_attention_heads`` and
        ``num_key_value_heads``; required otherwise for projection outputs). Each default is
        taken independently: passing only ``num_heads`` still uses the config's kv heads, and
        without either the kv heads equal the q heads. ``num_heads`` must be a multiple of
        ``num_kv_heads``. Not used by ``point="attention"`` (the attention receives heads).
    attention_mask : Tensor ``[B, T]``, optional
        Valid tokens (non-zero); overrides the one in ``inputs``.
    path : str or Path, optional
        Also write the dump there (:func:`sketchlab.io.save_qk`).
    meta : dict of str, optional
        Extra metadata merged over the recorded ``source``, ``captured``, ``scale``, ``modules``.

    Returns
    -------
    QKDump with ``q``, ``k``, ``v`` of shape ``[L, H, n, d]``, float32 (``v`` is ``None`` when
    no ``v`` producer is given), ``n`` = number of valid tokens over the batch, validated by
    :func:`sketchlab.io.validate_qk` (same shapes, finite values) whether or not ``path`` is given.
    """
    from .tasks.model import TransformerLM

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if point not in CAPTURE_POINTS:
        raise ValueError(f"point must be one of {list(CAPTURE_POINTS)}, got {point!r}")
    for value, name in ((num_heads, "num_heads"), (num_kv_heads, "num_kv_heads")):
        if value is not None:
            check_positive_int(value, name)
    interface = modules is None and point != "projections" and supports_interface(model)
    if point == "attention" and modules is None and not interface and not isinstance(model, TransformerLM):
        raise ValueError(f"point='attention': {type(model).__name__} is neither a transformers model whose attention "
                         "goes through its attention interface nor a sketchlab TransformerLM; pass "
                         "modules={'attention': [...]} or point='projections'")
    if interface:
        records, module_names = _capture_interface(model, inputs)
        kind = "post-rope" if is_rotary(model) else "attention-inputs"
        spec_names = {"attention": module_names}
        L = len(module_names)
    else:
        if modules is None:
            kind, names = detect_qk_modules(model, projections=point == "projections")
            spec = {role: _resolve(model, items, role) for role, items in names.items()}
            if kind == "attention-inputs":
                kind = "post-rope"  # sketchlab's TransformerLM applies RoPE before its kernel
            elif is_rotary(model):
                kind = "pre-rope"
        else:
            if not isinstance(modules, Mapping) or not modules:
                raise ValueError(f"modules must be a dict like {{'q': [...], 'k': [...]}}, got {modules!r}")
            allowed = ({"q", "k"}, {"q", "k", "v"}, {"qkv"}, {"attention"})
            if set(modules) not in allowed:
                raise ValueError(
                    f"modules must have keys q, k (and optionally v), or qkv, or attention; got {sorted(modules)}"
                )
            spec = {role: _resolve(model, items, role) for role, items in modules.items()}
            kind = "attention-inputs" if "attention" in spec else "projections"
        records, L = _capture_hooks(model, inputs, spec, num_heads, num_kv_heads)
        spec_names = {role: [n for n, _ in items] for role, items in spec.items()}

    for role in ("q", "k"):
        missing = [i for i in range(L) if i not in records[role]]
        if missing:
            raise ValueError(f"capture_qk: no {role} was captured for layers {missing}; did the forward pass use those modules?")
    if attention_mask is None and isinstance(inputs, Mapping):
        attention_mask = inputs.get("attention_mask")
    first = records["q"][0]
    B, T = first.shape[:2]
    valid = torch.ones(B, T, dtype=torch.bool) if attention_mask is None else attention_mask.to(torch.bool).cpu()
    if valid.shape != (B, T):
        raise ValueError(f"attention_mask must have shape [B, T] = {(B, T)}, got {tuple(valid.shape)}")

    def stack(role: str) -> torch.Tensor | None:
        if len(records[role]) != L:
            return None
        per_layer = []
        for i in range(L):
            x = records[role][i]  # [B, T, H', D]
            if x.shape[2] != first.shape[2]:
                if first.shape[2] % x.shape[2]:
                    raise ValueError(f"layer {i}: {role} has {x.shape[2]} heads, not a divisor of q's {first.shape[2]}")
                x = x.repeat_interleave(first.shape[2] // x.shape[2], dim=2)  # GQA: [B, T, H, D]
            per_layer.append(x.float().cpu()[valid].transpose(0, 1))  # [H, n, D]
        return torch.stack(per_layer)  # [L, H, n, D]

    q, k, v = stack("q"), stack("k"), stack("v")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"capture_qk: captured q has head dimension {q.shape[-1]} but k has {k.shape[-1]} "
            f"(split with num_heads={num_heads}, num_kv_heads={num_kv_heads}); pass the model's true num_heads / num_kv_heads"
        )
    q, k, v = validate_qk(q, k, v, where="capture_qk: captured")  # the dump rules, with or without path
    source = getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
    info = {
        "source": f"{type(model).__name__} ({source})" if source != type(model).__name__ else source,
        "captured": kind,
        "scale": "none",
        "modules": json.dumps(spec_names),
        "tokens": json.dumps([int(c) for c in valid.sum(1)]),
    }
    info.update(dict(meta or {}))
    dump = QKDump(q=q, k=k, v=v, meta={**info, "layout": "L,H,n,d"})
    if path is not None:
        dump.path = save_qk(Path(path), q, k, v, meta=info)
    return dump


def _capture_hooks(model, inputs, spec, num_heads, num_kv_heads) -> tuple[dict, int]:
    """Forward hooks on the producers in ``spec``; returns ``(records, L)``, records ``[B, T, H', D]`` (the head counts
    checked by :func:`capture_qk`)."""
    counts = {role: len(v) for role, v in spec.items()}
    if len(set(counts.values())) != 1:
        raise ValueError(f"modules must list one module per layer for every role, got counts {counts}")
    kind = "attention" if "attention" in spec else "projections"
    cfg = getattr(model, "config", None)  # head counts a transformers-style config states (the family table's names)
    cfg_heads, cfg_kv = config_int(cfg, Family.heads), config_int(cfg, Family.kv_heads)
    H = num_heads if num_heads is not None else cfg_heads
    # kv heads: explicit argument, else the config's num_key_value_heads (GQA) even when num_heads
    # was given, else as many as q heads (plain multi-head attention)
    Hkv = num_kv_heads if num_kv_heads is not None else (cfg_kv if cfg_kv is not None else H)
    if kind == "projections":
        if H is None:
            raise ValueError("num_heads is required: the model has no config with num_attention_heads")
        if Hkv is None or Hkv < 1 or H % Hkv:
            raise ValueError(f"num_heads ({H}) must be a positive multiple of num_kv_heads ({Hkv})")

    records: dict[str, dict[int, torch.Tensor]] = {"q": {}, "k": {}, "v": {}}

    def hook_for(role: str, layer: int, name: str):
        def hook(module, args, output):
            if role == "attention":
                if len(args) < 3:
                    raise ValueError(f"{name}: attention module was called with {len(args)} positional args, expected (q, k, v)")
                for r, x in zip("qkv", args[:3]):
                    records[r][layer] = _heads(x.detach(), x.shape[2], f"{name} ({r})")
                return
            out = output[0] if isinstance(output, (tuple, list)) else output
            out = out.detach()
            if role == "qkv":
                if out.shape[-1] % 3:
                    raise ValueError(f"{name}: fused qkv output width {out.shape[-1]} is not divisible by 3")
                for r, x in zip("qkv", out.split(out.shape[-1] // 3, dim=-1)):
                    records[r][layer] = _heads(x, H, f"{name} ({r})")
            else:
                records[role][layer] = _heads(out, H if role == "q" else Hkv, f"{name} ({role})")

        return hook

    handles = [
        module.register_forward_hook(hook_for(role, i, name))
        for role, items in spec.items()
        for i, (name, module) in enumerate(items)
    ]
    try:
        _forward(model, inputs)
    finally:
        for h in handles:
            h.remove()
    return records, next(iter(counts.values()))


_MAX_TOKEN_ID = 2**63 - 1  # int64
#: Config attributes that state a model's position limit (BERT/LLaMA, GPT-2, others).
_POSITION_LIMITS = ("max_position_embeddings", "n_positions", "max_sequence_length", "n_ctx")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model")


def read_token_ids(path) -> tuple[torch.Tensor, torch.Tensor]:
    """Read a token-id file: one sequence per non-empty line, ids separated by whitespace.

    Returns ``(input_ids [B, T], attention_mask [B, T])``; shorter lines are right-padded with
    ``0`` and masked out.
    """
    path = Path(path)
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            ids = [int(tok) for tok in line.split()]
        except ValueError:
            raise ValueError(f"{path}:{lineno}: token ids must be whitespace-separated integers, got {line.strip()[:60]!r}") from None
        if min(ids) < 0:
            raise ValueError(f"{path}:{lineno}: token ids must be >= 0, got {min(ids)}")
        if max(ids) > _MAX_TOKEN_ID:
            raise ValueError(
                f"{path}:{lineno}: token id {max(ids)} is beyond the largest id a tensor can hold "
                f"(2**63 - 1 = {_MAX_TOKEN_ID}); no vocabulary is that large"
            )
        rows.append(ids)
    if not rows:
        raise ValueError(f"{path}: no token ids (the file holds no non-empty line)")
    T = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return ids, mask


def _check_against_model(config, ids: torch.Tensor, mask: torch.Tensor, what: str, seq_len: int) -> None:
    """Token ids inside the vocabulary and sequences within the position limit, or ``ValueError``."""
    vocab = getattr(config, "vocab_size", None)
    valid = mask.to(torch.bool)
    if isinstance(vocab, int) and bool((ids[valid] >= vocab).any()):
        row, col = (int(i) for i in ((ids >= vocab) & valid).nonzero()[0])
        raise ValueError(
            f"{what}: token id {int(ids[valid].max())} is outside the model's vocabulary of {vocab} "
            f"(ids must be < {vocab}; the first offending id is {int(ids[row, col])} in sequence {row + 1}, position {col})"
        )
    limit, attr = position_limit(config)
    if limit is not None and ids.shape[1] > limit:
        raise ValueError(
            f"{what}: a sequence of {ids.shape[1]} tokens exceeds the model's position limit of {limit} "
            f"(config.{attr}); pass seq_len (--seq-len) <= {limit} (now {seq_len})"
        )


def position_limit(config) -> tuple[int | None, str | None]:
    """``(limit, attribute)``: the longest sequence ``config`` admits, or ``(None, None)``."""
    for attr in _POSITION_LIMITS:
        limit = getattr(config, attr, None)
        if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
            return limit, attr
    return None, None


def split_sequences(rows: Sequence[Sequence[int]], *, seq_len: int, max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut token sequences into pieces of at most ``seq_len`` tokens, keeping ``max_tokens`` in all.

    Each row is cut in order into ``seq_len``-token pieces (its last piece shorter); pieces are
    kept in order until ``max_tokens`` tokens are taken (the last one cut short). Returns
    ``(input_ids [S, seq_len'], attention_mask [S, seq_len'])``, right-padded with ``0`` (masked).
    """
    seq_len = check_positive_int(seq_len, "seq_len")
    max_tokens = check_positive_int(max_tokens, "max_tokens")
    pieces, left = [], max_tokens
    for row in rows:
        for start in range(0, len(row), seq_len):
            if left == 0:
                break
            piece = list(row[start:start + min(seq_len, left)])
            pieces.append(piece)
            left -= len(piece)
    if not pieces:
        raise ValueError("split_sequences: no tokens to split (every sequence is empty)")
    width = max(len(piece) for piece in pieces)
    ids = torch.zeros(len(pieces), width, dtype=torch.long)
    mask = torch.zeros(len(pieces), width, dtype=torch.long)
    for i, piece in enumerate(pieces):
        ids[i, : len(piece)] = torch.tensor(piece, dtype=torch.long)
        mask[i, : len(piece)] = 1
    return ids, mask


def capture_pretrained(model_dir=None, *, gguf=None, text=None, token_ids=None, max_tokens: int = 512,
                       seq_len: int = 512, point: str = "auto", path=None) -> QKDump:
    """Load a local transformers model directory (or GGUF file) and capture Q/K/V on a text or token-id file.

    Parameters
    ----------
    model_dir : str or Path
        A directory written by ``save_pretrained`` (``config.json`` + weights), loaded with
        ``AutoModel.from_pretrained(model_dir, local_files_only=True)``; nothing is downloaded.
    gguf : str or Path, optional
        Instead of ``model_dir``: a GGUF file (e.g. SmolLM2's, :func:`sketchlab.hf.pretrained.smollm2_gguf`),
        which holds the weights and the tokenizer, read by transformers' ``gguf_file=``
        (:func:`sketchlab.hf.pretrained.load_pretrained`; the ``gguf`` package).
    text : str or Path, optional
        A UTF-8 text file, tokenised by the directory's (or the GGUF file's) tokenizer
        (``AutoTokenizer.from_pretrained(model_dir, local_files_only=True)``).
    token_ids : str or Path, optional
        Instead of ``text`` (for a directory without a tokenizer): one sequence of integer ids
        per line (:func:`read_token_ids`).
    max_tokens : int
        Tokens captured in all (the text's first ``max_tokens``).
    seq_len : int
        Longest sequence: a longer text (or line of ids) is cut into as many sequences of
        ``seq_len`` tokens as it needs (:func:`split_sequences`; attention never crosses them, and
        ``meta["tokens"]`` lists their lengths). At most the model's position limit
        (``config.max_position_embeddings`` or ``n_positions``).
    point : {"auto", "attention", "projections"}
        Where to capture (:func:`capture_qk`): by default post-RoPE through the attention interface.
    path : str or Path, optional
        Write the dump there (:func:`sketchlab.io.save_qk`).

    Returns
    -------
    QKDump as :func:`capture_qk`.

    Raises
    ------
    ValueError
        Unreadable model directory (missing, truncated or corrupt weights or config), no usable
        tokenizer for ``text``, a token id outside the vocabulary (or beyond int64), or a
        ``seq_len`` beyond the model's position limit; each message names the file and the rule.
    """
    max_tokens = check_positive_int(max_tokens, "max_tokens")
    seq_len = check_positive_int(seq_len, "seq_len")
    if (text is None) == (token_ids is None):
        raise ValueError("give exactly one of text (a text file) or token_ids (a token-id file)")
    if (model_dir is None) == (gguf is None):
        raise ValueError("give exactly one of model_dir (a save_pretrained directory) or gguf (a .gguf file)")
    try:
        from transformers import AutoModel, AutoTokenizer
    except ImportError as err:  # the optional extra
        raise ImportError("capturing from a model directory needs transformers: pip install 'sketchlab[capture]'") from err
    tokenizer = None
    if gguf is not None:
        model, tokenizer = load_pretrained(gguf=gguf)
        model_dir = Path(gguf)  # named in messages and in meta["source"]
    else:
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"{model_dir}: not a transformers model directory (no config.json)")
        model = from_local(AutoModel, str(model_dir), str(model_dir), model_dir)
    if text is not None and tokenizer is None:
        if not any((model_dir / f).is_file() for f in _TOKENIZER_FILES):
            raise ValueError(
                f"{model_dir}: no tokenizer in the model directory (none of {', '.join(_TOKENIZER_FILES)}); "
                f"pass token ids instead (token_ids / --token-ids)"
            )
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        except (OSError, ValueError, TypeError) as err:
            raise ValueError(
                f"{model_dir}: no usable tokenizer in the model directory ({err}); pass token ids instead (token_ids / --token-ids)"
            ) from err
    if text is not None:
        text_path = Path(text)
        rows = [tokenizer(text_path.read_text(encoding="utf-8"))["input_ids"]]
        if not rows[0]:
            raise ValueError(f"{text_path}: the text produced no tokens")
        what = f"text {text_path.name}"
    else:
        ids, mask = read_token_ids(token_ids)
        rows = [r[m.bool()].tolist() for r, m in zip(ids, mask)]
        what = f"token ids {Path(token_ids).name}"
    ids, mask = split_sequences(rows, seq_len=seq_len, max_tokens=max_tokens)
    _check_against_model(model.config, ids, mask, str(text if text is not None else token_ids), seq_len)
    inputs = {"input_ids": ids, "attention_mask": mask}
    meta = {"source": f"{model_dir.name} ({model.config.model_type}) on {what}"}
    return capture_qk(model, inputs, point=point, path=path, meta=meta)
