"""OpenAI-compatible inference server for Mixture-of-Experts models."""
