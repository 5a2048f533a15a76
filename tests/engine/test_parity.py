"""Train/serve parity: for the same weights and contexts, the training-side drafter
computes vLLM's DFlash block logits (same argmax, fp32 tolerance), and the trainer's
target features equal the aux hidden states vLLM feeds the drafter. Checked on
several drafter shapes, including a drafter that reads the target's last layer (its
transformers hidden state is post-norm; vLLM's is not)."""

import pytest
import torch
from adaflash_vllm.training.checkpoint import load_drafter, save_drafter
from adaflash_vllm.training.drafter import DFlashDrafter
from adaflash_vllm.training.features import TargetModel

from adaflash_vllm.tiny import build_drafter
from tests.helpers import PROMPTS, make_llm, shutdown

pytestmark = pytest.mark.engine

K = 3
CONFIGS = {
    # name: (drafter layers, target_layer_ids, draft on every n-th step only)
    "1layer-taps01": (1, [0, 1], 1),
    "2layers-taps-last": (2, [0, 2], 1),  # layer 2 is the target's last layer
    "3layers-tap1": (3, [1], 1),
    # Steps without a draft write only context K/V (skip_drafting); the drafts after
    # them must still see the whole context.
    "2layers-skips": (2, [0, 2], 3),
}


def _stringent(path, seed: int):
    """Random weights with larger scale and non-unit norms, so that any mismatch in
    a norm, a projection or RoPE shows up in the logits."""
    cfg, state = load_drafter(path)
    g = torch.Generator().manual_seed(seed)
    for k, v in state.items():
        if k.endswith("norm.weight"):
            state[k] = 1.0 + 0.3 * torch.randn(v.shape, generator=g)
        else:
            state[k] = 0.15 * torch.randn(v.shape, generator=g)
    return save_drafter(path, cfg, state)


@pytest.fixture(scope="module", params=list(CONFIGS))
def captured(request, tiny, tmp_path_factory):
    layers, taps, draft_every = CONFIGS[request.param]
    path = build_drafter(
        tmp_path_factory.mktemp(request.param) / "drafter",
        tiny.target,
        num_layers=layers,
        target_layer_ids=taps,
        block_size=K + 1,
    )
    _stringent(path, seed=len(taps) * 10 + layers)
    llm = make_llm(tiny.target, tiny.spec(k=K, adaflash={}, model=str(path)))
    try:
        llm.collective_rpc("adaflash_capture_drafts", args=(True,))
        if draft_every > 1:
            llm.collective_rpc("adaflash_debug_draft_every", args=(draft_every,))
        from vllm import SamplingParams

        outs = llm.generate(
            PROMPTS[:3],
            SamplingParams(temperature=0, max_tokens=6 * draft_every, ignore_eos=True),
        )
        caps = llm.collective_rpc("adaflash_take_captures")[0]
        if draft_every > 1:
            gate = llm.collective_rpc("adaflash_budget_state")[0]["draft_gate"]
            assert gate["skipped_steps"] >= 2 * gate["drafted_steps"] > 0, gate
    finally:
        shutdown(llm)
    seqs = {
        o.request_id: list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
        for o in outs
    }
    return path, caps, seqs


def _seq_of(seqs: dict, req_id: str) -> list[int]:
    return seqs[req_id.split("-")[0]]


def test_block_logits_match_vllm(captured, tiny):
    path, caps, seqs = captured
    cfg, state = load_drafter(path)
    drafter = DFlashDrafter(cfg)
    drafter.load_state_dict(state)
    drafter.eval()
    target = TargetModel(tiny.target)
    checked = 0
    for cap in caps:
        for i, req_id in enumerate(cap["req_ids"]):
            seq = _seq_of(seqs, req_id)
            pos = cap["bonus_positions"][i]
            assert seq[pos] == cap["bonus_token_ids"][i]
            ids = torch.tensor([seq])
            feats, _ = target.features(ids, drafter.target_layer_ids, with_logits=False)
            anchors = torch.tensor([[pos]])
            block_ids, block_pos = drafter.make_blocks(ids, anchors, K)
            with torch.no_grad():
                hidden = drafter(
                    features=feats,
                    block_ids=block_ids,
                    block_positions=block_pos,
                    anchors=anchors,
                    embed_tokens=target.embed_tokens(),
                )
                ours = target.lm_head()(hidden[0, 0, 1:])
            theirs = torch.tensor(cap["logits"][i])
            assert torch.equal(ours.argmax(-1), theirs.argmax(-1)), (req_id, pos)
            assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4), (
                (ours - theirs).abs().max()
            )
            checked += 1
    assert checked >= 10


def test_features_match_vllm_aux_hidden_states(captured, tiny):
    """Every context token vLLM fed the drafter (accepted tokens; rejected drafts
    are not part of the final sequence) carries the trainer's feature vector."""
    path, caps, seqs = captured
    cfg, _ = load_drafter(path)
    taps = cfg["dflash_config"]["target_layer_ids"]
    target = TargetModel(tiny.target)
    ref = {}
    for rid, seq in seqs.items():
        feats, _ = target.features(torch.tensor([seq]), taps, with_logits=False)
        ref[rid] = (seq, feats[0])
    matched = rejected = 0
    for cap in caps:
        starts = cap["context_starts"]
        for i, req_id in enumerate(cap["req_ids"]):
            seq, feats = ref[req_id.split("-")[0]]
            for j in range(starts[i], starts[i + 1]):
                pos, tok = cap["context_positions"][j], cap["context_token_ids"][j]
                if pos >= len(seq) or seq[pos] != tok:
                    # a rejected draft, or a token past max_tokens: verified, dropped
                    rejected += 1
                    continue
                got = torch.tensor(cap["context_features"][j])
                assert torch.allclose(got, feats[pos], atol=1e-4, rtol=1e-4), (
                    req_id,
                    pos,
                    (got - feats[pos]).abs().max(),
                )
                matched += 1
    assert matched >= 15 and matched > rejected, (matched, rejected)
