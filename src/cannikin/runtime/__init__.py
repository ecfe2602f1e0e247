"""Torch runtime of Cannikin: distributed set-up, data sampling, emulation, checkpoints."""
