"""Train with TRL's ``DPOTrainer`` on Arena's ``dpo`` Parquet export.

    arena export --view dpo --format parquet --out exports/dpo ...
    HF_HUB_OFFLINE=1 python examples/trl-from-export/train_dpo.py --parquet exports/dpo

Each row of the ``dpo`` view is one pair from a group (the best member against the worst);
``pairs_from_rows`` turns it into TRL's conversational preference format
(``prompt`` / ``chosen`` / ``rejected`` as chat messages). Without ``--model`` the policy
is a tiny Llama built here from a seeded init with a character-level tokenizer, so the
example runs offline on a CPU in seconds; with ``--model DIR`` it loads a local Hugging
Face checkpoint (the hub is never contacted: ``HF_HUB_OFFLINE`` is set).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import string
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

#: A chat template that renders each message as ``<|role|>content`` + newline; it is
#: prefix-stable (prompt + completion renders as prompt then completion), which TRL needs
#: to split the prompt from the completion.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIALS = ["<pad>", "<unk>", "<bos>", "<eos>"]


@dataclass
class TrainResult:
    pairs: int
    steps: int
    losses: list[float] = field(default_factory=list)  # DPO loss at each logged step
    margins: list[float] = field(default_factory=list)  # mean reward(chosen) - reward(rejected), per batch
    #: ``(step, margin, accuracy)`` over ALL pairs: before training, every ``eval_every`` steps, at the end
    evals: list[tuple[int, float, float]] = field(default_factory=list)
    accuracies: list[float] = field(default_factory=list)  # fraction of pairs with chosen > rejected
    weights_changed: bool = False
    max_weight_delta: float = 0.0
    output_dir: str = ""


# --------------------------------------------------------------------------- data


def _common_prefix(a: list[dict], b: list[dict]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def pair_from_row(row: dict[str, Any]) -> dict[str, list[dict[str, str]]]:
    """One ``dpo`` row as TRL's conversational preference example.

    The prompt is what the two conversations share (for a single-turn rollout: the request
    messages); ``chosen``/``rejected`` are the rest of each conversation (the assistant
    turns, plus any tool/user turns of a multi-turn rollout that diverged).
    """
    chosen = [{"role": m["role"], "content": m["content"]} for m in row["chosen_messages"]]
    rejected = [{"role": m["role"], "content": m["content"]} for m in row["rejected_messages"]]
    if not chosen or not rejected:
        raise ValueError(f"dpo row of group {row.get('group_id')!r} has an empty conversation")
    n = _common_prefix(chosen, rejected)
    n = min(n, len(chosen) - 1, len(rejected) - 1)  # keep at least the last assistant turn on each side
    if n == 0:  # nothing shared: fall back on the first step's request messages
        n_prompt = json.loads(row["prompt_messages"] or "[]")
        return {"prompt": [{"role": m["role"], "content": str(m["content"])} for m in n_prompt],
                "chosen": chosen[len(n_prompt):] or chosen[-1:], "rejected": rejected[len(n_prompt):] or rejected[-1:]}
    return {"prompt": chosen[:n], "chosen": chosen[n:], "rejected": rejected[n:]}


def load_pairs(parquet_dir: str | Path, *, cache_dir: str | None = None):
    """The ``dpo`` export under ``parquet_dir`` (hive partitions ``date=.../task=...``) as a
    ``datasets.Dataset`` with ``prompt``/``chosen``/``rejected`` columns."""
    import datasets

    parquet_dir = Path(parquet_dir)
    files = sorted(parquet_dir.rglob("*.parquet"))
    if not files:
        raise FileNotFoundError(f"no .parquet files under {parquet_dir} (run `arena export --view dpo "
                                f"--format parquet --out {parquet_dir}` first)")
    raw = datasets.load_dataset("parquet", data_files=[str(f) for f in files], split="train",
                                cache_dir=cache_dir)
    missing = {"chosen_messages", "rejected_messages", "prompt_messages"} - set(raw.column_names)
    if missing:
        raise ValueError(f"{parquet_dir} is not a dpo export (missing columns {sorted(missing)}); "
                         f"export it with --view dpo")
    return raw.map(pair_from_row, remove_columns=raw.column_names)


# --------------------------------------------------------------------------- tiny local policy


def tiny_tokenizer():
    """A character-level tokenizer over printable ASCII, built locally (no download)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(string.printable))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>",
                                  bos_token="<bos>", eos_token="<eos>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_model(vocab_size: int, *, seed: int = 0):
    """A 2-layer, d=32 Llama (~50K parameters), seeded init."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                         pad_token_id=0, bos_token_id=2, eos_token_id=3, tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def load_policy(model: str | None, *, seed: int = 0):
    if model is None:
        tok = tiny_tokenizer()
        return tiny_model(len(tok), seed=seed), tok
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return AutoModelForCausalLM.from_pretrained(model, local_files_only=True), tok


# --------------------------------------------------------------------------- training


def train(parquet_dir: str | Path, output_dir: str | Path, *, model: str | None = None, max_steps: int = 8,
          batch_size: int = 4, learning_rate: float = 5e-3, beta: float = 0.1, seed: int = 0,
          eval_every: int = 0) -> TrainResult:
    """Run TRL's ``DPOTrainer`` for ``max_steps`` on the pairs under ``parquet_dir``, on CPU.

    The implicit reward margin (``beta * (log-ratio chosen - log-ratio rejected)``) is
    measured over all the pairs before training, every ``eval_every`` steps (0: never)
    and at the end."""
    import torch
    from trl import DPOConfig, DPOTrainer

    output_dir = Path(output_dir)
    pairs = load_pairs(parquet_dir, cache_dir=str(output_dir / "hf-cache"))
    policy, tokenizer = load_policy(model, seed=seed)
    before = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    args = DPOConfig(
        output_dir=str(output_dir), max_steps=max_steps, per_device_train_batch_size=batch_size,
        learning_rate=learning_rate, beta=beta, logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=True, seed=seed, dataloader_num_workers=0, disable_tqdm=True,
        lr_scheduler_type="constant", warmup_steps=0, per_device_eval_batch_size=batch_size,
        eval_strategy="steps" if eval_every else "no", eval_steps=eval_every or None,
    )
    # the reference is a frozen copy of the starting policy (TRL would otherwise reload it
    # from the model's hub id, which a model built in memory does not have)
    reference = copy.deepcopy(policy).eval()
    trainer = DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=pairs, eval_dataset=pairs,
                         processing_class=tokenizer)
    start = trainer.evaluate()  # step 0: the policy equals the reference (train() resets the log)
    trainer.train()
    if trainer.state.global_step % (eval_every or max_steps + 1):
        trainer.evaluate()  # the end, unless the last periodic evaluation was at the end
    evals = {0: start} | {h["step"]: h for h in trainer.state.log_history if "eval_rewards/margins" in h}
    logs = [h for h in trainer.state.log_history if "loss" in h and "rewards/margins" in h]
    deltas = [(policy.state_dict()[k].float() - v.float()).abs().max().item() for k, v in before.items()]
    result = TrainResult(
        pairs=len(pairs), steps=trainer.state.global_step,
        losses=[float(h["loss"]) for h in logs], margins=[float(h["rewards/margins"]) for h in logs],
        accuracies=[float(h.get("rewards/accuracies", float("nan"))) for h in logs],
        evals=[(step, float(h["eval_rewards/margins"]), float(h["eval_rewards/accuracies"]))
               for step, h in sorted(evals.items())],
        max_weight_delta=max(deltas), output_dir=str(output_dir),
    )
    result.weights_changed = result.max_weight_delta > 0.0 and not any(
        torch.isnan(p).any().item() for p in policy.parameters())
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parquet", required=True, help="directory of `arena export --view dpo --format parquet`")
    p.add_argument("--out", default="runs/trl-dpo", help="TRL output directory")
    p.add_argument("--model", default=None, help="a LOCAL Hugging Face model directory (default: a tiny "
                                                 "model built here)")
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=0, help="measure the margin over all pairs every N steps")
    a = p.parse_args(argv)
    try:
        r = train(a.parquet, a.out, model=a.model, max_steps=a.max_steps, batch_size=a.batch_size,
                  learning_rate=a.lr, beta=a.beta, seed=a.seed, eval_every=a.eval_every)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{r.pairs} pairs, {r.steps} steps")
    print(f"{'step':>4} {'loss':>8} {'margin':>8} {'acc':>5}")
    for i, (loss, m, acc) in enumerate(zip(r.losses, r.margins, r.accuracies), 1):
        print(f"{i:>4} {loss:8.4f} {m:8.4f} {acc:5.2f}")
    print("over all pairs:")
    print(f"{'step':>4} {'margin':>8} {'acc':>5}")
    for step, m, acc in r.evals:
        print(f"{step:>4} {m:8.4f} {acc:5.2f}")
    print(f"weights changed: {r.weights_changed} (max |delta| {r.max_weight_delta:.3g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
