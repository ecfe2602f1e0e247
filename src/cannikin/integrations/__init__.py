"""Cannikin inside training frameworks (optional extras: each module imports its framework)."""
