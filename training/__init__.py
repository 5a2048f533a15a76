"""Training: torch DFlash drafter, target features, losses, offline and online trainers."""
