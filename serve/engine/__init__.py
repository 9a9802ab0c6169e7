"""Inference engines behind one interface (see base.py): hf (transformers reference), native, vllm."""
