"""The GRPO loss on a tiny batch computed by hand, and the pieces the trainer feeds it."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from arena_rl.loss import grpo_loss, pad  # noqa: E402
from arena_rl.model import completion_logprobs, from_blob, new_policy, to_blob  # noqa: E402
from arena_rl.tokenizer import BOS, EOS, ROLE_IDS, CharTokenizer  # noqa: E402
from arena_rl.generate import GenRequest, generate  # noqa: E402


def test_grpo_loss_matches_a_hand_computed_batch():
    # two sequences: A (advantage +1, two tokens), B (advantage -1, one token)
    old = torch.tensor([[math.log(0.5), math.log(0.5)], [math.log(0.5), 0.0]])
    new = torch.tensor([[math.log(0.75), math.log(0.5)], [math.log(0.25), 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    out = grpo_loss(new, old, adv, mask, clip_eps=0.2)
    # A: ratios 1.5 (clipped to 1.2 since A>0) and 1.0 -> token losses -1.2, -1.0 -> mean -1.1
    # B: ratio 0.5, A<0: min(0.5*-1, 0.8*-1) = -0.8 -> loss 0.8
    # sequence aggregation: (-1.1 + 0.8) / 2 = -0.15
    assert out.loss.item() == pytest.approx(-0.15, abs=1e-6)
    assert out.clip_fraction == pytest.approx(2 / 3)  # token A1 and B1 were clipped
    assert out.tokens == 3
    assert out.pg_loss == pytest.approx((-1.2 - 1.0 + 0.8) / 3, abs=1e-6)
    token = grpo_loss(new, old, adv, mask, clip_eps=0.2, aggregation="token")
    assert token.loss.item() == pytest.approx((-1.2 - 1.0 + 0.8) / 3, abs=1e-6)
    out.loss.backward()
    # clipped tokens get no gradient; A2 gets -ratio*A/2/2 = -0.25 (per-seq mean, then /2 sequences)
    assert new.grad[0, 0].item() == 0.0 and new.grad[1, 0].item() == 0.0
    assert new.grad[0, 1].item() == pytest.approx(-0.25)


def test_kl_term_is_k3_and_zero_at_the_reference():
    new = torch.tensor([[math.log(0.5)]])
    ref = torch.tensor([[math.log(0.25)]])
    out = grpo_loss(new, new.detach(), torch.tensor([0.0]), torch.ones(1, 1), ref_logprobs=ref, kl_coef=0.1)
    # k3 = exp(ref-new) - (ref-new) - 1 = 0.5 - ln(0.5) - 1
    assert out.kl == pytest.approx(0.5 - math.log(0.5) - 1)
    assert out.loss.item() == pytest.approx(0.1 * out.kl, rel=1e-5)
    same = grpo_loss(new, new, torch.tensor([1.0]), torch.ones(1, 1), ref_logprobs=new, kl_coef=0.1)
    assert same.kl == 0.0
    with pytest.raises(ValueError, match="kl_coef"):
        grpo_loss(new, new, torch.tensor([1.0]), torch.ones(1, 1), kl_coef=0.1)


def test_pad_and_shape_errors():
    values, mask = pad([torch.tensor([1.0, 2.0]), torch.tensor([3.0])])
    assert values.tolist() == [[1.0, 2.0], [3.0, 0.0]] and mask.tolist() == [[1, 1], [1, 0]]
    with pytest.raises(ValueError, match="shape mismatch"):
        grpo_loss(values, values[:1], torch.zeros(2), mask)


def test_tokenizer_chat_template_and_unknown_characters():
    tok = CharTokenizer(alphabet="0123456789")
    ids = tok.render_chat([{"role": "user", "content": "12x"}])
    assert ids[0] == BOS and ids[1] == ROLE_IDS["user"] and ids[-1] == ROLE_IDS["assistant"]
    assert tok.decode(ids) == "12"  # the unknown 'x' encodes as <unk>, which decodes to nothing
    with pytest.raises(ValueError, match="role"):
        tok.render_chat([{"role": "robot", "content": "1"}])


def test_left_padded_batch_equals_each_sequence_alone_and_blobs_round_trip():
    tok = CharTokenizer(alphabet="0123456789")
    model = new_policy(tok, seed=3, d_model=32, n_layers=1, max_len=16).eval()
    reqs = [GenRequest(prompt_ids=tok.render_chat([{"role": "user", "content": "7" * k}]), max_tokens=4, seed=k)
            for k in (1, 3, 5)]
    results = generate(model, reqs)
    for req, res in zip(reqs, results, strict=True):
        assert all(t == EOS or t >= 7 for t in res.token_ids)  # never a pad/bos/unk/role token
        direct = completion_logprobs(model, [req.prompt_ids], [res.token_ids])[0]
        assert torch.allclose(direct, torch.tensor(res.logprobs), atol=1e-5)
    clone, tok2, version = from_blob(to_blob(model, tok, 7))
    assert version == 7 and tok2 == tok
    assert generate(clone, reqs)[0].token_ids == results[0].token_ids
    with pytest.raises(ValueError, match="not a valid policy blob"):
        from_blob(b"garbage")


def test_the_proxy_records_the_version_that_served_the_call():
    from arena_core.schemas import SamplingParams, Timings
    from arena_rollout.proxy.capture import capture

    response = {"model": "m", "policy_version": "7", "prompt_token_ids": [1, 5, 7, 6],
                "choices": [{"message": {"role": "assistant", "content": "1"}, "token_ids": [8, 2],
                             "logprobs": {"content": [{"token": "1", "logprob": -0.5}, {"token": "</s>",
                                                                                      "logprob": -0.1}]},
                             "finish_reason": "stop"}]}
    kw = dict(rollout_id="r", step_index=0, request={"messages": [{"role": "user", "content": "0"}]},
              applied=SamplingParams(), backend="http://x/v1", timings=Timings(), started_at=0.0)
    assert capture(response=response, policy_version="6", **kw).policy_version == "7"  # the answer wins
    del response["policy_version"]
    assert capture(response=response, policy_version="6", **kw).policy_version == "6"  # else the registry's
