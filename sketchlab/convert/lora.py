"""Stage 2 of :func:`sketchlab.linearize`: LoRA adapters (peft) on the attention projections, trained with
the next-token loss (causal LMs) or the distance to the teacher's final hidden states (encoders), then merged
into the weights."""

from __future__ import annotations

import torch
from torch import nn

from .._validation import check_positive_int
from .convert import converted_modules
from .evaluate import progress_bar
from .families import FAMILY_TABLE, family_of

__all__ = ["lora_finetune"]


def check_lora_model(family: str, steps: int, name: str) -> None:
    """The LoRA stage's rule on the model (``family``, :func:`~sketchlab.convert.families.family_of`), checked
    before any work: peft adapts transformers models, not sketchlab's toy model. ``steps`` (0: no stage)
    is the argument ``name`` the refusal names (``lora_steps`` of :func:`sketchlab.linearize`)."""
    if steps and family == "toy":
        raise ValueError(f"{name}={steps}: the LoRA stage supports transformers models (peft), not the toy model "
                         "(sketchlab.tasks.TransformerLM); fine-tune it with sketchlab.tasks.train_mqar")


def lora_finetune(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, train_idx, *, steps: int, rank: int = 8,
                  lr: float = 1e-4, batch_size: int = 1, seed: int = 0, teacher_hidden: torch.Tensor | None = None,
                  progress: bool = False):
    r"""Stage 2: LoRA (peft) on the attention projections of ``model``, merged into the weights afterwards.

    AdamW (no weight decay) on adapters of rank ``rank`` (``lora_alpha = 2·rank``) over the query,
    key, value and output projections, ``steps`` steps on random batches of ``batch_size`` of the
    sequences ``train_idx`` of ``ids, mask [N, T]``; loss: the next-token cross-entropy (causal LMs),
    or with ``teacher_hidden [N, T, hidden]`` the mean squared distance of the final hidden states to
    the teacher's over the valid tokens (encoders). Works on converted models (the feature maps keep
    their ``requires_grad``) and on unconverted ones alike (the same adaptation of the teacher
    itself or of a window-only model: the control for what LoRA on the training text alone buys).

    Returns
    -------
    (model, losses)
        The merged model (no peft wrappers left) and the loss of every step.
    """
    steps = check_positive_int(steps, "steps")
    rank = check_positive_int(rank, "rank")
    batch_size = check_positive_int(batch_size, "batch_size")
    if not (isinstance(lr, (int, float)) and not isinstance(lr, bool) and 0 < lr < float("inf")):
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
    family = family_of(model)
    check_lora_model(family, steps, "steps")
    if not (isinstance(ids, torch.Tensor) and isinstance(mask, torch.Tensor) and ids.dim() == 2
            and ids.shape == mask.shape):
        raise ValueError(f"ids and mask must be tensors of one shape [N, T], got "
                         f"{getattr(ids, 'shape', type(ids).__name__)} and {getattr(mask, 'shape', type(mask).__name__)}")
    train_idx = torch.as_tensor(train_idx)
    if train_idx.dim() != 1 or train_idx.numel() == 0 or train_idx.is_floating_point() \
            or int(train_idx.min()) < 0 or int(train_idx.max()) >= ids.shape[0]:
        raise ValueError(f"train_idx must be a non-empty list of sequence indices in [0, {ids.shape[0]}), "
                         f"got {train_idx.tolist()}")
    if (family != "toy" and FAMILY_TABLE[family].encoder) != (teacher_hidden is not None):
        raise ValueError("teacher_hidden [N, T, hidden] is the loss of an encoder (BERT family) and only of one: "
                         f"got {'none' if teacher_hidden is None else 'one'} for a {family} model")
    if teacher_hidden is not None and tuple(teacher_hidden.shape[:2]) != tuple(ids.shape):
        raise ValueError(f"teacher_hidden must be [N, T, hidden] with [N, T] = {list(ids.shape)}, got "
                         f"{list(teacher_hidden.shape)}")
    return _lora(model, family, ids, mask, train_idx, teacher_hidden, steps=steps,
                 rank=rank, lr=float(lr), batch_size=batch_size, seed=seed, progress=progress)


def _lora(model, family, ids, mask, train_idx, teacher_hidden, *, steps, rank, lr, batch_size, seed, progress):
    """Stage 2 (:func:`lora_finetune`, unchecked: ``model`` a transformers model, :func:`check_lora_model`)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:
        raise ImportError("the LoRA stage needs peft: pip install 'sketchlab[lm]'") from err
    entry = FAMILY_TABLE[family]  # the family's LoRA targets, from the one table
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=entry.lora,
                        fan_in_fan_out=entry.lora_fan_in_fan_out)
    sketch_grad = {id(p): p.requires_grad for s in converted_modules(model, required=False) for p in s.parameters()}
    peft_model = get_peft_model(model, config)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    curve = []
    peft_model.train()
    bar = progress_bar(steps, "stage 2: LoRA", progress, unit="step", leave=True)
    for step in range(steps):
        sel = train_idx[torch.randint(len(train_idx), (min(batch_size, len(train_idx)),), generator=gen)]
        b_ids, b_mask = ids[sel], mask[sel]
        if teacher_hidden is None:
            labels = b_ids.masked_fill(b_mask == 0, -100)
            loss = peft_model(input_ids=b_ids, attention_mask=b_mask, labels=labels, use_cache=False).loss
        else:
            h = peft_model(input_ids=b_ids, attention_mask=b_mask).last_hidden_state
            valid = b_mask.to(torch.bool)
            loss = ((h - teacher_hidden[sel]) ** 2)[valid].mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        curve.append(float(loss.detach()))
        bar.set_postfix(loss=f"{curve[-1]:.4f}")
        bar.update()
    bar.close()
    peft_model.eval()
    merged = peft_model.merge_and_unload()
    for s in converted_modules(merged, required=False):
        for p in s.parameters():
            p.requires_grad_(sketch_grad.get(id(p), True))
    return merged, curve
