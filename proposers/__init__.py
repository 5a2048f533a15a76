"""vLLM-side DFlash drafter model, length head, budget policies and proposer."""
