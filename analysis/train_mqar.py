"""Train the MQAR softmax model and write the shipped Q/K dump (``make data``).

Writes, deterministically from ``--seed`` (same machine, same torch build, one thread):

- ``OUT/mqar_softmax/model.safetensors`` + ``config.json``: the trained checkpoint
  (:func:`sketchlab.tasks.train.save_checkpoint`; ``extra`` holds the task, curriculum and
  held-out accuracy);
- ``OUT/mqar_softmax_qk.safetensors``: q, k, v ``[L, H, n, d]`` float32 captured with
  :func:`sketchlab.capture.capture_qk` from ``capture_sequences`` held-out MQAR sequences of
  ``seq_len`` tokens each, joined along the token axis (n = 2 × 256 = 512 by default): the inputs of the softmax kernel (after RoPE, before the ``1/√d`` logit scaling).

Prints the held-out accuracy, the wall time and the SHA-256 of the dump.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from sketchlab.capture import capture_qk
from sketchlab.tasks.model import TransformerConfig, TransformerLM
from sketchlab.tasks.mqar import MQARConfig, mqar_batch
from sketchlab.tasks.train import evaluate_mqar, save_checkpoint, train_mqar

_CAPTURE_OFFSET = 2_000_003  # the captured sequence comes from its own stream (neither train nor eval)


@dataclass(frozen=True)
class Settings:
    seed: int = 0
    vocab_size: int = 65
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 4
    mlp_ratio: int = 2
    short_conv: int = 2
    # curriculum: (num_pairs, seq_len, steps)
    warm_pairs: int = 8
    warm_len: int = 64
    warm_steps: int = 200
    num_pairs: int = 24
    seq_len: int = 256
    steps: int = 100
    batch_size: int = 32
    lr: float = 1e-2
    weight_decay: float = 0.0
    eval_sequences: int = 1024
    # sequences captured into the dump, joined along the token axis: 2 × 256 = 512 tokens per head,
    # so a 25% hold-out keeps 128 tokens (> m = 64) and the held-out Theorem 3.1 floor is defined
    capture_sequences: int = 2


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data"), help="output folder (default: data)")
    for name, default in asdict(Settings()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    args = parser.parse_args(argv)
    s = Settings(**{k: getattr(args, k) for k in asdict(Settings())})

    torch.set_num_threads(1)  # bitwise determinism needs a fixed thread count; 1 is also fastest on a shared 2-core box
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(s.seed)
    model_cfg = TransformerConfig(vocab_size=s.vocab_size, d_model=s.d_model, n_heads=s.n_heads, n_layers=s.n_layers,
                                  mlp_ratio=s.mlp_ratio, short_conv=s.short_conv)
    model = TransformerLM(model_cfg)
    warm = MQARConfig(s.vocab_size, s.warm_pairs, s.warm_len)
    task = MQARConfig(s.vocab_size, s.num_pairs, s.seq_len)
    stages = [(warm, s.warm_steps), (task, s.steps)] if s.warm_steps else [(task, s.steps)]
    t0 = time.perf_counter()
    result = train_mqar(model, stages, batch_size=s.batch_size, lr=s.lr, weight_decay=s.weight_decay, seed=s.seed,
                        eval_sequences=256, progress=not args.no_progress)
    train_seconds = time.perf_counter() - t0
    acc = evaluate_mqar(model, task, num_sequences=s.eval_sequences, seed=s.seed)

    args.out.mkdir(parents=True, exist_ok=True)
    extra = {"settings": asdict(s), "task": task.to_dict(), "heldout_accuracy": acc,
             "heldout_sequences": s.eval_sequences,
             "stages": [{"task": h["task"], "steps": h["steps"], "heldout_accuracy": h["heldout_accuracy"]}
                        for h in result.history]}
    save_checkpoint(args.out / "mqar_softmax", model, extra=extra)

    tokens, _ = mqar_batch(task, s.capture_sequences, generator=torch.Generator().manual_seed(s.seed + _CAPTURE_OFFSET))
    meta = {
        "source": "sketchlab.tasks TransformerLM trained on MQAR by analysis/train_mqar.py "
                  f"(checkpoint data/mqar_softmax), seed {s.seed}",
        "scale": "none",
        "task": json.dumps(task.to_dict(), sort_keys=True),
        "model": json.dumps(model_cfg.to_dict(), sort_keys=True),
        "heldout_accuracy": f"{acc:.6f}",
        "input_ids": json.dumps(tokens.tolist()),  # [B, T]
    }
    dump_path = args.out / "mqar_softmax_qk.safetensors"
    dump = capture_qk(model, tokens, path=dump_path, meta=meta)
    digest = hashlib.sha256(dump_path.read_bytes()).hexdigest()
    print(json.dumps({"heldout_accuracy": acc, "heldout_sequences": s.eval_sequences,
                      "stage_accuracies": [h["heldout_accuracy"] for h in result.history],
                      "train_seconds": round(train_seconds, 1), "steps": result.steps,
                      "dump": str(dump_path), "shape": list(dump.q.shape), "sha256": digest}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
