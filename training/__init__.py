"""Training: torch DFlash drafter, target features, losses, trainers."""
