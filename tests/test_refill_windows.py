"""The refilled shift stream's window accounting (bench/refill.py), engine-free."""

import pytest

from adaflash_vllm.bench.refill import Drafts, RefillWindows


def test_lockstep_windows_take_whole_steps():
    # 4 requests of one phase, 2 in flight, 3 tokens each: prompt step + 2 decodes
    w = RefillWindows([0, 0, 0, 0], window=2)
    assert w.add_step(1.0, [(0, 1, False, None), (1, 1, False, None)]) == []
    assert w.add_step(1.0, [(0, 1, False, None), (1, 1, False, None)]) == []
    (first,) = w.add_step(1.0, [(0, 1, True, None), (1, 1, True, None)])
    assert (first.phase, first.index, first.requests) == (0, 0, 2)
    assert (first.tokens, first.seconds) == (6, 3.0)
    assert first.tau == 1.0 and first.decode_rows == 4
    w.add_step(2.0, [(2, 1, False, None), (3, 1, False, None)])
    w.add_step(2.0, [(2, 1, False, None), (3, 1, False, None)])
    (second,) = w.add_step(2.0, [(2, 1, True, None), (3, 1, True, None)])
    assert (second.index, second.tokens, second.tok_s) == (1, 6, 1.0)


def test_tau_counts_decoding_steps_only():
    w = RefillWindows([0], window=1)
    w.add_step(1.0, [(0, 1, False, None)])  # the prompt's step: 1 token, not a round
    w.add_step(1.0, [(0, 3, False, None)])  # 2 accepted + 1
    (out,) = w.add_step(1.0, [(0, 4, True, None)])
    assert out.tokens == 8
    assert (out.decode_tokens, out.decode_rows) == (7, 2)
    assert out.tau == pytest.approx(3.5)
    assert out.verify_len == 1.0 and out.tau_speculative is None


def test_drafts_give_tau_and_verify_length_of_finished_requests():
    # two requests, 3 rounds each; request 1's last round was cut at max_tokens
    w = RefillWindows([0, 0], window=2)
    w.add_step(1.0, [(0, 1, False, None), (1, 1, False, None)])
    for _ in range(2):
        w.add_step(1.0, [(0, 2, False, None), (1, 1, False, None)])
    (out,) = w.add_step(
        1.0,
        [
            (0, 1, True, Drafts(drafted=6, rounds=2, accepted=2)),
            (1, 1, True, Drafts(drafted=3, rounds=1, accepted=1)),
        ],
    )
    assert out.decode_rows == 6
    assert out.tau == pytest.approx(1 + 3 / 6)  # the engine's count, not the cut
    assert out.verify_len == pytest.approx(1 + 9 / 6)
    assert out.tau_speculative == pytest.approx(1 + 3 / 3)
    assert out.verify_len_speculative == pytest.approx(1 + 9 / 3)


def test_a_window_counts_the_whole_lives_of_its_requests():
    # request 0 runs 3 rounds in window 0's time but finishes in window 1
    w = RefillWindows([0, 0], window=1)
    w.add_step(1.0, [(0, 1, False, None), (1, 1, False, None)])
    (a,) = w.add_step(1.0, [(0, 1, False, None), (1, 1, True, None)])
    (b,) = w.add_step(1.0, [(0, 1, True, None)])
    assert (a.requests, a.decode_rows, b.decode_rows) == (1, 1, 2)
    assert a.tokens == 4 and b.tokens == 1  # tokens by time


def test_mixed_steps_share_time_by_requests():
    # phase 0: request 0; phase 1: requests 1, 2; all in one step
    w = RefillWindows([0, 1, 1], window=8)
    w.add_step(3.0, [(0, 1, False, None), (1, 1, False, None), (2, 1, False, None)])
    out = w.add_step(6.0, [(0, 5, True, None), (1, 1, True, None), (2, 1, True, None)])
    assert [(x.phase, x.requests) for x in out] == [(0, 1), (1, 2)]
    assert out[0].seconds == pytest.approx(3.0)  # a third of each step
    assert out[1].seconds == pytest.approx(6.0)
    assert out[0].tok_s == pytest.approx(2.0)  # 6 tokens in 3 s
    assert out[1].tok_s == pytest.approx(4 / 6)


def test_later_phase_waits_for_the_earlier_phase():
    # window 1: request 1 (phase 1) ends before request 0 (phase 0)
    w = RefillWindows([0, 1], window=1)
    w.add_step(1.0, [(0, 1, False, None), (1, 1, False, None)])
    assert w.add_step(1.0, [(0, 1, False, None), (1, 1, True, None)]) == []  # held back
    out = w.add_step(1.0, [(0, 1, True, None)])
    assert [x.phase for x in out] == [0, 1]


def test_last_window_of_a_phase_closes_short():
    w = RefillWindows([0, 0, 0], window=2)
    w.add_step(1.0, [(0, 1, True, None), (1, 1, False, None)])
    (a,) = w.add_step(1.0, [(1, 1, True, None), (2, 1, False, None)])
    (b,) = w.add_step(1.0, [(2, 1, True, None)])
    assert (a.requests, b.requests) == (2, 1)


def test_step_without_output_goes_to_the_oldest_request():
    w = RefillWindows([0, 1], window=1)
    w.add_step(1.0, [])  # a prompt chunk of request 0
    (a,) = w.add_step(1.0, [(0, 1, True, None)])
    assert a.seconds == 2.0


def test_requests_out_of_phase_order_are_refused():
    with pytest.raises(ValueError, match="phase order"):
        RefillWindows([1, 0], window=1)
    with pytest.raises(ValueError, match="window"):
        RefillWindows([0], window=0)
