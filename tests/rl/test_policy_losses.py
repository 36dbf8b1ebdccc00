"""Each policy loss (GRPO, Dr. GRPO, GSPO, PPO), GAE, the value loss and the entropy on a
tiny batch, against values computed by hand."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from arena_rl.loss import entropy, gae, policy_loss, value_loss  # noqa: E402

# two sequences: A (advantage +1, two tokens), B (advantage -1, one token)
OLD = [[math.log(0.5), math.log(0.5)], [math.log(0.5), 0.0]]
NEW = [[math.log(0.75), math.log(0.5)], [math.log(0.25), 0.0]]
MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
ADV = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])


def batch():
    return torch.tensor(NEW, requires_grad=True), torch.tensor(OLD)


def test_dr_grpo_sums_token_terms_over_a_constant_not_the_lengths():
    new, old = batch()
    # token terms: A1 ratio 1.5 clipped to 1.2 -> -1.2; A2 ratio 1 -> -1.0; B1 ratio 0.5, A<0 -> +0.8
    out = policy_loss(new, old, ADV, MASK, variant="dr_grpo", max_tokens=4)
    assert out.loss.item() == pytest.approx(-1.4 / (2 * 4), abs=1e-6)
    padded_width = policy_loss(new, old, ADV, MASK, variant="dr_grpo")
    assert padded_width.loss.item() == pytest.approx(-1.4 / (2 * 2), abs=1e-6)
    out.loss.backward()
    # A2 (unclipped): d/dnew of -ratio*A / 8 = -1/8; the clipped tokens get nothing
    assert new.grad[0, 1].item() == pytest.approx(-1 / 8)
    assert new.grad[0, 0].item() == 0.0 and new.grad[1, 0].item() == 0.0


def test_ppo_averages_clipped_token_terms_over_tokens():
    new, old = batch()
    out = policy_loss(new, old, ADV, MASK, variant="ppo")
    assert out.loss.item() == pytest.approx(-1.4 / 3, abs=1e-6)
    assert out.clip_fraction == pytest.approx(2 / 3)


def test_gspo_clips_one_geometric_mean_ratio_per_sequence():
    new, old = batch()
    # A: ratio sqrt(1.5 * 1) = 1.2247, clipped to 1.2 -> -1.2; B: ratio 0.5, A<0 -> +0.8
    out = policy_loss(new, old, ADV, MASK, variant="gspo", clip_eps=0.2)
    assert out.loss.item() == pytest.approx((-1.2 + 0.8) / 2, abs=1e-6)
    assert out.clip_fraction == pytest.approx(1.0)  # both sequences clipped
    new, old = batch()
    wide = policy_loss(new, old, ADV, MASK, variant="gspo", clip_eps=0.3)
    s_a = math.sqrt(1.5)
    assert wide.loss.item() == pytest.approx((-s_a + 0.7) / 2, abs=1e-6)
    wide.loss.backward()
    # d(-s_A)/d new_A,t = -s_A / len(A), then / 2 sequences: the same for both of A's tokens
    assert new.grad[0, 0].item() == pytest.approx(-s_a / 2 / 2, abs=1e-6)
    assert new.grad[0, 1].item() == pytest.approx(-s_a / 2 / 2, abs=1e-6)
    assert new.grad[1, 0].item() == 0.0  # B's ratio is clipped


def test_grpo_with_a_kl_term_adds_k3_averaged_over_tokens():
    new, old = batch()
    ref = torch.tensor([[math.log(0.5), math.log(0.25)], [math.log(0.5), 0.0]])
    out = policy_loss(new, old, ADV, MASK, variant="grpo", ref_logprobs=ref, kl_coef=0.5)
    k3 = [math.exp(r - n) - (r - n) - 1 for r, n in ((math.log(0.5), math.log(0.75)),
                                                     (math.log(0.25), math.log(0.5)),
                                                     (math.log(0.5), math.log(0.25)))]
    assert out.kl == pytest.approx(sum(k3) / 3, abs=1e-6)
    assert out.loss.item() == pytest.approx((-1.1 + 0.8) / 2 + 0.5 * sum(k3) / 3, abs=1e-6)


def test_gae_runs_over_the_policy_tokens_only():
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 9.0, 0.6, 0.8]])  # position 1 is context: its value is never used
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    adv, returns = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    # j=3: 1 - 0.8 = 0.2; j=2: (0.8 - 0.6) + 0.5 * 0.2 = 0.3; j=0: (0.6 - 0.5) + 0.5 * 0.3 = 0.25
    assert adv.tolist()[0] == pytest.approx([0.25, 0.0, 0.3, 0.2])
    assert returns.tolist()[0] == pytest.approx([0.75, 0.0, 0.9, 1.0])
    monte_carlo, _ = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert monte_carlo.tolist()[0] == pytest.approx([0.5, 0.0, 0.4, 0.2])


def test_value_loss_takes_the_worse_of_clipped_and_unclipped():
    values, old, returns = torch.tensor([[1.0]]), torch.tensor([[0.5]]), torch.tensor([[2.0]])
    # unclipped (1 - 2)^2 = 1; clipped 0.5 + 0.2 = 0.7 -> (0.7 - 2)^2 = 1.69
    assert value_loss(values, old, returns, torch.ones(1, 1), clip=0.2).item() == pytest.approx(0.845)
    assert value_loss(values, old, returns, torch.ones(1, 1), clip=None).item() == pytest.approx(0.5)


def test_entropy_of_a_uniform_distribution_is_log_v():
    logits = torch.zeros(1, 2, 4)
    logits[0, 1] = torch.tensor([10.0, -10.0, -10.0, -10.0])  # nearly certain: masked out below
    assert entropy(logits, torch.tensor([[1.0, 0.0]])).item() == pytest.approx(math.log(4), abs=1e-6)


def test_an_unknown_loss_is_refused():
    new, old = batch()
    with pytest.raises(ValueError, match="unknown loss"):
        policy_loss(new, old, ADV, MASK, variant="reinforce")
