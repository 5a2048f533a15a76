"""The OPD loss reference: endpoints of the mix, the clip's sign rule, gradients."""

import torch
from adaflash_vllm.training.losses import (
    opd_loss_reference,
    opd_loss_rows_reference,
    position_decay_weights,
)


def _logits(n=6, v=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g), torch.randn(n, v, generator=g) * 2


def test_identical_distributions_give_zero_rkl():
    s, _ = _logits()
    rows = opd_loss_rows_reference(s, s.clone(), alpha=0.0, delta=float("inf"))
    assert rows.rkl.abs().max() < 1e-6


def test_alpha_one_is_plain_cross_entropy():
    s, t = _logits()
    rows = opd_loss_rows_reference(s, t, alpha=1.0, delta=0.01)
    ce = torch.nn.functional.cross_entropy(s, t.argmax(-1), reduction="none")
    assert torch.allclose(rows.loss, ce, atol=1e-6)


def test_delta_inf_is_unclipped_reverse_kl():
    s, t = _logits()
    rows = opd_loss_rows_reference(s, t, alpha=0.0, delta=float("inf"))
    lq, lp = s.log_softmax(-1), t.log_softmax(-1)
    assert torch.allclose(rows.loss, (lq.exp() * (lq - lp)).sum(-1), atol=1e-5)
    assert int(rows.clipped.sum()) == 0


def test_clipped_entries_get_zero_gradient():
    """An entry over delta contributes a constant: its own gradient term is 0."""
    s, t = _logits(n=1, v=5)
    s = torch.tensor([[4.0, 0.0, 0.0, 0.0, 0.0]], requires_grad=True)
    t = torch.tensor([[-4.0, 0.0, 0.0, 0.0, 0.0]])
    q, p = s.softmax(-1), t.softmax(-1)
    f = q * (q.log() - p.log()) - q + p
    delta = f[0, 0].item() / 2  # entry 0 is clipped, the others are not
    assert (f[0, 1:] < delta).all()
    rows = opd_loss_rows_reference(s, t, alpha=0.0, delta=delta)
    rows.loss.sum().backward()
    # expected gradient: q_u * (g_u [u unclipped] - sum_{v unclipped} q_v g_v)
    g = (q.log() - p.log()).detach()
    unclipped = torch.tensor([[False, True, True, True, True]])
    s_term = (q.detach() * g * unclipped).sum()
    want = q.detach() * (g * unclipped - s_term)
    assert torch.allclose(s.grad, want, atol=1e-6)
    assert int(rows.clipped) == 1


def test_sign_rule_negative_raw_entries_never_invert_the_objective():
    """Raw summands q(log q - log p) are negative where q < p. Clipping them (the
    pointwise rule) makes the loss negative and a gradient step *raises* KL(q||p);
    our Bregman entries stay >= 0 and the same step lowers it."""
    p_logits = torch.tensor([[0.0, 0.0, 0.0, 2.5]])
    p = p_logits.softmax(-1)

    def kl(a):
        return (a * (a.log() - p.log())).sum()

    def step(loss_fn):
        s = torch.tensor([[0.0, 0.0, 0.0, 2.0]], requires_grad=True)
        loss = loss_fn(s)
        loss.sum().backward()
        with torch.no_grad():
            return loss.detach(), kl((s - 0.5 * s.grad).softmax(-1))

    delta = 0.01
    q0 = torch.tensor([[0.0, 0.0, 0.0, 2.0]]).softmax(-1)
    raw = q0 * (q0.log() - p.log())
    assert raw[0, 3] < 0 < raw[0, 0]

    def pointwise(s):
        q = s.softmax(-1)
        return torch.clamp(q * (q.log() - p.log()), max=delta).sum(-1)

    naive_loss, naive_kl = step(pointwise)
    ours_loss, ours_kl = step(
        lambda s: opd_loss_rows_reference(s, p_logits, alpha=0.0, delta=delta).loss
    )
    assert naive_loss < 0 and naive_kl > kl(q0)  # the pitfall, reproduced
    assert ours_loss >= 0 and ours_kl < kl(q0)


def test_weights_and_decay():
    s, t = _logits(n=4)
    w = position_decay_weights(4, gamma=2.0)
    assert torch.allclose(w, torch.exp(-torch.arange(4.0) / 2))
    out = opd_loss_reference(
        s, t, alpha=0.8, delta=0.01, weights=torch.tensor([1.0, 0.0, 2.0, 0.0])
    )
    rows = opd_loss_rows_reference(s, t, alpha=0.8, delta=0.01)
    assert torch.allclose(out.loss, (rows.loss[0] + 2 * rows.loss[2]) / 3, atol=1e-6)
    assert out.total_entries == 2 * s.shape[1]
