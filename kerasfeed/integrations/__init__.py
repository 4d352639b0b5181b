"""Integrations with training loops (Keras callbacks)."""
