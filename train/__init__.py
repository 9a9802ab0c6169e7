"""RL fine-tuning over the same agent loop, tools and chat format as deployment."""
