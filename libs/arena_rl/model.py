"""A small decoder-only transformer policy, written from scratch, CPU-trainable in minutes.

``PolicyModel`` (left-padding safe), ``completion_logprobs``, and policy blobs: how weights travel
and checkpoints are stored. See docs/rl.md ("The policy model").
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import msgspec
import torch
import torch.nn.functional as F
from torch import nn

from arena_rl.tokenizer import BOS, PAD, ROLE_IDS, UNK, CharTokenizer

NEVER_SAMPLED = (PAD, BOS, UNK, *ROLE_IDS.values())


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    vocab_size: int
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    max_len: int = 64

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError("d_model must be a multiple of n_heads")


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model))

    def forward(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        shape = (b, t, self.n_heads, d // self.n_heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class PolicyModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=True)
        banned = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        banned[list(NEVER_SAMPLED)] = True
        self.register_buffer("banned", banned, persistent=False)
        self.apply(_init)
        for block in self.blocks:  # GPT-2 style: residual projections scaled by depth
            nn.init.normal_(block.proj.weight, std=0.02 / math.sqrt(2 * cfg.n_layers))

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``ids``/``mask``: ``[B, T]``; returns logits ``[B, T, V]`` (``-inf`` on ids the
        policy never emits)."""
        b, t = ids.shape
        if t > self.cfg.max_len:
            raise ValueError(f"sequence of {t} tokens exceeds the model's context of {self.cfg.max_len}")
        if mask is None:
            mask = torch.ones_like(ids)
        mask = mask.bool()
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
        attn = causal[None] & mask[:, None, :]
        attn = attn | torch.eye(t, dtype=torch.bool, device=ids.device)[None]  # pads see themselves
        attn = attn[:, None]  # [B, 1, T, T], broadcast over heads
        x = self.tok(ids) + self.pos(pos)
        for block in self.blocks:
            x = block(x, attn)
        # the policy never emits padding, <s>, <unk> or a role token: only text and </s>
        return self.head(self.ln(x)).masked_fill(self.banned, float("-inf"))


def _init(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def new_policy(tokenizer: CharTokenizer, *, seed: int = 0, **config) -> PolicyModel:
    torch.manual_seed(seed)
    return PolicyModel(ModelConfig(vocab_size=tokenizer.vocab_size, **config))


def _completion_rows(model: PolicyModel, prompts: list[list[int]], completions: list[list[int]]) -> list[torch.Tensor]:
    """Each completion's next-token log-distributions (``[len(completion), vocab]``, temperature
    1) given its prompt, in one right-padded forward pass; differentiable."""
    seqs = [p + c for p, c in zip(prompts, completions, strict=True)]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    logp = torch.log_softmax(model(ids, mask).float(), dim=-1)
    return [logp[i, len(p) - 1 : len(p) - 1 + len(c)] for i, (p, c) in enumerate(zip(prompts, completions))]


def completion_logprobs(model: PolicyModel, prompts: list[list[int]], completions: list[list[int]]) -> list[torch.Tensor]:
    """Per-token log-probabilities (temperature 1) of each completion given its prompt,
    in one right-padded forward pass; differentiable."""
    return [rows.gather(-1, torch.tensor(c, dtype=torch.long)[:, None]).squeeze(-1)
            for rows, c in zip(_completion_rows(model, prompts, completions), completions, strict=True)]


@torch.no_grad()
def completion_entropy(model: PolicyModel, prompts: list[list[int]], completions: list[list[int]]) -> float:
    """The policy's mean entropy (nats) over every completion token's next-token distribution."""
    rows = [r for r in _completion_rows(model, prompts, completions) if len(r)]
    if not rows:
        return 0.0
    return float(torch.distributions.Categorical(logits=torch.cat(rows)).entropy().mean())  # 0·log 0 = 0


# ----------------------------------------------------------------------------- blobs and checkpoints


def to_blob(model: PolicyModel, tokenizer: CharTokenizer, version: int) -> bytes:
    buf = io.BytesIO()
    torch.save({"config": msgspec.to_builtins(model.cfg), "alphabet": tokenizer.alphabet, "version": int(version),
                "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()}}, buf)
    return buf.getvalue()


def from_blob(data: bytes) -> tuple[PolicyModel, CharTokenizer, int]:
    """Rebuild a policy from a blob. Raises ``ValueError`` on anything malformed."""
    try:
        raw = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        cfg = msgspec.convert(raw["config"], ModelConfig)
        tokenizer = CharTokenizer(alphabet=raw["alphabet"])
        model = PolicyModel(cfg)
        model.load_state_dict(raw["state_dict"])
        version = int(raw["version"])
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds; one clear error out
        raise ValueError(f"not a valid policy blob: {type(exc).__name__}: {exc}") from exc
    if cfg.vocab_size != tokenizer.vocab_size:
        raise ValueError(f"policy blob mismatch: vocab {cfg.vocab_size} vs alphabet of {tokenizer.vocab_size}")
    model.eval()
    return model, tokenizer, version


def save_checkpoint(path: str | Path, model: PolicyModel, tokenizer: CharTokenizer, version: int) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(to_blob(model, tokenizer, version))
    tmp.replace(path)  # atomic: a reader never sees half a checkpoint
    return path


def load_checkpoint(path: str | Path) -> tuple[PolicyModel, CharTokenizer, int]:
    return from_blob(Path(path).read_bytes())
